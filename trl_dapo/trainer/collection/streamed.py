"""Stream mode's collector (`dynamic_sampling_mode="stream"`): what it needs of the set-up, and one generation batch
of streamed groups.

Its checks are its own: `check`, with what the settings and the reward functions decide before any model loads
(`set_up.check_set_up` calls it), and `check_built`, with what only the built trainer knows (whether the paged engine
serves the model, the reward functions an environment added, the tokenizer TRL loaded). Its state across generation
batches is `sampling/stream_state.py`'s; the stream itself, which knows nothing of the trainer, is
`sampling/stream.py`'s `GroupStream`, scoring each group with a `GroupScorer` (`scoring.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from torch import nn
from trl.trainer.utils import is_async_callable

from ...integrity import RolloutIntegrityError
from ...rollout_batch import OLD_LOGPROBS_STEP, SAMPLING_STEP, RolloutBatch
from ...sampling import (
    DynamicSamplingBuffer,
    DynamicSamplingLimitError,
    GenerationStats,
    SamplingStats,
    full_pass_message,
)
from ...sampling.partial_round import in_flight_cap
from ...sampling.stream import GroupStream, StreamedGroup, StreamOutcome
from ...sampling.stream_state import StreamState
from .collect import Collected, Collector, sum_over_ranks
from .engine_choice import (
    EngineWeights,
    check_paged_engine_settings,
    keep_cache_bytes,
    paged_engine_needed,
    token_sampling,
)
from .round import StreamedRows, TRLRounds
from .scoring import GroupScorer

# Admissions of one streamed generation batch with unlimited rounds and a stream of unknown size, in batches of groups.
UNKNOWN_SIZE_STREAM_BATCHES = 16
STREAM_MODE = "dynamic_sampling_mode='stream'"


class StreamedGroups(Collector):
    """Each rank streams its prompts (its share of the dataloader batch's prompts, then every `world`-th prompt of the
    extra stream) through one call of the paged engine until the kept groups of all ranks cover the batch
    (`StreamState.fill`); the kept groups are gathered, in rank then finish order, and go through TRL's method as
    rows already generated and scored."""

    @staticmethod
    def check(args, reward_funcs: list, reward_names: Sequence[str], rollout_func, calls_tools: bool) -> None:
        """The paged engine must generate (not TRL's path, vLLM or a `rollout_func`) and every reward function must
        be a plain callable, as far as the settings and the reward functions tell before any model loads."""
        check_paged_engine_settings(args, rollout_func, calls_tools, STREAM_MODE, "dynamic_sampling_mode='rounds'")
        _check_reward_functions(reward_funcs, reward_names)

    @staticmethod
    def check_built(
        args, engine: EngineWeights | None, reward_funcs: list, reward_names: Sequence[str], tokenizer: Any
    ) -> None:
        """What only the built trainer knows: the paged engine serves its model, the reward functions an environment
        added are plain callables too, and the tokenizer does not parse completions (TRL would hand the reward
        functions parsed completions, the stream scores decoded text)."""
        if engine is None:
            reason = "on this set-up TRL's path generates, see the log for why"
            raise paged_engine_needed(args, STREAM_MODE, reason, "dynamic_sampling_mode='rounds'")
        _check_reward_functions(reward_funcs, reward_names)
        parsed = [name for name in ("response_template", "response_schema") if getattr(tokenizer, name, None)]
        if parsed:
            raise ValueError(
                f"processing_class: the tokenizer has a {parsed[0]}, so TRL parses each completion with it "
                "(parse_response: tool calls, reasoning) before the reward functions see it; "
                "dynamic_sampling_mode='stream' scores groups on their rank as plain decoded text and would hand the "
                "reward functions other completions. Use dynamic_sampling_mode='rounds', or a tokenizer without "
                f"{parsed[0]}."
            )

    def __init__(
        self,
        rounds: TRLRounds,
        buffer: DynamicSamplingBuffer,
        prompt_stream,
        accelerator,
        engine: EngineWeights,
        score: GroupScorer,
        tokenize: Callable[[list], tuple],
        args,
        target: int,
    ) -> None:
        self.rounds, self.prompt_stream, self.accelerator = rounds, prompt_stream, accelerator
        self.engine, self.score, self.tokenize, self.args = engine, score, tokenize, args
        self.target = target
        self.state = StreamState(buffer, args.partial_rollout_max_age)
        self.carried = self.state.carried if args.partial_rollouts else None
        self.num_generations = buffer.num_generations
        world = accelerator.num_processes
        self.group_multiple = world // math.gcd(self.num_generations, world)  # groups whose rows share over ranks

    def collect(self, inputs: list[dict[str, Any]], step: int) -> Collected:
        engine_counts: list[
            GenerationStats
        ] = []  # the stream's, on this rank (none when the surplus covers the batch)

        def stream(missing: int) -> tuple[RolloutBatch, SamplingStats]:
            batch, stats, counts = self._stream(inputs, missing, step)
            engine_counts.append(counts)
            return batch, stats

        batch, stats = self.state.fill(self.target, stream, step, self.group_multiple)
        return Collected(batch, stats, self.batch_generation(engine_counts, self.accelerator))

    def _stream(
        self, inputs: list[dict[str, Any]], missing: int, step: int
    ) -> tuple[RolloutBatch, SamplingStats, GenerationStats]:
        """Stream this rank's prompts until the ranks' kept groups cover `missing`; return the global batch of kept
        groups, the counts of every rank and this rank's engine counts."""
        prompts = RankPrompts(inputs, self.prompt_stream, self.tokenize, self.accelerator, self.num_generations)
        outcome = self._run(prompts, missing, step)
        prompts.align()
        kept, stats = self._gathered(outcome)
        kept = self._shared_equally(kept, stats)
        if not kept:
            return self._empty_rollout(), stats, outcome.generation
        return self._kept_round(kept), stats, outcome.generation

    def _run(self, prompts: RankPrompts, missing: int, step: int) -> StreamOutcome:
        """One stream on this rank: the groups carried from the last batch first, then its prompts, within the
        admission budget and the cap on groups in flight; what it leaves in flight is carried to the next."""
        args, buffer, engine = self.args, self.state.buffer, self.engine.current(step)
        settings = token_sampling(args)
        keep_bytes = keep_cache_bytes(args, engine)  # the stream's pool leaves it free for what its end keeps
        stream = GroupStream(
            start=lambda prompt_ids, resumed: engine.stream(prompt_ids, settings, resumed, keep_bytes),
            next_prompt=prompts,
            score=self.score,
            agree=functools.partial(sum_over_ranks, self.accelerator),
            num_generations=self.num_generations,
            world=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
            keep_groups=buffer.keep_groups,
            sync_every=args.dynamic_sampling_stream_sync_every,
            in_flight=args.dynamic_sampling_in_flight,
            prior=(buffer.qualified_weight, buffer.generated_weight),
            fill_rows=engine.max_rows if args.partial_rollouts else 0,
            step=step,
            keep_cache_bytes=keep_bytes,
        )
        budget, max_in_flight = self._admission_limits(missing)
        carried, aged = self.state.carried.resume(step)
        outcome = stream.run(missing, budget, max_in_flight, carried)
        self.state.carried.carry(outcome.carried)
        # the carried groups' tokens of this batch are kept for the next (surplus); those that aged out are untrained
        aged_tokens = sum(sum(map(len, group.tokens)) for group in aged)
        outcome.stats.surplus_tokens = outcome.carried_tokens
        outcome.stats.untrained_tokens = aged_tokens
        outcome.generation.aged_out_groups, outcome.generation.aged_out_tokens = len(aged), aged_tokens
        return outcome

    def _admission_limits(self, missing: int) -> tuple[int, int]:
        """`(budget, max_in_flight)` in groups over all ranks: the admission budget (`max_num_gen_batches` x
        `dynamic_sampling_max_oversample` generation batches; unlimited: a pass over the training set) and the most
        groups in flight at once, carried ones included (the most one candidate round may hold, the same memory cap
        as in rounds; with partial rollouts, `partial_rollout_max_in_flight` generation batches)."""
        args, dataset_prompts = self.args, self.prompt_stream.num_prompts
        if args.max_num_gen_batches:
            budget = math.ceil(args.max_num_gen_batches * args.dynamic_sampling_max_oversample * self.target)
        else:
            budget = dataset_prompts if dataset_prompts is not None else UNKNOWN_SIZE_STREAM_BATCHES * self.target
        batches = args.partial_rollout_max_in_flight if args.partial_rollouts else args.dynamic_sampling_max_oversample
        return max(budget, missing), in_flight_cap(batches, self.target, missing)

    def _gathered(self, outcome: StreamOutcome) -> tuple[list[StreamedGroup], SamplingStats]:
        """Every rank's kept groups, in rank then finish order, and the counts summed over the ranks; with unlimited
        rounds, a pass over the training set without one informative group is an error, as in rounds."""
        everyone = gather_object([([_to_host(group) for group in outcome.kept], outcome.stats)])
        stats = SamplingStats()
        for _, rank_stats in everyone:
            stats += rank_stats
        dataset_prompts = self.prompt_stream.num_prompts  # a stream's size may have become known while it ran
        if not self.args.max_num_gen_batches and dataset_prompts is not None and not stats.qualified_groups:
            raise DynamicSamplingLimitError(full_pass_message(stats, dataset_prompts))
        return [group for rank_kept, _ in everyone for group in rank_kept], stats

    def _shared_equally(self, kept: list[StreamedGroup], stats: SamplingStats) -> list[StreamedGroup]:
        """The kept groups cut to a count whose rows share equally over the ranks (the rest counted as discarded),
        and the tokens of this batch neither filtered nor kept nor carried counted as untrained: rows dropped in
        flight, groups cut for the ranks' shares (carried groups that aged out are counted already)."""
        usable = len(kept) - len(kept) % self.group_multiple
        stats.discarded_qualified_groups = len(kept) - usable
        kept = kept[:usable]
        stats.untrained_tokens += (
            stats.generated_tokens - stats.filtered_tokens - sum(g.fresh_tokens for g in kept) - stats.surplus_tokens
        )
        return kept

    def _kept_round(self, kept: list[StreamedGroup]) -> RolloutBatch:
        """The kept groups through TRL's method: this rank's contiguous share of their rows, already generated and
        scored (`StreamedRows`); the global batch must keep every group informative."""
        rows = [(group, index) for group in kept for index in range(self.num_generations)]
        width, device = token_sampling(self.args).max_new_tokens, self.accelerator.device
        share = len(rows) // self.accelerator.num_processes
        mine = rows[self.accelerator.process_index * share : (self.accelerator.process_index + 1) * share]
        streamed = StreamedRows(
            prompt_ids=[group.prompt_ids for group, _ in mine],
            completions=[group.completions[index] for group, index in mine],
            logprobs=torch.stack([padded(group.logprobs[index], width) for group, index in mine]).to(device),
            rewards=torch.stack([group.rewards[index] for group, index in mine]),
            token_steps=torch.stack([group.token_steps(width)[index] for group, index in mine]),
        )
        kept_round = self.rounds.run([group.rows[index] for group, index in mine], False, streamed)
        if not bool(self.state.buffer.keep_groups(kept_round.metric.cpu(), self.num_generations).all()):
            raise RolloutIntegrityError(
                "stream mode: a kept group is not informative once gathered; a rank lost rows."
            )
        return kept_round.batch

    def _empty_rollout(self) -> RolloutBatch:
        """A global batch of no rows with the keys a round's batch has (a stream that kept nothing)."""
        device = self.accelerator.device
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        batch = {key: empty for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        batch["old_per_token_logps"] = torch.zeros(0, 0, device=device)
        batch[SAMPLING_STEP] = empty
        if self.args.old_logprobs == "recompute":
            batch["sampling_per_token_logps"] = torch.zeros(0, 0, device=device)
            batch[OLD_LOGPROBS_STEP] = torch.zeros(0, dtype=torch.long, device=device)
        batch["advantages"] = torch.zeros(0, device=device)
        batch["rewards"] = torch.zeros(0, len(self.score.functions), device=device)
        batch["truncated"] = torch.zeros(0, dtype=torch.bool, device=device)
        batch["completion_lengths"] = torch.zeros(0, dtype=torch.long, device=device)
        return batch


class RankPrompts:
    """This rank's prompts for one stream, drawn one at a time (`GroupStream`'s `next_prompt`): its share of the
    dataloader batch's prompts (the `rank`-th of every `world`), then its place in each block of `world` prompts of
    the extra stream."""

    def __init__(self, inputs: list[dict[str, Any]], prompt_stream, tokenize, accelerator, num_generations: int):
        self.prompt_stream, self.tokenize, self.accelerator = prompt_stream, tokenize, accelerator
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        # the dataloader batch repeats each prompt num_generations times
        self.own: Iterator[dict[str, Any]] = iter(gather_object(inputs)[::num_generations][self.rank :: self.world])
        self.blocks = 0  # extra-stream blocks of `world` prompts this rank drew (one prompt of each is its own)

    def __call__(self) -> tuple[dict[str, Any], list[int]]:
        row = next(self.own, None)
        if row is None:
            row, self.blocks = self.prompt_stream.take(self.world)[self.rank], self.blocks + 1
        return row, prompt_token_ids(self.tokenize, row)

    def align(self) -> None:
        """Every rank's extra stream ends at the same position: the furthest any rank drew."""
        device = self.accelerator.device
        furthest = int(self.accelerator.reduce(torch.tensor(self.blocks, device=device), "max"))
        if furthest > self.blocks:
            self.prompt_stream.take(self.world * (furthest - self.blocks))


def padded(logprobs: torch.Tensor, width: int) -> torch.Tensor:
    """A sample's logprobs (as carried: cut to its group's longest sample, or as wide as the engine's) at `width`."""
    return F.pad(logprobs[:width], (0, max(0, width - logprobs.size(0))))


def prompt_token_ids(tokenize: Callable[[list], tuple], row: dict[str, Any]) -> list[int]:
    """A dataset row's prompt as TRL tokenizes it (`_tokenize_prompts`), on a copy: TRL may edit the messages."""
    return list(tokenize(copy.deepcopy([row["prompt"]]))[0][0])


def _check_reward_functions(reward_funcs: list, names: Sequence[str]) -> None:
    """Stream mode scores each group on its own rank as it ends: plain callables only (a hub id is a reward model)."""
    for function, name in zip(reward_funcs, names, strict=False):
        if isinstance(function, str | nn.Module) or is_async_callable(function):
            raise ValueError(
                f"reward_funcs: {name!r} is a reward model or an async function; dynamic_sampling_mode='stream' "
                "scores each group on its own rank as it ends and supports plain callables only: use "
                "dynamic_sampling_mode='rounds', or wrap it in a plain function."
            )


def _to_host(group: StreamedGroup) -> StreamedGroup:
    """A kept group with its tensors on the CPU, to be gathered to every rank."""
    return dataclasses.replace(group, logprobs=group.logprobs.cpu(), rewards=group.rewards.cpu())
