"""Collecting one generation batch: every rank's rows, from one round or from dynamic sampling's kept groups.

`make_collector` picks the strategy the config asks for, each a small class with one method, `collect(inputs, step)
-> (global batch, SamplingStats | None)`:

- `OneRound` (`dynamic_sampling=False`): the dataloader's batch through TRL's method, trained as generated;
- `CandidateRounds` (`dynamic_sampling_mode="rounds"`): the buffer's candidate rounds, each through TRL's method;
- `StreamedGroups` (`"stream"`): one call of the paged engine per generation batch that scores each group as its
  last row ends (`sampling/stream.py`), then the kept groups through TRL's method as rows already generated and
  scored.

Every round goes through `TRLRounds` (`round.py`); which groups count as informative is one `GroupFilter`, the
buffer's, which `StreamedGroups` hands to the stream; the stream scores each group with a `GroupScorer`
(`scoring.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ..integrity import RolloutIntegrityError
from ..rollout import PagedRolloutEngine
from ..rollout_batch import OLD_LOGPROBS_STEP, RolloutBatch
from ..sampling import DynamicSamplingBuffer, DynamicSamplingLimitError, SamplingStats
from ..sampling.stream import GroupStream, StreamedGroup
from .engine_choice import token_sampling
from .round import StreamedRows, TRLRounds
from .scoring import FilterMetric, GroupScorer

logger = logging.getLogger(__name__)

# Admissions of one streamed generation batch with unlimited rounds and a stream of unknown size, in batches of groups.
UNKNOWN_SIZE_STREAM_BATCHES = 16


class Collector(Protocol):
    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, SamplingStats | None]: ...


class EngineWeights:
    """The paged engine's weights, refreshed from the training model once per optimizer step at most (the weights
    change once per step): rounds and the stream both generate with it."""

    def __init__(self, engine: PagedRolloutEngine, model: Callable[[], torch.nn.Module]) -> None:
        self.engine, self.model, self.step = engine, model, None

    def current(self, step: int) -> PagedRolloutEngine:
        if self.step != step:
            self.engine.sync_weights(self.model())
            self.step = step
        return self.engine


class OneRound:
    """No dynamic sampling: the dataloader's batch, trained as generated."""

    def __init__(self, rounds: TRLRounds) -> None:
        self.rounds = rounds

    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, None]:
        return self.rounds.run(inputs, trained_as_generated=True).batch, None


class CandidateRounds:
    """Candidate rounds until the batch holds `target` informative groups (`DynamicSamplingBuffer.fill`): the first
    round is the dataloader's batch, extra rounds draw prompts from the prompt stream, each rank generates its share."""

    def __init__(
        self, rounds: TRLRounds, buffer: DynamicSamplingBuffer, prompt_stream, accelerator, target: int, progress: bool
    ) -> None:
        self.rounds, self.buffer, self.prompt_stream, self.accelerator = rounds, buffer, prompt_stream, accelerator
        self.target, self.progress = target, progress

    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, SamplingStats]:
        rank, world, G = self.accelerator.process_index, self.accelerator.num_processes, self.buffer.num_generations
        counts = torch.zeros(3, dtype=torch.long)  # the engine's busy and all decode slot-steps, prefilled tokens

        def generate_round(groups: int, round_index: int) -> tuple[RolloutBatch, torch.Tensor]:
            rows = gather_object(inputs) if round_index == 0 else []  # the first round is the dataloader's batch
            missing = groups - len(rows) // G
            rows += [row for row in self.prompt_stream.take(missing) for _ in range(G)] if missing > 0 else []
            share = len(rows) // world
            candidates = self.rounds.run(rows[rank * share : (rank + 1) * share], trained_as_generated=False)
            counts.add_(torch.tensor(candidates.engine_counts))
            return candidates.batch, candidates.metric

        with RoundProgress(enabled=self.progress) as progress:
            batch, stats = self.buffer.fill(
                self.target,
                generate_round,
                step=step,
                group_multiple=world // math.gcd(G, world),
                dataset_prompts=lambda: self.prompt_stream.num_prompts,
                report=progress,
            )
        busy, pool, prefill = self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").tolist()
        stats.busy_slot_steps, stats.pool_slot_steps, stats.prefill_tokens = int(busy), int(pool), int(prefill)
        return batch, stats


