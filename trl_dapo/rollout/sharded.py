"""Full parameters of one module at a time from sharded training weights, for the rollout engine's snapshot.

Under DeepSpeed ZeRO-3 and FSDP2 each rank holds a slice of every parameter. The snapshot reads one module at a time
(the embedding, the final norm, the output head, each decoder layer) inside `gather(module)`, so besides the bf16
snapshot only one module's full parameters are in memory at once. Gathering is a collective: every rank syncs at the
same point, which DAPOTrainer guarantees (the same generation rounds run on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch
from torch.distributed.fsdp import FSDPModule

from .weights import gather_nothing

Gather = Callable[[torch.nn.Module], AbstractContextManager]


def parameter_gather(zero3: bool, fsdp: bool, model: torch.nn.Module) -> Gather:
    """How the training parameters are made readable: ZeRO-3 gathers them, FSDP2 unshards them, else nothing.
    `model`: the training model without its DDP or DeepSpeed wrapper."""
    if zero3:
        return gather_zero3
    if fsdp:
        return FullyShardGather(model)
    return gather_nothing


def gather_zero3(module: torch.nn.Module) -> AbstractContextManager:
    """All ranks gather the module's ZeRO-3 partitions (read-only: no rank writes them back)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


class FullyShardGather:
    """Unshards the FSDP2 groups that hold a module's parameters, and reshards them afterwards.

    Those are the groups of the module itself and of the FSDP modules inside it; a module FSDP did not wrap has its
    own parameters in the group of its nearest wrapped ancestor (accelerate wraps each decoder layer and puts the
    embedding, final norm and head in groups of their own; a plain `fully_shard(model)` root holds them). Until the
    model is sharded (the trainer shards it when training starts) there is nothing to unshard.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @contextmanager
    def __call__(self, module: torch.nn.Module) -> Iterator[None]:
        groups = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not isinstance(module, FSDPModule):
            groups += self._wrapped_ancestor(module)
        with ExitStack() as stack:
            for group in groups:
                group.unshard()
                stack.callback(group.reshard)
            yield

    def _wrapped_ancestor(self, module: torch.nn.Module) -> list[FSDPModule]:
        name = next(name for name, candidate in self.model.named_modules() if candidate is module)
        parts = name.split(".") if name else []
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = self.model.get_submodule(".".join(parts[:depth]))
            if isinstance(ancestor, FSDPModule):
                return [ancestor]
        return []
