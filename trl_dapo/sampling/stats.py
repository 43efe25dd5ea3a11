"""`SamplingStats`: what one generation batch's dynamic sampling did, in rounds or streamed, logged as `dapo/*`.

The one record the buffer, the stream, the trainer's gathering over ranks and the metrics share: counts add up
(`+=`, over rounds and over ranks), and a scored round of groups is counted in one place (`count_groups`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .filters import GroupFilter, group_outcomes, solve_rate


@dataclass
class SamplingStats:
    """What one fill did, logged as `dapo/*` metrics."""

    gen_batches: int = 0
    generated_groups: int = 0
    qualified_groups: int = 0
    filtered_all_correct: int = 0
    filtered_all_wrong: int = 0
    surplus_used: int = 0
    surplus_groups: int = 0
    discarded_qualified_groups: int = 0
    solved_prompts: float = 0.0
    partial: bool = False
    generated_tokens: int = 0  # completion tokens generated for this generation batch
    filtered_tokens: int = 0  # of those, in filtered groups
    untrained_tokens: int = 0  # generated and never to be trained: discarded qualified groups, rows dropped in flight
    surplus_tokens: int = 0  # of this batch's qualified groups, kept for a later batch
    busy_slot_steps: int = 0  # decode slots busy, summed over decode steps and ranks (the engine's count)
    pool_slot_steps: int = 0  # all decode slots of the engine's calls, likewise (0: no engine of trl-dapo)
    prefill_tokens: int = 0  # tokens the engine prefilled, likewise: prompts, and carried rows recomputed

    def metrics(self) -> dict[str, float]:
        generated = max(self.generated_groups, 1)
        engine = (
            {
                "dapo/slot_occupancy": self.busy_slot_steps / self.pool_slot_steps,
                "dapo/prefill_tokens": self.prefill_tokens,
            }
            if self.pool_slot_steps
            else {}
        )
        return {
            **engine,
            "dapo/generated_tokens": self.generated_tokens,
            "dapo/filtered_tokens": self.filtered_tokens,
            "dapo/untrained_tokens": self.untrained_tokens,
            "dapo/surplus_tokens": self.surplus_tokens,
            "dapo/untrained_token_share": self.untrained_tokens / max(self.generated_tokens - self.filtered_tokens, 1),
            "dapo/gen_batches": self.gen_batches,
            "dapo/generated_groups": self.generated_groups,
            "dapo/qualified_groups": self.qualified_groups,
            "dapo/filtered_groups": self.filtered_all_correct + self.filtered_all_wrong,
            "dapo/filtered_groups_all_correct": self.filtered_all_correct,
            "dapo/filtered_groups_all_wrong": self.filtered_all_wrong,
            "dapo/surplus_groups_used": self.surplus_used,
            "dapo/surplus_groups": self.surplus_groups,
            "dapo/discarded_qualified_groups": self.discarded_qualified_groups,
            "dapo/sampling_efficiency": self.qualified_groups / generated,
            "dapo/solve_rate": self.solved_prompts / generated,
            "dapo/partial_batch": float(self.partial),
        }

    def count_groups(self, metric: torch.Tensor, num_generations: int, keep: GroupFilter) -> torch.Tensor:
        """Count a scored batch of groups (per-row filter metric, on the host); return which groups `keep` keeps."""
        outcomes = group_outcomes(metric, num_generations, keep)
        groups = metric.numel() // num_generations
        self.generated_groups += groups
        self.qualified_groups += outcomes["qualified"]
        self.filtered_all_correct += outcomes["all_correct"]
        self.filtered_all_wrong += outcomes["all_wrong"]
        self.solved_prompts += solve_rate(metric, num_generations) * groups
        return keep(metric, num_generations)

    def __iadd__(self, other: SamplingStats) -> SamplingStats:
        """Add another record's counts (a stream's to its batch's, or another rank's); `partial` if either is."""
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            setattr(self, field.name, (mine or theirs) if isinstance(mine, bool) else mine + theirs)
        return self
