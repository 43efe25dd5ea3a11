"""Streaming dynamic sampling: one generation call per generation batch that scores each prompt group as soon as its
last row ends, keeps or drops it at once, and refills the freed decode slots with new prompts until the kept groups
cover the batch.

Rounds (`buffer.py`) wait for a round's longest row before scoring, and each extra round pays that tail again; here
the device keeps decoding while the host scores. Admission follows the deficit: new groups enter while the kept
groups plus the expected yield of the groups in flight (running sampling efficiency x groups in flight) fall short.

Across ranks each one streams its own prompts (its share of the dataloader batch, then every `world`-th prompt of
the extra-prompt stream) and they agree every `sync_every` engine synchronisations, with one small all-reduce, on the
global counts: when to admit more, and when the batch is full. Every decision reads only those counts, so the kept
groups are a function of the seed and the number of ranks, never of timing. Nothing here imports the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .filters import filter_groups, group_outcomes, solve_rate

IN_FLIGHT_POLICIES = ("finish", "drop")
# Floor on the efficiency the admission divides by, so a run of filtered groups cannot ask for unbounded prompts.
MIN_EFFICIENCY = 1.0 / 16

# Draw the rank's next prompt: (its dataset row, its prompt token ids).
NextPrompt = Callable[[], tuple[dict[str, Any], list[int]]]
# Score one finished group on the host: (rows, prompt ids, completions) -> (rewards (G, functions), filter metric (G,)).
ScoreGroup = Callable[[list[dict[str, Any]], list[int], list[list[int]]], tuple[torch.Tensor, torch.Tensor]]
# Sum a list of numbers over ranks (identity on one rank).
AgreeSum = Callable[[list[float]], list[float]]


@dataclass
class StreamedGroup:
    """A kept group: its rows, completions, rollout logprobs (G, max_new_tokens) and host-side rewards."""

    rows: list[dict[str, Any]]
    prompt_ids: list[int]
    completions: list[list[int]]
    logprobs: torch.Tensor
    rewards: torch.Tensor
    order: int  # finish order on this rank

    @property
    def tokens(self) -> int:
        return sum(len(completion) for completion in self.completions)


@dataclass
class StreamOutcome:
    """What one rank's stream did: its kept groups in finish order and its counts."""

    kept: list[StreamedGroup] = field(default_factory=list)
    generated_groups: int = 0  # groups scored
    qualified_groups: int = 0
    filtered_all_correct: int = 0
    filtered_all_wrong: int = 0
    solved_prompts: float = 0.0
    admitted_groups: int = 0
    generated_tokens: int = 0
    filtered_tokens: int = 0
    dropped_groups: int = 0  # in flight when the batch was full, dropped unscored (policy "drop")
    busy_slot_steps: int = 0
    pool_slot_steps: int = 0
    full: bool = False  # the kept groups of all ranks covered the batch


