"""`DynamicSamplingBuffer`: gathers informative prompt groups over candidate rounds until a generation batch is full.

It works on global rollout batches (every rank holds the same view), so every rank takes the same decisions and the
accepted batch does not depend on how many ranks generated it. Groups are never split: the buffer moves whole blocks
of `num_generations` consecutive rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..rollout_batch import RolloutBatch, concat_rollouts, num_rows, select_rows
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
        # stream mode, in_flight="carry": this rank's groups left in flight, resumed by the next stream (not saved
        # with checkpoints: a resumed run generates them again)
        self.carried: list = []
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

    def _tokens(self, batch: RolloutBatch, groups: torch.Tensor | None = None) -> int:
        """Completion tokens of `groups` of `batch` (all of them when None)."""
        mask = batch["completion_mask"]
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
        parts, births, have = self._take_surplus(stats, step)
        uninformative_run, candidates = 0, None
        while have < target_groups:
            if self.max_num_gen_batches and stats.gen_batches >= self.max_num_gen_batches:
                break
            pass_size = dataset_prompts() if dataset_prompts is not None else None
            if not self.max_num_gen_batches and pass_size is not None and uninformative_run >= pass_size:
                raise DynamicSamplingLimitError(self._full_pass_message(stats, pass_size))
            groups = self.plan_round(target_groups - have, target_groups, stats.gen_batches, group_multiple)
            if report is not None and stats.gen_batches:
                report(stats.gen_batches, groups, have, target_groups)
            candidates, metric = generate_round(groups, stats.gen_batches)
            kept = self._record_round(stats, metric.cpu())
            keep = kept.nonzero().flatten()
            stats.generated_tokens += self._tokens(candidates)
            stats.filtered_tokens += self._tokens(candidates, (~kept).nonzero().flatten())
            uninformative_run = 0 if keep.numel() else uninformative_run + num_rows(candidates) // self.num_generations
            if keep.numel():
                parts.append(self._select_groups(candidates, keep))
                births.append(torch.full((keep.numel(),), step, dtype=torch.long))
                have += keep.numel()
        return self._cut(stats, parts, births, have, target_groups, group_multiple, step, candidates)

    def fill_stream(
        self,
        target_groups: int,
        stream: Callable[[int], tuple[RolloutBatch, SamplingStats]],
        step: int,
        group_multiple: int = 1,
    ) -> tuple[RolloutBatch, SamplingStats]:
        """`fill` for streaming dynamic sampling: surplus first, then one stream asked for the groups still missing,
        which returns its kept groups (global, in acceptance order; possibly none) and its counts."""
        stats = SamplingStats()
        parts, births, have = self._take_surplus(stats, step)
        kept = None
        if have < target_groups:
            kept, counts = stream(target_groups - have)
            stats += counts
            stats.gen_batches = 1
            self.qualified_weight = EFFICIENCY_DECAY * self.qualified_weight + counts.qualified_groups
            self.generated_weight = EFFICIENCY_DECAY * self.generated_weight + counts.generated_groups
            if num_rows(kept):
                groups = num_rows(kept) // self.num_generations
                parts.append(kept)
                births.append(torch.full((groups,), step, dtype=torch.long))
                have += groups
        return self._cut(stats, parts, births, have, target_groups, group_multiple, step, kept, streamed=True)

    def _take_surplus(self, stats: SamplingStats, step: int) -> tuple[list[RolloutBatch], list[torch.Tensor], int]:
        """The surplus groups young enough for this batch (the others are counted as discarded); empties it."""
        parts: list[RolloutBatch] = []
        births: list[torch.Tensor] = []
        if self.surplus is not None and self.num_surplus_groups:
            fresh = (step - self.surplus_birth) <= self.max_surplus_age
            stats.discarded_qualified_groups += int((~fresh).sum())
            stats.untrained_tokens += self._tokens(self.surplus, (~fresh).nonzero().flatten())
            kept = fresh.nonzero().flatten()
            if kept.numel():
                parts.append(self._select_groups(self.surplus, kept))
                births.append(self.surplus_birth[kept])
            stats.surplus_used = int(kept.numel())
        self.surplus, self.surplus_birth = None, torch.zeros(0, dtype=torch.long)
        return parts, births, stats.surplus_used

    def _cut(
        self,
        stats: SamplingStats,
        parts: list[RolloutBatch],
        births: list[torch.Tensor],
        have: int,
        target_groups: int,
        group_multiple: int,
        step: int,
        candidates: RolloutBatch | None,
        streamed: bool = False,
    ) -> tuple[RolloutBatch, SamplingStats]:
        """The first `target_groups` groups found (fewer, a multiple of `group_multiple`, at the limit); the rest
        become surplus, or are discarded."""
        take = min(have, target_groups)
        if take < target_groups:
            stats.partial = True
            take -= take % group_multiple
            if self.on_limit == "raise":
                raise DynamicSamplingLimitError(self._limit_message(stats, have, target_groups, streamed))
        accepted = concat_rollouts(parts, self.pad_token_id) if parts else candidates
        birth = torch.cat(births) if births else torch.zeros(0, dtype=torch.long)
        rest = torch.arange(take, have)
        if rest.numel() and (self.keep_surplus or stats.partial):
            self.surplus, self.surplus_birth = self._select_groups(accepted, rest), birth[rest]
            stats.surplus_tokens += self._tokens(accepted, rest[birth[rest] == step])
        else:
            stats.discarded_qualified_groups += int(rest.numel())
            stats.untrained_tokens += self._tokens(accepted, rest)
        stats.surplus_groups = self.num_surplus_groups
        return self._select_groups(accepted, torch.arange(take)), stats

    def _record_round(self, stats: SamplingStats, metric: torch.Tensor) -> torch.Tensor:
        """Count one round in the stats and the running efficiency; return which of its groups are informative."""
        qualified_before, generated_before = stats.qualified_groups, stats.generated_groups
        kept = stats.count_groups(metric, self.num_generations, self.keep_groups)
        stats.gen_batches += 1
        self.qualified_weight = EFFICIENCY_DECAY * self.qualified_weight + stats.qualified_groups - qualified_before
        self.generated_weight = EFFICIENCY_DECAY * self.generated_weight + stats.generated_groups - generated_before
        return kept

    def _found(self, stats: SamplingStats) -> str:
        return (
            f"{stats.qualified_groups} of {stats.generated_groups} generated groups had varied rewards; filtered "
            f"all-correct: {stats.filtered_all_correct}, all-wrong: {stats.filtered_all_wrong}"
        )

    def _limit_message(self, stats: SamplingStats, have: int, target: int, streamed: bool = False) -> str:
        if streamed:
            spent = (
                f"Streaming dynamic sampling admitted its budget of groups (max_num_gen_batches="
                f"{self.max_num_gen_batches} x dynamic_sampling_max_oversample={self.max_oversample} generation "
                "batches)"
            )
        else:
            spent = (
                f"Dynamic sampling ran {stats.gen_batches} candidate generation rounds (max_num_gen_batches="
                f"{self.max_num_gen_batches})"
            )
        return (
            f"{spent} and found {have} of the {target} informative groups this batch needs "
            f"({self._found(stats)}). Set dynamic_sampling_on_limit='train_on_partial' to train on the groups found "
            "(and skip the step when there are none), raise max_num_gen_batches, or use prompts whose difficulty "
            "suits the model."
        )

    def _full_pass_message(self, stats: SamplingStats, dataset_prompts: int) -> str:
        return (
            f"Dynamic sampling (max_num_gen_batches=0, unlimited) generated at least {dataset_prompts} groups in a "
            f"row, as many as train_dataset has prompts, without one informative group ({self._found(stats)}): the "
            "rewards do not vary within any group (a constant reward, or a policy that always solves or always fails "
            "every prompt). Check the reward functions, use prompts whose difficulty suits the model, or bound the "
            "rounds with max_num_gen_batches and dynamic_sampling_on_limit='train_on_partial'."
        )

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


__all__ = ["DynamicSamplingBuffer", "DynamicSamplingLimitError", "plan_round_groups"]
