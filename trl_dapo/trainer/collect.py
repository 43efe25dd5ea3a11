"""Collecting one generation batch: every rank's rows, from one round or from dynamic sampling's kept groups.

Each collection strategy is a `Collector`: `check` says what it needs of the set-up before any model loads (called
once, by `set_up.check_set_up`), and `collect(inputs, step) -> (global batch, SamplingStats | None)` gathers each
generation batch. `set_up.collection_strategy` picks the one the config asks for:

- `OneRound` (`dynamic_sampling=False`): the dataloader's batch through TRL's method, trained as generated;
- `CandidateRounds` (`dynamic_sampling_mode="rounds"`): the buffer's candidate rounds, each through TRL's method;
- `StreamedGroups` (`"stream"`, `streamed.py`): one call of the paged engine per generation batch that scores each
  group as its last row ends (`sampling/stream.py`), then the kept groups through TRL's method as rows already
  generated and scored.

Every round goes through `TRLRounds` (`round.py`); which groups count as informative is one `GroupFilter`, the
buffer's, which `StreamedGroups` hands to the stream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ..rollout_batch import RolloutBatch
from ..sampling import DynamicSamplingBuffer, SamplingStats
from .round import TRLRounds

logger = logging.getLogger(__name__)


class Collector:
    """A collection strategy (see the module docstring)."""

    @staticmethod
    def check(args, reward_funcs: list, reward_names: Sequence[str], rollout_func, calls_tools: bool) -> None:
        """What this strategy needs of the set-up beyond the checks every set-up passes (`set_up.py`), known before
        any model loads: `DAPOTrainer`'s arguments of those names, `reward_funcs` as a list, their names as TRL gives
        them. Nothing, unless the strategy says otherwise."""

    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, SamplingStats | None]:
        raise NotImplementedError


class OneRound(Collector):
    """No dynamic sampling: the dataloader's batch, trained as generated."""

    def __init__(self, rounds: TRLRounds) -> None:
        self.rounds = rounds

    def collect(self, inputs: list[dict[str, Any]], step: int) -> tuple[RolloutBatch, None]:
        return self.rounds.run(inputs, trained_as_generated=True).batch, None


class CandidateRounds(Collector):
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
