"""Reward functions: DAPO's soft overlong punishment and the math answer reward."""

from .overlong import OverlongPenalty, soft_overlong_penalty

__all__ = ["OverlongPenalty", "soft_overlong_penalty"]
