"""Each epoch's prompt order restored on resume.

TRL's `RepeatSampler` draws each epoch's permutation from one generator seeded once, so epoch k's order follows from
the k permutations drawn before it. A resumed run builds the sampler afresh and skips straight to its epoch: it drew
the first epoch's order again (and, inside a later epoch, skipped the first epoch's prompts), so a run resumed after
its first epoch trained other prompts than the uninterrupted one. The Trainer calls `set_epoch` before each epoch;
here that reseeds the generator and draws the earlier epochs' permutations, leaving it where the uninterrupted run's
was: the same orders as TRL's, whether resumed or not. Resumed inside an epoch on several processes, the dataloader
that skips the trained batches does not hand `set_epoch` on (accelerate's `SkipBatchSampler` around its
`BatchSamplerShard`): the trainer sets the epoch itself then (`set_resumed_epoch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler
from trl.trainer.utils import RepeatSampler


class EpochOrder(Sampler[int]):
    """TRL's training sampler, its generator set for the epoch the Trainer announces."""

    def __init__(self, sampler: RepeatSampler) -> None:
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        if not self.sampler.shuffle or self.sampler.seed is None:  # no order to restore, or none reproducible
            return
        generator = self.sampler.generator
        generator.manual_seed(self.sampler.seed)
        for _ in range(epoch):
            torch.randperm(self.sampler.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def set_resumed_epoch(dataloader: Any, epoch: int) -> None:
    """Set `epoch` on the `EpochOrder` under `dataloader`'s batch samplers (accelerate wraps it in one to three)."""
    layer = dataloader
    while layer is not None:
        if isinstance(getattr(layer, "sampler", None), EpochOrder):
            layer.sampler.set_epoch(epoch)
            return
        layer = getattr(layer, "batch_sampler", None)
