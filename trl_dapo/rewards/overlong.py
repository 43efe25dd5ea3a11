"""Soft overlong punishment (DAPO Eq. 13): a length penalty that starts `buffer_len` tokens before the limit.

Added to the task reward as one more reward function, so it lands in the total reward before the group advantages
are computed, while the dynamic-sampling filter still looks at task accuracy alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def soft_overlong_penalty(
    completion_lengths: torch.Tensor, max_completion_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """0 up to `max - buffer`, then linear down to `-penalty_factor` at `max`, `-penalty_factor` beyond."""
    if buffer_len <= 0:
        return torch.zeros_like(completion_lengths, dtype=torch.float32)
    expected = max_completion_length - buffer_len
    excess = (completion_lengths.float() - expected).clamp(min=0, max=buffer_len)
    return -excess / buffer_len * penalty_factor


OVERLONG_REWARD_NAME = "overlong_penalty"


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
