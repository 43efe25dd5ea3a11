"""Soft overlong punishment (DAPO Eq. 13): a length penalty that starts `buffer_len` tokens before the limit.

Added to the task reward as one more reward function, so it lands in the total reward before the group advantages
are computed, while the dynamic-sampling filter still looks at task accuracy alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def soft_overlong_penalty(
    completion_lengths: torch.Tensor | Sequence[int],
    max_completion_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """0 up to `max - buffer`, then linear down to `-penalty_factor` at `max`, `-penalty_factor` beyond; one float32
    value per length, from a tensor or any sequence of token counts."""
    lengths = _as_lengths(completion_lengths)
    if buffer_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    expected = max_completion_length - buffer_len
    excess = (lengths.float() - expected).clamp(min=0, max=buffer_len)
    return -excess / buffer_len * penalty_factor


def _as_lengths(completion_lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Token counts as a tensor; anything else is a `TypeError` that says what is expected."""
    try:
        lengths = torch.as_tensor(completion_lengths)
    except (TypeError, ValueError, RuntimeError):
        lengths = None
    if lengths is None or lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(
            f"soft_overlong_penalty: completion_lengths must be token counts (a tensor or a sequence of numbers), got "
            f"{type(completion_lengths).__name__} {completion_lengths!r:.80}; pass e.g. [len(ids) for ids in "
            "completion_ids]."
        )
    return lengths


OVERLONG_REWARD_NAME = "overlong_penalty"
# The name `trl.rewards.get_soft_overlong_punishment`'s reward function logs under: the same penalty as DAPOConfig's.
TRL_OVERLONG_REWARD_NAME = "soft_overlong_punishment_reward"


class OverlongPenalty:
    """Reward function form of `soft_overlong_penalty`, reading lengths from TRL's `completion_ids`."""

    def __init__(self, max_completion_length: int, buffer_len: int, penalty_factor: float) -> None:
        self.max_completion_length = max_completion_length
        self.buffer_len = buffer_len
        self.penalty_factor = penalty_factor

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        penalty = soft_overlong_penalty(lengths, self.max_completion_length, self.buffer_len, self.penalty_factor)
        return penalty.tolist()
