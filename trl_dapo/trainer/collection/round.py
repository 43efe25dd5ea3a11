"""One candidate round through TRL's `_generate_and_score_completions`, and what DAPO's hooks exchange inside it.

TRL's method generates (`_generate_single_turn`, called through `_generate`), then scores (`_calculate_rewards`),
then computes advantages; what it returns carries neither the engine's logprobs and counts nor the raw per-function
rewards. A `RoundContext` is opened around each call: the two hooks read what the round hands them (stream mode's rows,
already generated and scored) and record what they learn. The round relies on one fact of TRL's internals, written
here once and pinned by `tests/test_grpo_compat.py`: within one call, generation runs before scoring, and scoring runs
once. TRL's path (`generate`, or vLLM, both inside `_generate_single_turn`) generates once, then once more per
tool-calling turn; trl-dapo's engine and stream mode's rows are generated once, the only generation of their round; a
`rollout_func` generates without the hook, so only the scoring is seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ...integrity import RolloutIntegrityError, check_completions, check_groups
from ...rollout_batch import (
    LOGPROB_KEYS,
    OLD_LOGPROBS_STEP,
    PADDED_KEYS,
    ROW_KEYS,
    SAMPLING_STEP,
    RolloutBatch,
    gather_rollout,
    loss_mask,
    num_rows,
)
from ...sampling import GenerationStats

if TYPE_CHECKING:
    from ..configuration import TRLView

# Keys TRL may return that carry nothing DAPO needs once the rollout logprobs are recorded.
DROPPED_KEYS = ("num_items_in_batch", "sampling_per_token_logps", "importance_sampling_ratio")


@dataclass
class RoundScores:
    """What `_calculate_rewards` knows of a round and TRL's output drops, for every rank's rows."""

    rewards: torch.Tensor  # (rows, reward functions), NaN where a function does not apply
    completion_lengths: torch.Tensor  # tokens per completion
    truncated: torch.Tensor  # cut at max_completion_length: the last token is neither EOS nor padding (TRL's rule)


@dataclass
class StreamedRows:
    """A rank's share of rows the engine generated before TRL's method was called (stream mode's kept groups, or the
    groups a partial round delivers), handed to that method: what `_generate_single_turn` returns instead of
    generating, and the rewards `_calculate_rewards` returns instead of scoring again (None: TRL scores them)."""

    prompt_ids: list[list[int]]
    completions: list[list[int]]
    logprobs: torch.Tensor  # (rows, max_new_tokens)
    rewards: torch.Tensor | None  # (rows, reward functions), this rank's rows; None: scored by TRL's method
    token_steps: torch.Tensor  # (rows, max_new_tokens): the optimizer step whose weights sampled each token


@dataclass
class RoundContext:
    """What one call of TRL's method exchanges between the round and DAPO's hooks."""

    streamed: StreamedRows | None = None  # in: rows already generated (stream mode, partial rounds)
    generations: int = 0  # calls of the generation hook so far
    engine_logprobs: torch.Tensor | None = None  # out: the sampled tokens' logprobs, where trl-dapo's engine generated
    generation: GenerationStats = field(default_factory=GenerationStats)  # out: the engine's counts of this call
    scores: RoundScores | None = None  # out: the rewards and what TRL's output drops

    def record_generation(self, logprobs: torch.Tensor, counts: GenerationStats | None = None) -> None:
        """trl-dapo's engine generated, or rows generated before were handed to TRL: the round's one generation,
        before scoring (the logprobs describe exactly these rows, so a second generation would leave rows without
        them)."""
        if self.generations or self.scores is not None:
            raise RuntimeError(
                "TRL generated twice within one round, or after scoring it: the rollout engine's (or the stream's) "
                "rows must be the round's one generation, before its scoring."
            )
        self.generations, self.engine_logprobs = 1, logprobs
        self.generation = counts or GenerationStats()

    def record_trl_generation(self) -> None:
        """TRL's path generated: once, then once more per tool-calling turn, every turn before the scoring."""
        if self.scores is not None or self.engine_logprobs is not None:
            raise RuntimeError(
                "TRL generated after scoring the round, or after the rollout engine's (or the stream's) rows: "
                "DAPOTrainer relies on every generation of a round coming before its one scoring."
            )
        self.generations += 1

    def record_scores(self, scores: RoundScores) -> None:
        if self.scores is not None:
            raise RuntimeError("TRL scored a round twice: DAPOTrainer relies on one scoring a round.")
        self.scores = scores


