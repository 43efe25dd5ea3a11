"""Collecting one generation batch: every rank's rows, from one round or from dynamic sampling's kept groups.

Each collection strategy is a `Collector`: `check` says what it needs of the set-up before any model loads (called
once, by `set_up.check_set_up`), and `collect(inputs, step) -> Collected` gathers each generation batch with what
dynamic sampling and the engine did. `set_up.collection_strategy` picks the one the config asks for:

- `OneRound` (`dynamic_sampling=False`): the dataloader's batch through TRL's method, trained as generated;
- `CandidateRounds` (`dynamic_sampling_mode="rounds"`): the buffer's candidate rounds, each through TRL's method;
- `StreamedGroups` (`"stream"`, `streamed.py`): one call of the paged engine per generation batch that scores each
  group as its last row ends (`sampling/stream.py`), then the kept groups through TRL's method as rows already
  generated and scored;
- with `partial_rollouts=True`, `PartialRounds` and `PartialCandidateRounds` (`partial.py`): the same rounds, each
  stopped once its groups have ended, the rest carried (stream mode carries in `StreamedGroups`).

Every round goes through `TRLRounds` (`round.py`); which groups count as informative is one `GroupFilter`, the
buffer's, which `StreamedGroups` hands to the stream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ...rollout_batch import RolloutBatch
from ...sampling import DynamicSamplingBuffer, GenerationStats, SamplingStats
from ...sampling.carried import CarriedGroups
from .round import Round, TRLRounds

logger = logging.getLogger(__name__)


class Collected(NamedTuple):
    """One generation batch: every rank's rows, what dynamic sampling did (None without it: TRL's own metrics then
    describe the batch), and what the engine did and partial rollouts carried, summed over the ranks."""

    batch: RolloutBatch
    sampling: SamplingStats | None
    generation: GenerationStats


class Collector:
    """A collection strategy (see the module docstring). `carried`: this rank's carried groups where the strategy
    has partial rollouts (checkpoints save them), else None."""

    carried: CarriedGroups | None = None

    @staticmethod
    def check(args, reward_funcs: list, reward_names: Sequence[str], rollout_func, calls_tools: bool) -> None:
        """What this strategy needs of the set-up beyond the checks every set-up passes (`set_up.py`), known before
        any model loads: `DAPOTrainer`'s arguments of those names, `reward_funcs` as a list, their names as TRL gives
        them. Nothing, unless the strategy says otherwise."""

    def collect(self, inputs: list[dict[str, Any]], step: int) -> Collected:
        raise NotImplementedError

    def batch_generation(self, engine_counts: list[GenerationStats], accelerator) -> GenerationStats:
        """What the engine did for one generation batch (this rank's `engine_counts`, one per call) and what this
        rank carries on after it, summed over the ranks (every rank calls it)."""
        generation = GenerationStats()
        for counts in [*engine_counts, *([self.carried.generation_counts()] if self.carried is not None else [])]:
            generation += counts
        return generation.summed(accelerator)


class OneRound(Collector):
    """No dynamic sampling: the dataloader's batch, trained as generated."""

    def __init__(self, rounds: TRLRounds, accelerator) -> None:
        self.rounds, self.accelerator = rounds, accelerator

    def collect(self, inputs: list[dict[str, Any]], step: int) -> Collected:
        generated = self.rounds.run(inputs, trained_as_generated=True)
        return Collected(generated.batch, None, self.batch_generation([generated.generation], self.accelerator))


class CandidateRounds(Collector):
    """Candidate rounds until the batch holds `target` informative groups (`DynamicSamplingBuffer.fill`): the first
    round is the dataloader's batch, extra rounds draw prompts from the prompt stream, each rank generates its share."""

    def __init__(
        self, rounds: TRLRounds, buffer: DynamicSamplingBuffer, prompt_stream, accelerator, target: int, progress: bool
    ) -> None:
        self.rounds, self.buffer, self.prompt_stream, self.accelerator = rounds, buffer, prompt_stream, accelerator
        self.target, self.progress = target, progress

    def collect(self, inputs: list[dict[str, Any]], step: int) -> Collected:
        engine_counts: list[GenerationStats] = []  # each round's, on this rank

        def generate_round(groups: int, round_index: int):
            candidates = self._round(inputs, groups, round_index, step)
            engine_counts.append(candidates.generation)
            return candidates.batch, candidates.metric

        world = self.accelerator.num_processes
        with RoundProgress(enabled=self.progress) as progress:
            batch, stats = self.buffer.fill(
                self.target,
                generate_round,
                step=step,
                group_multiple=world // math.gcd(self.buffer.num_generations, world),
                dataset_prompts=lambda: self.prompt_stream.num_prompts,
                report=progress,
            )
        generation = self.batch_generation(engine_counts, self.accelerator)
        self._account(stats, generation)
        return Collected(batch, stats, generation)

    def _round(self, inputs: list[dict[str, Any]], groups: int, round_index: int, step: int) -> Round:
        """One candidate round of `groups` groups: the dataloader's batch first, then prompts from the stream, each
        rank generating its share; this rank's engine counts."""
        G, rank, world = self.buffer.num_generations, self.accelerator.process_index, self.accelerator.num_processes
        rows = gather_object(inputs) if round_index == 0 else []  # the first round is the dataloader's batch
        missing = groups - len(rows) // G
        rows += [row for row in self.prompt_stream.take(missing) for _ in range(G)] if missing > 0 else []
        share = len(rows) // world
        return self.rounds.run(rows[rank * share : (rank + 1) * share], trained_as_generated=False)

    def _account(self, stats: SamplingStats, generation: GenerationStats) -> None:
        """What the batch's generation counts (summed over ranks) correct in its sampling counts: nothing here."""


def sum_over_ranks(accelerator, values: list[float]) -> list[float]:
    """`values` summed over the ranks (one all-reduce; the ranks' agreement of a stream or a partial round)."""
    if accelerator.num_processes == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    return accelerator.reduce(tensor, reduction="sum").tolist()


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
