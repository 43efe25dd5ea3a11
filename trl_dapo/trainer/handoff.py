"""`HandOff`: a value one TRL hook produces and DAPO code consumes later in the same call of TRL's method.

TRL calls `_calculate_rewards` and `_generate_single_turn` from inside `_generate_and_score_completions`, whose
output carries neither the raw rewards nor the engine's logprobs. What DAPO needs from them waits here: putting a
second value before the first was taken, or taking one that was never put, is an error rather than a stale read.
"""

from __future__ import annotations

from typing import Generic, TypeVar

Value = TypeVar("Value")


class HandOff(Generic[Value]):
    """A one-value slot between two hooks, emptied by every read."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._value: Value | None = None
        self._full = False

    def put(self, value: Value) -> None:
        if self._full:
            raise RuntimeError(f"{self.name}: the value of the previous rollout was never used (a hook ran twice).")
        self._value, self._full = value, True

    def take(self) -> Value:
        if not self._full:
            raise RuntimeError(f"{self.name}: no value was produced for this rollout.")
        value, self._value, self._full = self._value, None, False
        return value

    def take_if_any(self) -> Value | None:
        """The value when one was put (the producer is optional, e.g. a generation engine), else None."""
        return self.take() if self._full else None
