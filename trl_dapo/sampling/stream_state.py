"""Streaming dynamic sampling's state across generation batches, and how one generation batch is filled.

The surplus groups and the running efficiency are the buffer's (`buffer.py`), shared with rounds: a batch takes the
surplus first, then one stream for the groups still missing, whose counts join the efficiency. What only the stream
has is each rank's own: the groups it left in flight (partial rollouts, `carried.py`), resumed by the next stream
unless older than `partial_rollout_max_age`, and saved with checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..rollout_batch import RolloutBatch, num_rows
from .buffer import DynamicSamplingBuffer
from .carried import CarriedGroups
from .stats import SamplingStats

# One stream: given the groups still missing, return its kept groups (global, in acceptance order; possibly none)
# and the counts of every rank.
StreamBatch = Callable[[int], tuple[RolloutBatch, SamplingStats]]


class StreamState:
    """Stream mode's side of the dynamic sampling state: the buffer it shares with rounds, and this rank's groups
    left in flight by the last stream (`carried`)."""

    def __init__(self, buffer: DynamicSamplingBuffer, max_age: int | None = None) -> None:
        self.buffer = buffer
        self.carried = CarriedGroups(max_age)

    def fill(
        self, target_groups: int, stream: StreamBatch, step: int, group_multiple: int = 1
    ) -> tuple[RolloutBatch, SamplingStats]:
        """`DynamicSamplingBuffer.fill` for a stream: up to `target_groups` informative groups, surplus first, then
        one stream asked for the groups still missing; the rest of what it kept becomes surplus."""
        buffer, stats = self.buffer, SamplingStats()
        found = buffer.take_surplus(stats, step)
        kept = None
        if found.groups < target_groups:
            kept, counts = stream(target_groups - found.groups)
            stats += counts
            stats.gen_batches = 1
            buffer.record_efficiency(counts.qualified_groups, counts.generated_groups)
            if num_rows(kept):
                groups = num_rows(kept) // buffer.num_generations
                found.add(kept, torch.full((groups,), step, dtype=torch.long))
        spent = (
            f"Streaming dynamic sampling admitted its budget of groups (max_num_gen_batches="
            f"{buffer.max_num_gen_batches} x dynamic_sampling_max_oversample={buffer.max_oversample} generation "
            "batches)"
        )
        return buffer.accept(stats, found, target_groups, group_multiple, step, kept, spent)
