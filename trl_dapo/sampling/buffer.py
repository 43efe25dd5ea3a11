"""`DynamicSamplingBuffer`: gathers informative prompt groups over candidate rounds until a generation batch is full,
and keeps the surplus groups (and the running sampling efficiency) for later batches, in rounds and in stream mode.

It works on global rollout batches: its surplus and its decisions are the same on every rank, so the accepted batch
does not depend on how many ranks generated it (stream mode's groups left in flight are each rank's own, and live in
the stream's state, `stream_state.py`). Groups are never split: the buffer moves whole blocks of `num_generations`
consecutive rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..rollout_batch import SAMPLING_STEP, RolloutBatch, concat_rollouts, num_rows, select_rows
from .filters import GroupFilter
from .stats import SamplingStats

# One candidate round: given how many groups to generate and the round's index (0 = the first of this generation
# batch, which carries the Trainer's own dataloader batch), return the global batch and its per-row filter metric.
GenerateRound = Callable[[int, int], tuple[RolloutBatch, torch.Tensor]]
# Told before each extra round: (round index, groups it will generate, informative groups so far, groups needed).
RoundReport = Callable[[int, int, int, int], None]
# The prompts in one pass over the training set, or None while unknown (a stream's, until one pass has ended).
DatasetSize = Callable[[], int | None]

# Margin over the expected need when sizing rounds from the running efficiency ("auto"): overshoot is kept as
# surplus, a second round costs a whole generation pass.
AUTO_MARGIN = 1.25
# The running efficiency is a ratio of exponentially decayed sums (qualified / generated groups), so it has no prior
# to forget: the first round sets it, and large rounds weigh more than small ones.
EFFICIENCY_DECAY = 0.5


class DynamicSamplingLimitError(RuntimeError):
    """`max_num_gen_batches` candidate rounds did not yield enough informative groups."""


@dataclass
class FoundGroups:
    """The informative groups gathered for one generation batch so far, in the order found, with the optimizer step
    each was generated at (its birth)."""

    parts: list[RolloutBatch] = field(default_factory=list)
    births: list[torch.Tensor] = field(default_factory=list)
    groups: int = 0

    def add(self, batch: RolloutBatch, births: torch.Tensor) -> None:
        self.parts.append(batch)
        self.births.append(births)
        self.groups += int(births.numel())


def plan_round_groups(
    missing: int, efficiency: float, oversample: str, cap: int, multiple: int, minimum: int = 0
) -> int:
    """Groups to generate in the next round: `missing` scaled by the oversample factor (or, for "auto", divided by
    the running efficiency with a margin), at least `minimum`, at most `cap`, rounded up to `multiple`."""
    if oversample == "auto":
        wanted = missing * AUTO_MARGIN / max(efficiency, 1.0 / cap)
    else:
        wanted = missing * float(oversample)
    groups = min(max(math.ceil(wanted), minimum, 1), cap)
    return math.ceil(groups / multiple) * multiple


class DynamicSamplingBuffer:
    """Collect informative groups over candidate rounds it sizes itself; keep the surplus (with its birth step) for
    later generation batches. `keep_groups` decides which groups are informative, in rounds and, handed on by the
    collector, in the stream."""

    def __init__(
        self,
        num_generations: int,
        pad_token_id: int,
        keep_groups: GroupFilter,
        max_num_gen_batches: int = 10,
        on_limit: str = "train_on_partial",
        keep_surplus: bool = True,
        max_surplus_age: int = 1,
        oversample: str = "1.0",
        max_oversample: float = 4.0,
    ) -> None:
        self.num_generations = num_generations
        self.keep_groups = keep_groups
        self.pad_token_id = pad_token_id
        self.max_num_gen_batches = max_num_gen_batches
        self.on_limit = on_limit
        self.keep_surplus = keep_surplus
        self.max_surplus_age = max_surplus_age
        self.oversample = oversample
        self.max_oversample = max_oversample
        self.surplus: RolloutBatch | None = None
        self.surplus_birth = torch.zeros(0, dtype=torch.long)
        self.qualified_weight, self.generated_weight = 0.0, 0.0

    @property
    def efficiency(self) -> float:
        """Running share of generated groups that qualified (1.0 before any round)."""
        return self.qualified_weight / self.generated_weight if self.generated_weight else 1.0

    @property
    def num_surplus_groups(self) -> int:
        return int(self.surplus_birth.numel())

    def plan_round(self, missing: int, target_groups: int, round_index: int, group_multiple: int) -> int:
        """Groups the next round generates: the first round at least the whole dataloader batch (`target_groups`),
        every round at most `max_oversample` generation batches."""
        cap = max(math.ceil(self.max_oversample * target_groups), target_groups)
        minimum = target_groups if round_index == 0 else 0
        return plan_round_groups(missing, self.efficiency, self.oversample, cap, group_multiple, minimum)

    def _group_rows(self, groups: torch.Tensor) -> torch.Tensor:
        return (groups.unsqueeze(1) * self.num_generations + torch.arange(self.num_generations)).flatten()

    def tokens(self, batch: RolloutBatch, groups: torch.Tensor | None = None, sampled_at: int | None = None) -> int:
        """Completion tokens of `groups` of `batch` (all of them when None); with `sampled_at`, only those the weights
        of that optimizer step sampled (a carried row's earlier tokens were counted when they were generated)."""
        mask = batch["completion_mask"]
        if sampled_at is not None and SAMPLING_STEP in batch:
            mask = mask * (batch[SAMPLING_STEP] == sampled_at)
        if groups is not None:
            mask = mask[self._group_rows(groups).to(mask.device)]
        return int(mask.sum())

    def _select_groups(self, batch: RolloutBatch, groups: torch.Tensor) -> RolloutBatch:
        return select_rows(batch, self._group_rows(groups).to(batch["completion_ids"].device))

    def fill(
        self,
        target_groups: int,
        generate_round: GenerateRound,
        step: int,
        group_multiple: int = 1,
        dataset_prompts: DatasetSize | None = None,
        report: RoundReport | None = None,
    ) -> tuple[RolloutBatch, SamplingStats]:
        """Return up to `target_groups` informative groups (surplus first, then candidate rounds in order) and the
        stats.

        `group_multiple`: the returned group count is a multiple of it (so the rows share equally over ranks).
        `dataset_prompts`: the training set's size, asked before every round (a stream's becomes known while the
        rounds draw from it); with unlimited rounds, that many uninformative groups in a row (a full pass over the
        data) stop the search with an error instead of looping forever.
        At the round limit with `on_limit="train_on_partial"` the batch may be short, or empty when nothing qualified:
        the caller then skips the optimizer step.
        """
        stats = SamplingStats()
        found = self.take_surplus(stats, step)
        uninformative_run, candidates = 0, None
        while found.groups < target_groups:
            if self.max_num_gen_batches and stats.gen_batches >= self.max_num_gen_batches:
                break
            pass_size = dataset_prompts() if dataset_prompts is not None else None
            if not self.max_num_gen_batches and pass_size is not None and uninformative_run >= pass_size:
                raise DynamicSamplingLimitError(full_pass_message(stats, pass_size))
            groups = self.plan_round(target_groups - found.groups, target_groups, stats.gen_batches, group_multiple)
            if report is not None and stats.gen_batches:
                report(stats.gen_batches, groups, found.groups, target_groups)
            candidates, metric = generate_round(groups, stats.gen_batches)
            kept = self._record_round(stats, metric.cpu())
            keep = kept.nonzero().flatten()
            stats.generated_tokens += self.tokens(candidates, sampled_at=step)
            stats.filtered_tokens += self.tokens(candidates, (~kept).nonzero().flatten(), sampled_at=step)
            uninformative_run = 0 if keep.numel() else uninformative_run + num_rows(candidates) // self.num_generations
            if keep.numel():
                found.add(self._select_groups(candidates, keep), torch.full((keep.numel(),), step, dtype=torch.long))
        spent = (
            f"Dynamic sampling ran {stats.gen_batches} candidate generation rounds (max_num_gen_batches="
            f"{self.max_num_gen_batches})"
        )
        return self.accept(stats, found, target_groups, group_multiple, step, candidates, spent)

    def take_surplus(self, stats: SamplingStats, step: int) -> FoundGroups:
        """The surplus groups young enough for this batch, the first groups found (the others are counted as
        discarded); empties the surplus."""
        found = FoundGroups()
        if self.surplus is not None and self.num_surplus_groups:
            fresh = (step - self.surplus_birth) <= self.max_surplus_age
            stats.discarded_qualified_groups += int((~fresh).sum())
            stats.untrained_tokens += self.tokens(self.surplus, (~fresh).nonzero().flatten())
            kept = fresh.nonzero().flatten()
            if kept.numel():
                found.add(self._select_groups(self.surplus, kept), self.surplus_birth[kept])
            stats.surplus_used = int(kept.numel())
        self.surplus, self.surplus_birth = None, torch.zeros(0, dtype=torch.long)
        return found

    def accept(
        self,
        stats: SamplingStats,
        found: FoundGroups,
        target_groups: int,
        group_multiple: int,
        step: int,
        candidates: RolloutBatch | None,
        spent: str,
    ) -> tuple[RolloutBatch, SamplingStats]:
        """The first `target_groups` groups found (fewer, a multiple of `group_multiple`, at the limit); the rest
        become surplus, or are discarded. `candidates`: the last batch generated, whose keys an empty batch takes;
        `spent`: what the search spent, for the error of `on_limit="raise"`."""
        have = found.groups
        take = min(have, target_groups)
        if take < target_groups:
            stats.partial = True
            take -= take % group_multiple
            if self.on_limit == "raise":
                raise DynamicSamplingLimitError(limit_message(spent, stats, have, target_groups))
        accepted = concat_rollouts(found.parts, self.pad_token_id) if found.parts else candidates
        birth = torch.cat(found.births) if found.births else torch.zeros(0, dtype=torch.long)
        rest = torch.arange(take, have)
        if rest.numel() and (self.keep_surplus or stats.partial):
            self.surplus, self.surplus_birth = self._select_groups(accepted, rest), birth[rest]
            stats.surplus_tokens += self.tokens(accepted, rest[birth[rest] == step], sampled_at=step)
        else:
            stats.discarded_qualified_groups += int(rest.numel())
            stats.untrained_tokens += self.tokens(accepted, rest)
        stats.surplus_groups = self.num_surplus_groups
        return self._select_groups(accepted, torch.arange(take)), stats

    def record_efficiency(self, qualified_groups: int, generated_groups: int) -> None:
        """Fold one round's (or one stream's) group counts into the running efficiency."""
        self.qualified_weight = EFFICIENCY_DECAY * self.qualified_weight + qualified_groups
        self.generated_weight = EFFICIENCY_DECAY * self.generated_weight + generated_groups

    def _record_round(self, stats: SamplingStats, metric: torch.Tensor) -> torch.Tensor:
        """Count one round in the stats and the running efficiency; return which of its groups are informative."""
        qualified_before, generated_before = stats.qualified_groups, stats.generated_groups
        kept = stats.count_groups(metric, self.num_generations, self.keep_groups)
        stats.gen_batches += 1
        self.record_efficiency(stats.qualified_groups - qualified_before, stats.generated_groups - generated_before)
        return kept

    def state_dict(self) -> dict:
        """Checkpoint state on the CPU, loadable with `torch.load(weights_only=True)` (tensors, numbers, dicts)."""
        surplus = None if self.surplus is None else {key: value.cpu() for key, value in self.surplus.items()}
        return {
            "surplus": surplus,
            "surplus_birth": self.surplus_birth,
            "qualified_weight": self.qualified_weight,
            "generated_weight": self.generated_weight,
        }

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        surplus = state["surplus"]
        self.surplus = None if surplus is None else {key: value.to(device) for key, value in surplus.items()}
        self.surplus_birth = state["surplus_birth"]
        self.qualified_weight = state["qualified_weight"]
        self.generated_weight = state["generated_weight"]


def found_message(stats: SamplingStats) -> str:
    return (
        f"{stats.qualified_groups} of {stats.generated_groups} generated groups had varied rewards; filtered "
        f"all-correct: {stats.filtered_all_correct}, all-wrong: {stats.filtered_all_wrong}"
    )


def limit_message(spent: str, stats: SamplingStats, have: int, target: int) -> str:
    """The error of `dynamic_sampling_on_limit="raise"`: `spent` says what the search spent (rounds, or a stream's
    admissions)."""
    return (
        f"{spent} and found {have} of the {target} informative groups this batch needs "
        f"({found_message(stats)}). Set dynamic_sampling_on_limit='train_on_partial' to train on the groups found "
        "(and skip the step when there are none), raise max_num_gen_batches, or use prompts whose difficulty "
        "suits the model."
    )


def full_pass_message(stats: SamplingStats, dataset_prompts: int) -> str:
    """The error of unlimited rounds (or streams) after a pass over the training set without an informative group."""
    return (
        f"Dynamic sampling (max_num_gen_batches=0, unlimited) generated at least {dataset_prompts} groups in a "
        f"row, as many as train_dataset has prompts, without one informative group ({found_message(stats)}): the "
        "rewards do not vary within any group (a constant reward, or a policy that always solves or always fails "
        "every prompt). Check the reward functions, use prompts whose difficulty suits the model, or bound the "
        "rounds with max_num_gen_batches and dynamic_sampling_on_limit='train_on_partial'."
    )


__all__ = [
    "DynamicSamplingBuffer",
    "DynamicSamplingLimitError",
    "FoundGroups",
    "full_pass_message",
    "limit_message",
    "plan_round_groups",
]