class StreamedGroups:
    """Stream mode: each rank streams its prompts (its share of the dataloader batch's prompts, then every
    `world`-th prompt of the extra stream) through one call of the paged engine until the kept groups of all ranks
    cover the batch (`DynamicSamplingBuffer.fill_stream`); the kept groups are gathered, in rank then finish order,
    and go through TRL's method as rows already generated and scored."""

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
        self.rounds, self.buffer, self.prompt_stream, self.accelerator = rounds, buffer, prompt_stream, accelerator
        self.engine, self.score, self.tokenize, self.args = engine, score, tokenize, args
        self.target = target

    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, SamplingStats]:
        world = self.accelerator.num_processes
        return self.buffer.fill_stream(
            self.target,
            lambda missing: self._stream(inputs, missing, step),
            step=step,
            group_multiple=world // math.gcd(self.buffer.num_generations, world),
        )

    def _stream(self, inputs: list[dict[str, Any]], missing: int, step: int) -> tuple[RolloutBatch, SamplingStats]:
        """Stream this rank's prompts until the ranks' kept groups cover `missing`; return the global batch of kept
        groups and the counts of every rank."""
        rank, world, args, buffer = (
            self.accelerator.process_index,
            self.accelerator.num_processes,
            self.args,
            self.buffer,
        )
        G = buffer.num_generations
        own = iter(gather_object(inputs)[::G][rank::world])  # the dataloader batch repeats each prompt G times
        blocks = 0  # extra-stream blocks of `world` prompts this rank drew (one prompt of each is its own)

        def next_prompt() -> tuple[dict[str, Any], list[int]]:
            nonlocal blocks
            row = next(own, None)
            if row is None:
                row, blocks = self.prompt_stream.take(world)[rank], blocks + 1
            return row, list(self.tokenize(copy.deepcopy([row["prompt"]]))[0][0])

        engine, settings = self.engine.current(step), token_sampling(args)
        stream = GroupStream(
            start=lambda prompts, resumed: engine.stream(prompts, settings, resumed),
            next_prompt=next_prompt,
            score=self.score,
            agree=self._sum_over_ranks,
            num_generations=G,
            world=world,
            rank=rank,
            keep_groups=buffer.keep_groups,
            sync_every=args.dynamic_sampling_stream_sync_every,
            in_flight=args.dynamic_sampling_in_flight,
            prior=(buffer.qualified_weight, buffer.generated_weight),
            fill_rows=engine.max_rows if args.dynamic_sampling_in_flight == "carry" else 0,
        )
        dataset_prompts = self.prompt_stream.num_prompts
        if args.max_num_gen_batches:
            budget = math.ceil(args.max_num_gen_batches * args.dynamic_sampling_max_oversample * self.target)
        else:
            budget = dataset_prompts if dataset_prompts is not None else UNKNOWN_SIZE_STREAM_BATCHES * self.target
        # in flight at once: the most one candidate round may hold (the same memory cap as in rounds)
        max_in_flight = max(math.ceil(args.dynamic_sampling_max_oversample * self.target), missing)
        # this rank's groups carried in flight from the last batch, unless older than max_surplus_age
        carried = [group for group in buffer.carried if step - group.birth <= args.max_surplus_age]
        aged_tokens = sum(group.earlier_tokens for group in buffer.carried) - sum(g.earlier_tokens for g in carried)
        outcome = stream.run(missing, max(budget, missing), max_in_flight, carried)
        buffer.carried = [
            group if group.birth >= 0 else dataclasses.replace(group, birth=step) for group in outcome.carried
        ]
        # every rank's extra stream ends at the same position: the furthest any rank drew
        furthest = int(self.accelerator.reduce(torch.tensor(blocks, device=self.accelerator.device), "max"))
        if furthest > blocks:
            self.prompt_stream.take(world * (furthest - blocks))
        # the carried groups' tokens of this batch are kept for the next (surplus); those that aged out are untrained
        outcome.stats.surplus_tokens = outcome.carried_tokens
        outcome.stats.untrained_tokens = aged_tokens
        everyone = gather_object([([_to_host(group) for group in outcome.kept], outcome.stats)])
        stats = SamplingStats()
        for _, rank_stats in everyone:
            stats += rank_stats
        dataset_prompts = self.prompt_stream.num_prompts  # a stream's size may have become known while it ran
        if not args.max_num_gen_batches and dataset_prompts is not None and not stats.qualified_groups:
            raise DynamicSamplingLimitError(buffer._full_pass_message(stats, dataset_prompts))
        kept = [group for rank_kept, _ in everyone for group in rank_kept]
        usable = len(kept) - len(kept) % (world // math.gcd(G, world))  # the rows must share equally over the ranks
        stats.discarded_qualified_groups = len(kept) - usable
        kept = kept[:usable]
        # tokens of this batch neither filtered nor kept nor carried: rows dropped in flight, groups cut for the ranks'
        # shares; and carried groups that aged out
        stats.untrained_tokens += (
            stats.generated_tokens - stats.filtered_tokens - sum(g.fresh_tokens for g in kept) - stats.surplus_tokens
        )
        if not kept:
            return self._empty_rollout(), stats
        rows = [(group, index) for group in kept for index in range(G)]
        share = len(rows) // world
        mine = rows[rank * share : (rank + 1) * share]
        streamed = StreamedRows(
            prompt_ids=[group.prompt_ids for group, _ in mine],
            completions=[group.completions[index] for group, index in mine],
            logprobs=torch.stack([group.logprobs[index] for group, index in mine]).to(self.accelerator.device),
            rewards=torch.stack([group.rewards[index] for group, index in mine]),
        )
        kept_round = self.rounds.run([group.rows[index] for group, index in mine], False, streamed)
        if not bool(buffer.keep_groups(kept_round.metric.cpu(), G).all()):
            raise RolloutIntegrityError(
                "stream mode: a kept group is not informative once gathered; a rank lost rows."
            )
        return kept_round.batch, stats

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.accelerator.num_processes == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.reduce(tensor, reduction="sum").tolist()

    def _empty_rollout(self) -> RolloutBatch:
        """A global batch of no rows with the keys a round's batch has (a stream that kept nothing)."""
        device = self.accelerator.device
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        batch = {key: empty for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        batch["old_per_token_logps"] = torch.zeros(0, 0, device=device)
        if self.args.old_logprobs == "recompute":
            batch["sampling_per_token_logps"] = torch.zeros(0, 0, device=device)
            batch[OLD_LOGPROBS_STEP] = torch.zeros(0, dtype=torch.long, device=device)
        batch["advantages"] = torch.zeros(0, device=device)
        batch["rewards"] = torch.zeros(0, len(self.score.functions), device=device)
        batch["truncated"] = torch.zeros(0, dtype=torch.bool, device=device)
        batch["completion_lengths"] = torch.zeros(0, dtype=torch.long, device=device)
        return batch


def _to_host(group: StreamedGroup) -> StreamedGroup:
    """A kept group with its tensors on the CPU, to be gathered to every rank."""
    return dataclasses.replace(group, logprobs=group.logprobs.cpu(), rewards=group.rewards.cpu())


class RoundProgress:
    """Makes every extra candidate round visible: a log line each, and a progress bar of the informative groups
    found (main process, unless `disable_tqdm`), closed when the generation batch is full."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None

    def __call__(self, round_index: int, groups: int, have: int, target: int) -> None:
        logger.info(
            "Dynamic sampling round %d: %d of %d informative groups found so far, generating %d candidate groups.",
            round_index + 1,
            have,
            target,
            groups,
        )
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=target, desc="dynamic sampling", unit="group", leave=False)
        self.bar.n = have
        self.bar.set_postfix(round=round_index + 1)

    def __enter__(self) -> RoundProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()


def make_collector(trainer, rounds: TRLRounds, filter_metric: FilterMetric) -> Collector:
    """The collector `dynamic_sampling` and `dynamic_sampling_mode` ask for, with its collaborators; which groups are
    kept is the buffer's `keep_groups`, in rounds and in the stream."""
    args = trainer.args
    if not args.dynamic_sampling:
        return OneRound(rounds)
    target = args.generation_batch_size // trainer.num_generations
    common = (rounds, trainer.sampling_buffer, trainer.prompt_stream, trainer.accelerator)
    if args.dynamic_sampling_mode == "rounds":
        progress = trainer.accelerator.is_main_process and not args.disable_tqdm
        return CandidateRounds(*common, target, progress)
    return StreamedGroups(
        *common, trainer.engine_weights, GroupScorer(trainer, filter_metric), trainer._tokenize_prompts, args, target,
    )  # fmt: skip