class GroupStream:
    """Drives one rank's `RolloutStream` for a generation batch (see the module docstring)."""

    def __init__(
        self,
        start: Callable[[list[list[int]]], Any],
        next_prompt: NextPrompt,
        score: ScoreGroup,
        agree: AgreeSum,
        num_generations: int,
        world: int,
        sync_every: int = 1,
        in_flight: str = "finish",
        prior: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight={in_flight!r}: use one of {IN_FLIGHT_POLICIES}.")
        self.start, self.next_prompt, self.score, self.agree = start, next_prompt, score, agree
        self.num_generations, self.world, self.sync_every, self.in_flight = (
            num_generations,
            world,
            sync_every,
            in_flight,
        )
        self.prior_qualified, self.prior_generated = prior

    def efficiency(self, qualified: float, generated: float) -> float:
        """Running share of groups that qualify: the buffer's decayed history plus this stream's global counts."""
        total = self.prior_generated + generated
        return (self.prior_qualified + qualified) / total if total else 1.0

    def allowance(
        self, missing: int, kept: float, in_flight: float, efficiency: float, budget_left: float, room: float
    ) -> int:
        """Groups this rank may admit now: the global deficit after the expected yield of the groups in flight,
        divided by the efficiency, shared over ranks, within the admission budget and the room for groups in flight
        (`max_in_flight` minus those in flight, over all ranks)."""
        deficit = missing - kept - efficiency * in_flight
        if deficit <= 0 or budget_left <= 0 or room <= 0:
            return 0
        wanted = math.ceil(deficit / max(efficiency, MIN_EFFICIENCY) / self.world)
        if room != math.inf:
            wanted = min(wanted, math.ceil(room / self.world))
        return max(0, min(wanted, math.floor(budget_left / self.world)))

    def run(self, missing: int, budget: int, max_in_flight: int | None = None) -> StreamOutcome:
        """Stream until the kept groups of all ranks reach `missing` or `budget` groups (over all ranks) were admitted
        and scored, with at most about `max_in_flight` groups (over all ranks) admitted and not yet scored."""
        cap = math.inf if max_in_flight is None else max_in_flight
        outcome = StreamOutcome()
        G = self.num_generations
        pending: dict[int, dict] = {}  # group id -> its rows, prompt ids, and the stream rows not yet ended
        row_group: dict[int, int] = {}
        stream = None
        finished: list[StreamedGroup] = []

        def admit(count: int) -> None:
            nonlocal stream
            if count <= 0:
                return
            drawn = [self.next_prompt() for _ in range(count)]
            prompts = [ids for _, ids in drawn for _ in range(G)]
            if stream is None:
                stream = self.start(prompts)
                rows = list(range(len(prompts)))
            else:
                rows = stream.add(prompts)
            for index, (row, ids) in enumerate(drawn):
                group = outcome.admitted_groups + index
                stream_rows = rows[index * G : (index + 1) * G]
                pending[group] = {"rows": [row] * G, "prompt_ids": ids, "stream_rows": stream_rows, "left": G}
                row_group.update(dict.fromkeys(stream_rows, group))
            outcome.admitted_groups += count

        def collect(ended: list[int]) -> None:
            done = []
            for row in ended:
                group = row_group.pop(row)
                pending[group]["left"] -= 1
                if pending[group]["left"] == 0:
                    done.append(group)
            for group in done:
                entry = pending.pop(group)
                completions, logprobs = stream.outputs(entry["stream_rows"])
                rewards, metric = self.score(entry["rows"], entry["prompt_ids"], completions)
                metric = metric.detach().float().cpu()
                outcomes = group_outcomes(metric, G)
                outcome.generated_groups += 1
                outcome.qualified_groups += outcomes["qualified"]
                outcome.filtered_all_correct += outcomes["all_correct"]
                outcome.filtered_all_wrong += outcomes["all_wrong"]
                outcome.solved_prompts += solve_rate(metric, G)
                tokens = sum(len(c) for c in completions)
                if bool(filter_groups(metric, G)[0]):
                    order = len(finished)
                    finished.append(
                        StreamedGroup(entry["rows"], entry["prompt_ids"], completions, logprobs, rewards, order)
                    )
                else:
                    outcome.filtered_tokens += tokens

        first = self.allowance(missing, 0, 0, self.efficiency(0, 0), budget, cap)
        admit(max(first, 1))
        steps = 0
        while True:
            collect(stream.step())
            steps += 1
            if steps % self.sync_every:
                continue
            kept, flying, scored, qualified, admitted, idle = self.agree(
                [len(finished), len(pending), outcome.generated_groups, outcome.qualified_groups,
                 outcome.admitted_groups, float(stream.idle)]
            )  # fmt: skip
            if kept >= missing:
                outcome.full = True
                break
            efficiency = self.efficiency(qualified, scored)
            grant = self.allowance(missing, kept, flying, efficiency, budget - admitted, cap - flying)
            if grant:
                admit(grant)
            elif idle == self.world and admitted >= budget:
                break  # the budget is spent and every admitted group is scored: a partial batch
            elif idle == self.world and not flying:
                admit(1)  # nothing in flight and the estimate says enough: the estimate was wrong, keep going
        if self.in_flight == "finish":
            while not stream.idle:
                collect(stream.step())
        else:
            outcome.dropped_groups = len(pending)
        stats = stream.close()
        outcome.generated_tokens = stats.generated_tokens
        outcome.busy_slot_steps, outcome.pool_slot_steps = stats.busy_slot_steps, stats.pool_slot_steps
        outcome.kept = finished
        return outcome