@dataclass
class Round:
    """A round's checked global batch (every rank's rows), its per-row filter metric and this rank's engine counts."""

    batch: RolloutBatch
    metric: torch.Tensor
    generation: GenerationStats


class TRLRounds:
    """Runs rounds through TRL's method (`view.generate_and_score`) and turns each into DAPO's global rollout batch.

    `recompute_logprobs(batch)`: the training model's logprobs of a round's completion tokens under the current
    weights (a no-grad pass), for rounds whose generation path returned none. `filter_metric(rewards)`: what dynamic
    sampling filters a row on."""

    def __init__(
        self,
        view: TRLView,
        recompute_logprobs: Callable[[RolloutBatch], torch.Tensor],
        filter_metric: Callable[[torch.Tensor], torch.Tensor],
        trained_batch_metric_names: list[str],
    ) -> None:
        self.view = view
        self.recompute_logprobs, self.filter_metric = recompute_logprobs, filter_metric
        self.trained_batch_metric_names = trained_batch_metric_names
        self.current: RoundContext | None = None

    @contextlib.contextmanager
    def open(self, streamed: StreamedRows | None = None) -> Iterator[RoundContext]:
        """The context of one call of TRL's method, read and written by the hooks through `current`."""
        if self.current is not None:
            raise RuntimeError("a round was opened inside another round.")
        self.current = RoundContext(streamed=streamed)
        try:
            yield self.current
        finally:
            self.current = None

    def run(
        self, local_inputs: list[dict[str, Any]], trained_as_generated: bool, streamed: StreamedRows | None = None
    ) -> Round:
        """Generate and score this rank's rows of one round with TRL. Unless the round is trained as generated (no
        dynamic sampling), TRL's completion and reward metrics of the round are removed: they would describe
        candidates, and the accepted groups' are logged once the generation batch is full."""
        metrics = self.view.metrics["train"]
        marks = (
            None if trained_as_generated else {name: len(metrics[name]) for name in self.trained_batch_metric_names}
        )
        with self.open(streamed) as context:
            output = self.view.generate_and_score(local_inputs)  # TRL's method (DAPOTrainer does not override it)
        if context.scores is None:
            raise RuntimeError("TRL's method returned without scoring the round's completions.")
        if marks is not None:
            for name in self.trained_batch_metric_names:
                if name in metrics:
                    del metrics[name][marks.get(name, 0) :]
                    if not metrics[name]:
                        del metrics[name]
        batch = self._global_batch(output, context)
        return Round(batch, self.filter_metric(context.scores.rewards), context.generation)

    def _global_batch(self, output: dict[str, Any], context: RoundContext) -> RolloutBatch:
        """The round's rows of every rank with their rollout logprobs (and the old policy's, where recomputed), checked,
        with the rewards, completion lengths and truncation flags TRL's output drops."""
        view, scores = self.view, context.scores
        unknown = set(output) - set(PADDED_KEYS) - set(ROW_KEYS) - set(DROPPED_KEYS)
        if unknown:
            raise NotImplementedError(
                f"DAPOTrainer handles text rollouts; TRL returned {sorted(unknown)} (multimodal inputs are not "
                "supported yet)."
            )
        local = {key: output[key] for key in (*PADDED_KEYS, "advantages") if key in output and key not in LOGPROB_KEYS}
        sampled, recomputed = self._rollout_logprobs(output, context.engine_logprobs)
        rollout_key = "old_per_token_logps"
        if view.args.old_logprobs == "recompute":
            rollout_key = "sampling_per_token_logps"
            local["old_per_token_logps"] = torch.zeros_like(sampled) if recomputed is None else recomputed
            step = -1 if recomputed is None else view.step()
            local[OLD_LOGPROBS_STEP] = torch.full((sampled.size(0),), step, device=sampled.device)
        local[rollout_key] = sampled
        local[SAMPLING_STEP] = _token_steps(context.streamed, sampled, view.step())
        batch = gather_rollout(local, view.accelerator, view.pad_token_id)
        check_groups(batch["prompt_ids"], batch["prompt_mask"], view.num_generations)
        counted = loss_mask(batch).bool()
        check_completions(batch["completion_ids"], batch["completion_mask"], batch[rollout_key], counted, rollout_key)
        if scores.rewards.size(0) != num_rows(batch):
            raise RolloutIntegrityError(
                f"rewards: {scores.rewards.size(0)} rows for {num_rows(batch)} completions; each completion needs one "
                "reward."
            )
        # tokens outside the loss may hold anything (vLLM gives NaN for what it did not score): zero them once here
        for key in LOGPROB_KEYS:
            if key in batch:
                batch[key] = torch.where(counted, batch[key], 0.0)
        batch["rewards"], batch["truncated"] = scores.rewards, scores.truncated
        batch["completion_lengths"] = _model_token_counts(batch, scores.completion_lengths)
        return batch

    def _rollout_logprobs(
        self, output: dict[str, Any], engine_logprobs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(sampled, recomputed)` for a round's completions. `sampled`: the logprobs of the sampled tokens under the
        policy that sampled them, the old policy of every later ratio unless `old_logprobs="recompute"`; from the
        generation engine when it returns them (vLLM, a `rollout_func`, trl-dapo's engine), otherwise one no-grad
        forward pass now, before any optimizer step changes the weights. `recomputed`: the training model's own
        logprobs of them under the current weights when a pass has computed them (TRL's, which it runs when steps are
        misaligned with generation, or that no-grad pass), else None."""
        recomputed = output.get("old_per_token_logps")
        if engine_logprobs is not None:
            width = output["completion_ids"].size(1)
            return F.pad(engine_logprobs[:, :width], (0, max(0, width - engine_logprobs.size(1)))), recomputed
        if "sampling_per_token_logps" in output:
            return output["sampling_per_token_logps"], recomputed
        if recomputed is None:
            # TRL's generation path: the training model itself sampled, so its forward pass gives the policy's logprobs
            recomputed = self.recompute_logprobs(output)
        return recomputed, recomputed


def _token_steps(streamed: StreamedRows | None, sampled: torch.Tensor, step: int) -> torch.Tensor:
    """Per completion token, the optimizer step whose weights sampled it: the rows handed in say so (a partial
    rollout's earlier tokens an earlier step), any other round's were all sampled now."""
    if streamed is None:
        return torch.full(sampled.shape, step, dtype=torch.long, device=sampled.device)
    steps = streamed.token_steps[:, : sampled.size(1)].to(sampled.device)
    return F.pad(steps, (0, sampled.size(1) - steps.size(1)), value=step)


def round_scores(rewards: torch.Tensor, completion_ids: list[list[int]], ends: set[int], accelerator) -> RoundScores:
    """The gathered rewards with each completion's length and whether it was cut at the length limit (its last token
    neither EOS nor padding), gathered over the ranks as TRL gathers the rewards."""
    local = torch.tensor(
        [[len(ids), bool(ids) and ids[-1] not in ends] for ids in completion_ids], device=rewards.device
    )
    lengths, truncated = accelerator.gather(local).unbind(dim=1)
    return RoundScores(rewards, lengths, truncated.bool())


def _model_token_counts(batch: RolloutBatch, lengths: torch.Tensor) -> torch.Tensor:
    """Completion lengths as TRL logs them: with tool calls, only the tokens the model wrote."""
    if "tool_mask" not in batch:
        return lengths
    positions = torch.arange(batch["tool_mask"].size(1), device=lengths.device)
    return ((positions < lengths.unsqueeze(1)) & batch["tool_mask"].bool()).sum(dim=1)
