"""An optimizer step with no rows under DeepSpeed.

Elsewhere such a step leaves `.grad` None, so torch's optimizers leave the parameters and their state alone. DeepSpeed
takes its optimizer step inside the Trainer's backward of the step's last micro-batch, and its ZeRO and bf16
optimizers hand the torch optimizer zero gradients where none arrived: Adam's moments and weight decay would still
move the weights. So for that one engine step the torch optimizer's own `step` is suspended, on every rank (each rank
sees the same empty step): DeepSpeed still clears and clips the (zero) gradients, advances its counters and the
learning-rate schedule, as a skipped step does under DDP and FSDP, and copies its unchanged float32 weights back into
the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_ABSENT = object()


def skip_next_update(engine: Any) -> None:
    """The next `engine.step()` (the one the Trainer's backward of this micro-batch takes) applies no update: its
    torch optimizers (`engine.basic_optimizer`, and the one ZeRO-3 keeps for partitions left on the device when it
    offloads the others) do not step. Armed once, consumed by that call."""
    optimizers = [engine.basic_optimizer, getattr(engine.optimizer, "backup_optimizer", None)]
    engine_step = engine.step

    def step_without_update(*args: Any, **kwargs: Any) -> Any:
        del engine.step  # one step only: the engine's own method is back for the next one
        with contextlib.ExitStack() as suspended:
            for optimizer in filter(None, optimizers):
                suspended.enter_context(_shadowed(optimizer, "step", _no_update))
            return engine_step(*args, **kwargs)

    engine.step = step_without_update


def _no_update(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _shadowed(owner: Any, name: str, value: Any) -> Iterator[None]:
    """`owner.name` is `value` inside, then what it was (an instance attribute, e.g. an LR scheduler's step counter
    wrapper, or the class's method)."""
    saved = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
