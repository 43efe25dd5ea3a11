"""The loss metrics of one optimizer step, summed over its passes and ranks before any mean is taken.

A step's rows are dealt to passes by tokens when training padding-free and by rows when padded, so a mean per pass (or
per micro-batch), averaged over passes, would depend on the deal. Each metric is instead accumulated as a sum with
its weight (tokens for token means, rows for sequence means), maxima as maxima, and logged once per step: the same
value however the step's rows were split, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

# `ratio_std` is the one token metric that is no mean: it is carried as the second moment and turned back at the end.
RATIO_MEAN, RATIO_STD = "ratio_mean", "ratio_std"


class StepMetrics:
    """Weighted sums of one step's loss metrics on this rank; `flush` reduces them over the ranks once."""

    def __init__(self) -> None:
        self.token_sums: dict[str, torch.Tensor] = {}
        self.sequence_sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.tokens: torch.Tensor | None = None
        self.sequences: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    def add(
        self,
        token_means: Mapping[str, torch.Tensor],
        tokens: torch.Tensor,
        sequence_means: Mapping[str, torch.Tensor],
        sequences: torch.Tensor,
        maxima: Mapping[str, torch.Tensor],
        aux_loss: torch.Tensor | None = None,
    ) -> None:
        """One pass's means over its `tokens` active tokens and `sequences` rows, its maxima and TRL's `aux_loss`."""
        token_means = dict(token_means)
        if RATIO_STD in token_means:
            token_means[RATIO_STD] = token_means[RATIO_STD] ** 2 + token_means[RATIO_MEAN] ** 2
        _accumulate(self.token_sums, {name: value.float() * tokens for name, value in token_means.items()})
        _accumulate(self.sequence_sums, {name: value.float() * sequences for name, value in sequence_means.items()})
        for name, value in maxima.items():
            self.maxima[name] = value.float() if name not in self.maxima else torch.maximum(self.maxima[name], value)
        self.tokens = tokens.float() if self.tokens is None else self.tokens + tokens
        self.sequences = sequences.float() if self.sequences is None else self.sequences + sequences
        if aux_loss is not None:
            self.aux_loss = aux_loss.float() if self.aux_loss is None else self.aux_loss + aux_loss

    def flush(self, accelerator) -> dict[str, float]:
        """The step's metrics over all ranks (one sum and one max reduction, one host synchronisation); resets."""
        extra = [] if self.aux_loss is None else [self.aux_loss]
        sums = torch.stack(
            [*self.token_sums.values(), *self.sequence_sums.values(), self.tokens, self.sequences, *extra]
        )
        totals = accelerator.reduce(sums, reduction="sum")
        maxima = accelerator.reduce(torch.stack(list(self.maxima.values())), reduction="max")
        tokens, rows = len(self.token_sums), len(self.sequence_sums)
        values = torch.cat(
            [
                totals[:tokens] / totals[tokens + rows].clamp(min=1),
                totals[tokens : tokens + rows] / totals[tokens + rows + 1].clamp(min=1),
                maxima,
                totals[-1:] / accelerator.num_processes if extra else totals[:0],
            ]
        ).tolist()
        names = [*self.token_sums, *self.sequence_sums, *self.maxima] + (["aux_loss"] if extra else [])
        metrics = dict(zip(names, values, strict=True))
        if RATIO_STD in metrics:
            metrics[RATIO_STD] = max(metrics[RATIO_STD] - metrics[RATIO_MEAN] ** 2, 0.0) ** 0.5
        self.__init__()
        return metrics


def _accumulate(sums: dict[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    for name, value in values.items():
        sums[name] = value if name not in sums else sums[name] + value
