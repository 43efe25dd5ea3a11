"""Partial rollouts in rounds mode: one round of groups on the paged engine that stops once the groups it must deliver
have ended, and hands every group still in flight to the next round whole (finished samples included).

A round (`PartialRound.run`) resumes this rank's carried groups first, admits the round's first prompts (the
dataloader's batch, for the first round of a generation batch), and keeps admitting while decode slots are free and
fewer groups than the cap are in flight, so the slots stay busy instead of draining into a tail of a few long rows.
Every decision is global and made at an agreement of the ranks (one small all-reduce per engine synchronisation):
how many groups enter (each one the next of an admission order every rank shares, dealt to rank `serial % world`),
and when the round stops (the ended groups of all ranks reach the target). A group's place in the delivery is the
agreement at which its end was seen, then its serial: with rows that do not depend on where they decode (greedy,
nothing waiting for slots), the delivered groups do not depend on the number of ranks. Groups are not scored here: the
caller hands the delivered ones to TRL's method, which scores them as it scores any round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .stats import GenerationStats
from .stream import AgreeSum, CarriedGroup, StreamRun

# The next `count` prompts of the round's admission order (dataset rows), the same on every rank.
DrawPrompts = Callable[[int], list[dict[str, Any]]]


@dataclass
class RoundOutcome:
    """What one rank's round did: the groups that ended, each with the agreement at which its end was seen (groups
    complete on entry: 0), the groups still in flight (to carry), the next serial, and the engine's counts."""

    ended: list[tuple[int, CarriedGroup]] = field(default_factory=list)
    in_flight: list[CarriedGroup] = field(default_factory=list)
    next_serial: int = 0
    generated_tokens: int = 0  # tokens this round's engine call sampled (not those carried rows brought in)
    generation: GenerationStats = field(default_factory=GenerationStats)


class PartialRound:
    """Drives one rank's `RolloutStream` for one round of partial rollouts (see the module docstring).

    `start(prompt_ids, resumed)` opens the engine's stream; `draw(count)` gives the next prompts of the admission
    order; `tokenize(row)` a prompt's ids; `agree` sums counts over ranks; `slots`: each rank's decode slots; `step`:
    the optimizer step whose weights generate; `keep_cache_bytes`: the KV of the rows carried on that the engine
    keeps for the next round, at most (0: none, they are prefilled again)."""

    def __init__(
        self,
        start: Callable[[list[list[int]], Any], Any],
        draw: DrawPrompts,
        tokenize: Callable[[dict[str, Any]], list[int]],
        agree: AgreeSum,
        num_generations: int,
        world: int,
        rank: int,
        slots: int,
        step: int,
        keep_cache_bytes: int = 0,
    ) -> None:
        self.start, self.draw, self.tokenize, self.agree = start, draw, tokenize, agree
        self.num_generations, self.world, self.rank, self.slots, self.step = num_generations, world, rank, slots, step
        self.fill_rows, self.keep_cache_bytes = slots, keep_cache_bytes  # what `StreamRun` reads

    def run(
        self, target: int, max_in_flight: int, carried: list[CarriedGroup], first: int, next_serial: int
    ) -> RoundOutcome:
        """Until the ended groups of all ranks reach `target`: this rank's `carried` groups enter first, the round's
        `first` prompts at the first admission, then more while fewer than `max_in_flight` groups (over all ranks,
        carried ones included) are in flight and the slots of all ranks have room; `next_serial`: the admission order's
        next serial (the same on every rank)."""
        run = StreamRun(self, score=None, step=self.step)
        run.enter(carried)
        serial, must = next_serial, first
        while True:
            ended, flying, flying_rows = self.agree([len(run.outcome.ended), len(run.pending), run.flying_rows()])
            if ended >= target:
                break
            needed = target - ended - flying  # every group in flight ends, none is filtered here
            room = min(max_in_flight - flying, (self.world * self.slots - flying_rows) // self.num_generations)
            count = int(max(needed, room, must, 0))
            must = 0
            if count:
                drawn = self.draw(count)
                own = [(row, serial + i) for i, row in enumerate(drawn) if (serial + i) % self.world == self.rank]
                run.enter([CarriedGroup.fresh(row, self.tokenize(row), self.num_generations, s) for row, s in own])
                serial += count
            run.collect(run.step())
            run.agreements += 1
        in_flight = run.in_flight()  # read from the stream before it closes
        outcome = run.close()
        return RoundOutcome(
            ended=outcome.ended,
            in_flight=in_flight,
            next_serial=serial,
            generated_tokens=outcome.stats.generated_tokens,
            generation=outcome.generation,
        )


def delivery_order(ended: list[tuple[int, int, CarriedGroup]]) -> list[tuple[int, int, CarriedGroup]]:
    """Every rank's ended groups, `(agreement, rank, group)`, in the order they are delivered: by the agreement at
    which each end was seen, then by serial (the same order on any number of ranks)."""
    return sorted(ended, key=lambda item: (item[0], item[2].serial))


def in_flight_cap(max_in_flight: float, batch_groups: int, target: int) -> int:
    """Groups a round may hold in flight: `max_in_flight` generation batches' worth, and at least the round's
    target (a candidate round may be larger than a batch)."""
    return max(math.ceil(max_in_flight * batch_groups), target)
