"""Partial rollouts' state across rounds and generation batches: this rank's carried groups.

A group still in flight when a round (rounds mode) or a stream (stream mode) stops is carried whole, finished samples
included, each sample with its tokens so far, their logprobs (the policy that sampled each) and which optimizer
step's weights sampled each stretch of them; the next round or stream resumes it first. Rounds mode also carries the
groups that ended beyond what a round delivered, and the admission order's next serial (the same on every rank).
Carried groups are each rank's own (its engine holds their rows); checkpoints gather every rank's
(`state_dict`) and give each rank its own back (`load_state_dict`), dealt anew on another number of ranks.
"""

from __future__ import annotations

import logging
from typing import Any

from .stats import GenerationStats
from .stream import CarriedGroup

logger = logging.getLogger(__name__)


class CarriedGroups:
    """This rank's carried groups (in the order they resume) and the admission order's next serial. `max_age`:
    optimizer steps a group may age (since it was first admitted) before it is dropped, untrained; None: never."""

    def __init__(self, max_age: int | None) -> None:
        self.max_age = max_age
        self.groups: list[CarriedGroup] = []
        self.next_serial = 0

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def resume(self, step: int) -> tuple[list[CarriedGroup], list[CarriedGroup]]:
        """`(young, aged)`: the groups to resume at optimizer step `step`, and those too old to (dropped); empties
        the state, which the caller refills with what it carries on (`carry`)."""
        young, aged = [], []
        for group in self.groups:
            too_old = self.max_age is not None and group.birth >= 0 and step - group.birth > self.max_age
            if too_old:  # its kept KV is freed now: the cache it shares with the other kept rows outlives none of them
                group.kept = None
            (aged if too_old else young).append(group)
        self.groups = []
        return young, aged

    def carry(self, groups: list[CarriedGroup]) -> None:
        """Groups for the next round or stream, after any already held."""
        self.groups = [*self.groups, *groups]

    def generation_counts(self) -> GenerationStats:
        """The groups held, their rows still to decode and every token they hold, as counts."""
        groups = self.groups
        return GenerationStats(
            carried_groups=len(groups),
            carried_rows=sum(group.unfinished_rows() for group in groups),
            carried_tokens=sum(sum(map(len, group.tokens)) for group in groups),
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, loadable with `torch.load(weights_only=True)`."""
        return {"groups": [group.state_dict() for group in self.groups], "next_serial": self.next_serial}

    def load_state_dict(self, states: list[dict[str, Any]], rank: int, world: int) -> None:
        """Every rank's saved state (in rank order): this rank's own groups back, or, saved on another number of
        ranks, every group dealt anew (the `rank`-th of every `world`), which a log line says."""
        self.next_serial = states[0]["next_serial"]
        if len(states) == world:
            self.groups = [CarriedGroup.from_state(state) for state in states[rank]["groups"]]
            return
        every = [group for state in states for group in state["groups"]]
        self.groups = [CarriedGroup.from_state(state) for state in every[rank::world]]
        if rank == 0:
            logger.info(
                "partial rollouts: the checkpoint's %d carried groups were saved on %d processes and are dealt anew to "
                "%d (each process resumes every %d-th, in the saved order).",
                len(every),
                len(states),
                world,
                world,
            )
