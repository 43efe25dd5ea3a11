"""What one generation batch did, logged as `dapo/*`: `SamplingStats`, what its dynamic sampling did (in rounds or
streamed), and `GenerationStats`, what trl-dapo's engine did and what partial rollouts carried, in every mode.

The records the buffer, the stream, the trainer's gathering over ranks and the metrics share: counts add up (`+=`,
over rounds and over ranks), and a scored round of groups is counted in one place (`count_groups`).
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

    def metrics(self) -> dict[str, float]:
        generated = max(self.generated_groups, 1)
        return {
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
        return _add_fields(self, other)


@dataclass
class GenerationStats:
    """What trl-dapo's engine did for one generation batch (its calls' counts, summed over calls and ranks), and the
    groups partial rollouts left in flight at its end; all zero where TRL's path generated."""

    busy_slot_steps: int = 0  # decode slots busy, summed over decode steps
    pool_slot_steps: int = 0  # all decode slots of the engine's calls, likewise (0: the engine did not generate)
    prefill_tokens: int = 0  # tokens prefilled: prompts, and carried rows recomputed
    decode_steps: int = 0
    tail_decode_steps: int = 0  # of those, with under a quarter of the slots busy (the engine's `tail_decode_steps`)
    resumed_prefill_tokens: int = 0  # of `prefill_tokens`, the prompts and earlier tokens of carried rows resumed
    resumed_rows: int = 0  # carried rows resumed (after tokens an earlier call sampled)
    kept_cache_rows: int = 0  # of those, continued from their kept KV without a prefill (`rollout/kept.py`)
    kept_cache_tokens: int = 0  # their prompts and earlier tokens, whose prefill the kept KV saved
    kept_cache_bytes: int = 0  # KV kept for rows carried on, summed over rounds (the last held in training)
    carried_groups: int = 0  # groups held for the next round or generation batch (partial rollouts)
    carried_rows: int = 0  # their rows still to decode
    carried_tokens: int = 0  # every token they hold, finished siblings' included
    aged_out_groups: int = 0  # carried groups dropped for age (`partial_rollout_max_age`), never trained
    aged_out_tokens: int = 0  # their tokens
    generated_tokens: int = 0  # tokens the engine sampled for this batch (not those of rows it resumed); not logged
    # here: dynamic sampling's record logs its own count

    @classmethod
    def from_engine(cls, stats) -> GenerationStats:
        """The counts of one engine call (`RolloutStats`, or a stand-in with the same names)."""
        names = (
            "busy_slot_steps",
            "pool_slot_steps",
            "prefill_tokens",
            "decode_steps",
            "tail_decode_steps",
            "resumed_prefill_tokens",
            "resumed_rows",
            "kept_cache_rows",
            "kept_cache_tokens",
            "kept_cache_bytes",
        )
        counts = {name: getattr(stats, name) for name in names}
        return cls(**counts, generated_tokens=stats.generated_tokens - stats.resumed_tokens)

    def metrics(self) -> dict[str, float]:
        """The engine's counts where it generated; the carried counts whenever partial rollouts carry or drop any."""
        values = {}
        if self.pool_slot_steps:
            values = {
                "dapo/slot_occupancy": self.busy_slot_steps / self.pool_slot_steps,
                "dapo/prefill_tokens": self.prefill_tokens,
                "dapo/tail_share": self.tail_decode_steps / max(self.decode_steps, 1),
                "dapo/resumed_prefill_tokens": self.resumed_prefill_tokens,
                "dapo/carried_rows_reprefilled": self.resumed_rows - self.kept_cache_rows,
                "dapo/carried_rows_kept_cache": self.kept_cache_rows,
                "dapo/carried_tokens_kept_cache": self.kept_cache_tokens,
                "dapo/kept_cache_bytes": self.kept_cache_bytes,
            }
        carried = ("carried_groups", "carried_rows", "carried_tokens", "aged_out_groups", "aged_out_tokens")
        if any(getattr(self, name) for name in carried):
            values |= {f"dapo/{name}": getattr(self, name) for name in carried}
        return values

    def summed(self, accelerator) -> GenerationStats:
        """The counts summed over the ranks (one all-reduce; every rank calls it)."""
        if accelerator.num_processes == 1:
            return self
        names = [field.name for field in dataclasses.fields(self)]
        local = torch.tensor([getattr(self, name) for name in names], dtype=torch.long, device=accelerator.device)
        total = accelerator.reduce(local, reduction="sum").tolist()
        return GenerationStats(**dict(zip(names, map(int, total), strict=True)))

    def __iadd__(self, other: GenerationStats) -> GenerationStats:
        return _add_fields(self, other)


def _add_fields(record, other):
    """Add `other`'s counts field by field; a flag is set if either record's is."""
    for field in dataclasses.fields(record):
        mine, theirs = getattr(record, field.name), getattr(other, field.name)
        setattr(record, field.name, (mine or theirs) if isinstance(mine, bool) else mine + theirs)
    return record
