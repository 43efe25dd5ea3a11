"""Which rows of an optimizer step each rank trains in each of its forward/backward passes.

Padded, a pass costs its rows times its longest row; packed, it costs its tokens. So padding-free passes are planned
by tokens: each rank gets about the same tokens of the step (the slowest rank sets the step's time), then its rows are
dealt to its passes, again balancing tokens, with at most `max_tokens` per pass (a longer row trains alone). Every rank
runs as many passes as the others: a forward of a sharded model (ZeRO-3, FSDP) or of DDP (its buffer broadcast) is a
collective, so a rank with nothing left runs an empty pass. The step's loss is a sum over its tokens divided by their
count, so any such partition gives the same loss and gradient.

The passes are grouped into the Trainer's `gradient_accumulation_steps` micro-batches. Within a rank, passes run from
the lightest to the heaviest: passes empty on every rank (a partial batch of few rows) come first and are skipped by
all ranks, so the step's last micro-batch, whose backward synchronises the gradients, always trains rows.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...rollout_batch import RolloutBatch, select_rows, trim_padding
from .step_metrics import StepMetrics

# [micro_batch][pass] -> row indices, for one rank
RankPlan = list[list[list[int]]]


@dataclass
class MicroBatch:
    """What one `training_step` of the Trainer trains on this rank: its passes, each a forward and a backward."""

    passes: list[RolloutBatch]
    # A pass other ranks run and this one has no rows for: a stand-in row of the step, trained with zero weight, so
    # this rank's forward, backward (every parameter gets its zero gradient) and metrics join the collectives.
    empty: list[bool]
    step_tokens: torch.Tensor  # loss tokens of the whole optimizer step, all micro-batches and ranks
    step_passes: int  # passes of the optimizer step on each rank (TRL's MoE router term is averaged over them)
    metrics: StepMetrics  # the step's loss metrics, shared by its micro-batches
    ends_step: bool  # the step's last micro-batch: its metrics are logged after it


def split_generation_batch(
    batch: RolloutBatch,
    *,
    rank: int,
    world: int,
    optimizer_steps: int,
    micro_batches: int,
    costs: Sequence[int] | None,
    loss_tokens: Sequence[int],
    max_tokens: int | None,
    generator: torch.Generator,
) -> list[MicroBatch]:
    """This rank's micro-batches of a global generation batch: rows shuffled (the same on every rank), cut into
    `optimizer_steps` steps of equal row counts (one more in the first ones), each planned by `costs` (a row's
    tokens; None: every row costs one, an even deal by row count, for padded passes). A step whose rows have no loss
    token (`loss_tokens`: each row's) trains none of them: like a step without rows, it is skipped."""
    rows = batch["completion_ids"].size(0)
    order = torch.randperm(rows, generator=generator).tolist()
    costs = [1] * rows if costs is None else costs
    out: list[MicroBatch] = []
    for step_rows in _split_evenly(order, optimizer_steps):
        tokens = sum(loss_tokens[row] for row in step_rows)
        step_rows = step_rows if tokens else []
        plans = plan_step([costs[row] for row in step_rows], world, micro_batches, max_tokens)
        step_tokens = torch.tensor(float(tokens))
        runs = [_passes_run_by_some_rank(plans, index) for index in range(micro_batches)]
        step_passes, metrics = sum(map(sum, runs)), StepMetrics()
        for index, micro_plan in enumerate(plans[rank]):
            passes = [
                [step_rows[row] for row in rows] for rows, run in zip(micro_plan, runs[index], strict=True) if run
            ]
            out.append(
                MicroBatch(
                    passes=_select_passes(batch, passes, stand_in=step_rows[0] if step_rows else 0),
                    empty=[not rows for rows in passes],
                    step_tokens=step_tokens.to(batch["completion_ids"].device),
                    step_passes=step_passes,
                    metrics=metrics,
                    ends_step=index == micro_batches - 1,
                )
            )
    return out


def _passes_run_by_some_rank(plans: list[RankPlan], micro_batch: int) -> list[bool]:
    """Which passes of a micro-batch hold rows on some rank: the others are skipped by every rank."""
    return [any(plan[micro_batch][index] for plan in plans) for index in range(len(plans[0][micro_batch]))]


def _select_passes(batch: RolloutBatch, passes: list[list[int]], stand_in: int) -> list[RolloutBatch]:
    """The passes' rows, each trimmed to its own widest prompt and completion (one host synchronisation); an empty
    pass gets row `stand_in` (trained with zero weight)."""
    device = batch["completion_ids"].device
    selected = [select_rows(batch, torch.tensor(rows or [stand_in], device=device)) for rows in passes]
    return trim_padding(selected) if selected else []


def deal_by_tokens(tokens: Sequence[int], rows: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-processing-time first: each row, longest first, to the bin with the fewest tokens so far (ties: the
    lower bin). Within 4/3 of the best balance; deterministic, so every rank computes the same deal."""
    heap = [(0, index) for index in range(bins)]
    dealt: list[list[int]] = [[] for _ in range(bins)]
    for row in sorted(rows, key=lambda row: (-tokens[row], row)):
        load, index = heapq.heappop(heap)
        dealt[index].append(row)
        heapq.heappush(heap, (load + tokens[row], index))
    return dealt


def _fits(tokens: Sequence[int], passes: list[list[int]], max_tokens: int | None) -> bool:
    return max_tokens is None or all(len(rows) <= 1 or sum(tokens[r] for r in rows) <= max_tokens for rows in passes)


def plan_step(tokens: Sequence[int], world: int, micro_batches: int, max_tokens: int | None) -> list[RankPlan]:
    """The passes of one optimizer step's rows (`tokens[i]`: row i's tokens, prompt and completion), per rank and
    micro-batch. At least one pass per micro-batch; more when `max_tokens` needs them (the same count on every rank)."""
    by_rank = deal_by_tokens(tokens, range(len(tokens)), world)
    passes = micro_batches
    if max_tokens is not None:  # a first guess from the heaviest rank; no more passes than its rows need
        heaviest = max(by_rank, key=lambda rows: sum(tokens[r] for r in rows))
        passes = max(passes, min(math.ceil(sum(tokens[r] for r in heaviest) / max_tokens), len(heaviest)))
    while True:
        dealt = [deal_by_tokens(tokens, rows, passes) for rows in by_rank]
        if all(_fits(tokens, rank_passes, max_tokens) for rank_passes in dealt):
            break
        passes += 1
    lightest_first = [
        sorted(rank_passes, key=lambda rows: (sum(tokens[r] for r in rows), len(rows))) for rank_passes in dealt
    ]
    return [_split_evenly(ordered, micro_batches) for ordered in lightest_first]


def _split_evenly(items: list, parts: int) -> list[list]:
    """`items` in `parts` consecutive pieces whose sizes differ by one at most, the larger ones first."""
    small, extra = divmod(len(items), parts)
    bounds = [index * small + min(index, extra) for index in range(parts + 1)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


def micro_batch_states(micro_batches: list[MicroBatch]) -> list[dict]:
    """What a checkpoint keeps of buffered micro-batches: tensors, flags and counts, loadable with `weights_only=True`.
    Their step metrics are left out: a checkpoint is saved between optimizer steps, when every step's are flushed."""
    return [
        dict(
            passes=mb.passes,
            empty=mb.empty,
            step_tokens=mb.step_tokens,
            step_passes=mb.step_passes,
            ends_step=mb.ends_step,
        )
        for mb in micro_batches
    ]


def micro_batches_from_states(states: list[dict]) -> list[MicroBatch]:
    """`micro_batch_states`' micro-batches again, those of one optimizer step sharing one (empty) step metrics."""
    out, metrics = [], StepMetrics()
    for state in states:
        out.append(MicroBatch(**state, metrics=metrics))
        if state["ends_step"]:
            metrics = StepMetrics()
    return out
