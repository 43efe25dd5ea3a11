"""Group filters: which prompt groups carry a learning signal.

A group whose filter metric is the same for every sample has zero advantage for all of them: it adds tokens to the
token-mean's denominator but nothing to the gradient. DAPO drops such groups (std > 0 keeps a group). A filter is any
`GroupFilter`, given to the buffer, which decides with it in rounds and hands it to the stream: `filter_groups` is
DAPO's, and the trainer passes it there once, the one place to swap in another (a threshold on the standard deviation
of a continuous reward, say). No filter has a default: one left out is an error, not DAPO's filter in its place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (per-row filter metric, group size) -> per-group bool: True keeps the group.
GroupFilter = Callable[[torch.Tensor, int], torch.Tensor]


def _grouped(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    if values.dim() != 1 or values.numel() % num_generations != 0:
        raise ValueError(
            f"filter values: expected a 1-D tensor of groups of {num_generations}, got shape {tuple(values.shape)}."
        )
    return values.view(-1, num_generations)


def filter_groups(values: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Boolean mask per group: True where the metric varies inside the group (NaN entries are ignored)."""
    grouped = _grouped(values, num_generations).float()
    valid = ~torch.isnan(grouped)
    low = torch.where(valid, grouped, torch.inf).amin(dim=1)
    high = torch.where(valid, grouped, -torch.inf).amax(dim=1)
    return (valid.sum(dim=1) >= 2) & (high > low)


def group_outcomes(values: torch.Tensor, num_generations: int, keep: GroupFilter) -> dict[str, int]:
    """Counts of kept groups, and of filtered ones split into all-correct (common value > 0) and all-wrong."""
    grouped = _grouped(values, num_generations)
    kept = keep(values, num_generations)
    first = torch.nan_to_num(grouped, nan=0.0).amax(dim=1)
    return {
        "qualified": int(kept.sum()),
        "all_correct": int((~kept & (first > 0)).sum()),
        "all_wrong": int((~kept & (first <= 0)).sum()),
    }


def solve_rate(values: torch.Tensor, num_generations: int) -> float:
    """Fraction of prompts with at least one sample whose metric is positive (correct)."""
    grouped = torch.nan_to_num(_grouped(values, num_generations), nan=0.0)
    return float((grouped > 0).any(dim=1).float().mean())
