"""Streaming dynamic sampling: one generation call per generation batch that scores each prompt group as soon as its
last row ends, keeps or drops it at once, and refills the freed decode slots with new prompts until the kept groups
cover the batch.

Rounds (`buffer.py`) wait for a round's longest row before scoring, and each extra round pays that tail again; here
the device keeps decoding while the host scores. Admission follows the deficit: new groups enter while the kept
groups plus the expected yield of the groups in flight (running sampling efficiency x groups in flight) fall short.
When rows in flight at the end are carried into the next batch (`in_flight="carry"`), a row admitted beyond the
deficit is not waste, so admission also fills every free decode slot while groups are missing (`fill_rows`), within
the cap on groups in flight (carried ones included): a group holds its slots until its longest sample ends, and
without filling the slots of its shorter samples stay idle. Each carried sample records which optimizer step's weights
sampled each stretch of its tokens (`CarriedGroup.segments`).

Across ranks each one streams its own prompts (its share of the dataloader batch, then every `world`-th prompt of
the extra-prompt stream) and they agree every `sync_every` engine synchronisations, with one small all-reduce, on the
global counts: when to admit more, when the batch is full, and whether a rank's scoring failed (a flag per rank among
the counts, so every rank stops at that agreement instead of waiting in the next). Every decision reads only those
counts and the rank's own rows in flight at a synchronisation (a function of its sampled tokens), so the kept groups
are a function of the seed and the number of ranks, never of timing. `StreamRun` (one run on one rank: its groups
in flight, the ones that ended, the engine's stream) is shared with rounds mode's partial rollouts
(`partial_round.py`). Nothing here imports the trainer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .filters import GroupFilter
from .stats import GenerationStats, SamplingStats

if TYPE_CHECKING:
    from ..rollout.kept import KeptRow

IN_FLIGHT_POLICIES = ("finish", "drop", "carry")
# Floor on the efficiency the admission divides by, so a run of filtered groups cannot ask for unbounded prompts.
MIN_EFFICIENCY = 1.0 / 16

# Draw the rank's next prompt: (its dataset row, its prompt token ids).
NextPrompt = Callable[[], tuple[dict[str, Any], list[int]]]
# Score one finished group on the host: (rows, prompt ids, completions) -> (rewards (G, functions), filter metric (G,)).
ScoreGroup = Callable[[list[dict[str, Any]], list[int], list[list[int]]], tuple[torch.Tensor, torch.Tensor]]
# Sum a list of numbers over ranks (identity on one rank).
AgreeSum = Callable[[list[float]], list[float]]


# Per sample of a group: `(optimizer step, first token)` of each stretch of its tokens sampled under that step's
# weights, in order (a carried sample gains one each time it resumes under newer weights).
Segments = list[list[tuple[int, int]]]


@dataclass
class StreamedGroup:
    """A kept group: its rows, completions, rollout logprobs (G, max_new_tokens) and host-side rewards."""

    rows: list[dict[str, Any]]
    prompt_ids: list[int]
    completions: list[list[int]]
    logprobs: torch.Tensor
    rewards: torch.Tensor
    order: int  # finish order on this rank
    earlier_tokens: int = 0  # tokens sampled before this generation batch (a carried group's)
    segments: Segments = field(default_factory=list)  # which optimizer step's weights sampled each token

    @property
    def fresh_tokens(self) -> int:
        """Tokens generated for this generation batch."""
        return sum(len(completion) for completion in self.completions) - self.earlier_tokens

    def token_steps(self, width: int) -> torch.Tensor:
        """(G, width): the optimizer step whose weights sampled each token (`sampling_steps`)."""
        return sampling_steps(self.segments, width)


@dataclass
class CarriedGroup:
    """A group entering a stream: fresh (no tokens yet) or carried from an earlier round or generation batch (partial
    rollouts), with each sample's tokens so far, their logprobs (the policy that sampled each), and which ended."""

    rows: list[dict[str, Any]]
    prompt_ids: list[int]
    tokens: list[list[int]]
    logprobs: torch.Tensor  # (G, max_new_tokens) on the host; (G, 0) for a fresh group
    ended: list[bool]
    earlier_tokens: int = 0  # tokens sampled by earlier calls (counted where they were generated)
    birth: int = -1  # the optimizer step of the generation batch that first admitted it (set when it first enters)
    segments: Segments = field(default_factory=list)  # empty until it first enters a stream
    serial: int = -1  # rounds mode: its place in the admission order every rank agrees on (-1: stream mode)
    # per sample, the KV the engine kept for it when it was carried (`rollout/kept.py`), or None: prefilled on resume;
    # never saved with checkpoints
    kept: list[KeptRow | None] | None = None

    @classmethod
    def fresh(cls, row: dict[str, Any], prompt_ids: list[int], num_generations: int, serial: int = -1) -> CarriedGroup:
        return cls([row] * num_generations, prompt_ids, [[] for _ in range(num_generations)],
                   torch.zeros(num_generations, 0), [False] * num_generations, serial=serial)  # fmt: skip

    def entered(self, step: int) -> CarriedGroup:
        """The group as it enters a stream generating with the weights of optimizer step `step`: born now if new, and
        each sample still to decode starting a segment of that step at its next token."""
        segments = [list(sample) for sample in self.segments] or [[] for _ in self.tokens]
        for sample, stretches in enumerate(segments):
            start = len(self.tokens[sample])
            if self.ended[sample] or (stretches and stretches[-1][0] == step):
                continue
            if stretches and stretches[-1][1] == start:  # resumed before without a token: that stretch is empty
                stretches.pop()
            stretches.append((step, start))
        return dataclasses.replace(self, segments=segments, birth=step if self.birth < 0 else self.birth)

    def unfinished_rows(self) -> int:
        return sum(not ended for ended in self.ended)

    def token_steps(self, width: int) -> torch.Tensor:
        """(G, width): the optimizer step whose weights sampled each token (`sampling_steps`)."""
        return sampling_steps(self.segments, width)

    def state_dict(self) -> dict[str, Any]:
        """The group as values `torch.load(weights_only=True)` reads back; a dataset column holding anything else
        is an error naming it."""
        for column, value in self.rows[0].items():
            if not _loadable(value):
                raise TypeError(
                    f"partial rollouts: the carried group of prompt {_shown(self.rows[0])} holds dataset column "
                    f"{column!r} of type {type(value).__name__}, which a checkpoint cannot store safely (it is read "
                    "with weights_only=True): give the training set plain columns (numbers, strings, lists, dicts), "
                    "or save no checkpoint while partial_rollouts=True."
                )
        longest = max(map(len, self.tokens), default=0)
        return {
            "row": dict(self.rows[0]),
            "prompt_ids": list(self.prompt_ids),
            "tokens": [list(tokens) for tokens in self.tokens],
            "logprobs": self.logprobs[:, :longest].float().clone(),
            "ended": list(self.ended),
            "earlier_tokens": self.earlier_tokens,
            "birth": self.birth,
            "segments": [[list(stretch) for stretch in sample] for sample in self.segments],
            "serial": self.serial,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> CarriedGroup:
        segments = [[tuple(stretch) for stretch in sample] for sample in state["segments"]]
        rows = [state["row"]] * len(state["tokens"])
        return cls(rows, state["prompt_ids"], state["tokens"], state["logprobs"], state["ended"],
                   state["earlier_tokens"], state["birth"], segments, state["serial"])  # fmt: skip


def sampling_steps(segments: Segments, width: int) -> torch.Tensor:
    """(samples, width): per token position, the optimizer step whose weights sampled it, from each sample's segments
    (positions past a sample's tokens take its last segment's step)."""
    steps = torch.zeros(len(segments), width, dtype=torch.long)
    for sample, stretches in enumerate(segments):
        for step, start in stretches:
            steps[sample, min(start, width) :] = step
    return steps


def _loadable(value: object) -> bool:
    """What `torch.load(weights_only=True)` reads back: None, numbers, strings, and lists, tuples and dicts of them."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(map(_loadable, value))
    if isinstance(value, dict):
        return all(isinstance(key, str) and _loadable(item) for key, item in value.items())
    return False


@dataclass
class StreamOutcome:
    """What one rank's stream did: its kept groups in finish order, its counts (groups scored, tokens generated and
    filtered; the engine's), and what the stream alone has."""

    kept: list[StreamedGroup] = field(default_factory=list)
    stats: SamplingStats = field(default_factory=SamplingStats)
    generation: GenerationStats = field(default_factory=GenerationStats)
    admitted_groups: int = 0
    dropped_groups: int = 0  # in flight when the batch was full, dropped unscored (policy "drop")
    carried: list[CarriedGroup] = field(default_factory=list)  # in flight when the batch was full (policy "carry")
    carried_tokens: int = 0  # of the carried groups' tokens, those generated by this call
    full: bool = False  # the kept groups of all ranks covered the batch
    # groups ended unscored, each with the agreement at which its end was seen (a driver that does not score)
    ended: list[tuple[int, CarriedGroup]] = field(default_factory=list)


class GroupStream:
    """Drives one rank's `RolloutStream` for a generation batch (see the module docstring)."""

    def __init__(
        self,
        start: Callable[[list[list[int]], Any], Any],
        next_prompt: NextPrompt,
        score: ScoreGroup,
        agree: AgreeSum,
        num_generations: int,
        world: int,
        rank: int,
        keep_groups: GroupFilter,
        sync_every: int = 1,
        in_flight: str = "finish",
        prior: tuple[float, float] = (0.0, 0.0),
        fill_rows: int = 0,
        step: int = 0,
        keep_cache_bytes: int = 0,
    ) -> None:
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight={in_flight!r}: use one of {IN_FLIGHT_POLICIES}.")
        if fill_rows and in_flight != "carry":
            raise ValueError(
                f"fill_rows={fill_rows} with in_flight={in_flight!r}: filling the slots beyond the deficit leaves rows "
                "in flight at the end, which only 'carry' keeps; use in_flight='carry' or fill_rows=0."
            )
        self.rank, self.keep_groups = rank, keep_groups
        self.fill_rows = fill_rows  # the rank's decode slots to keep busy while groups are missing (0: deficit only)
        self.start, self.next_prompt, self.score, self.agree = start, next_prompt, score, agree
        self.num_generations, self.world, self.sync_every, self.in_flight = (
            num_generations,
            world,
            sync_every,
            in_flight,
        )
        self.prior_qualified, self.prior_generated = prior
        self.step = step  # the optimizer step whose weights the engine generates with (each token's sampler)
        self.keep_cache_bytes = keep_cache_bytes  # "carry": the carried rows' KV kept within this budget (0: none)

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

    def run(
        self,
        missing: int,
        budget: int,
        max_in_flight: int | None = None,
        carried: list[CarriedGroup] | None = None,
    ) -> StreamOutcome:
        """Stream until the kept groups of all ranks reach `missing` or `budget` groups (over all ranks) were admitted
        and scored, with at most about `max_in_flight` groups (over all ranks) admitted and not yet scored (carried
        ones included), and with `fill_rows`, as many as the slots hold within that cap. `carried`: this rank's
        groups left in flight by the previous batch (policy "carry"), resumed first; one whose samples had all ended
        is scored as it enters."""
        cap = math.inf if max_in_flight is None else max_in_flight
        run = StreamRun(self, self.score, self.step)
        if carried:
            run.enter(list(carried))
        pending = len(run.pending)
        first = self.allowance(missing, len(run.kept), pending, self.efficiency(0, 0), budget, cap - pending)
        own_room = math.floor(cap / self.world) - pending if cap != math.inf else math.inf
        if len(run.kept) < missing:  # fill the free slots, unless the groups kept on entry already cover the batch
            first = max(first, min(run.free_groups(budget, own_room), math.floor(budget / self.world) - pending))
        run.admit(first)
        steps = 0
        while True:
            run.collect(run.step())
            steps += 1
            if steps % self.sync_every == 0 and self._agree_and_admit(run, missing, budget, cap):
                break
        self._stop(run)
        return run.close()

    def _agree_and_admit(self, run: StreamRun, missing: int, budget: int, cap: float) -> bool:
        """One agreement of the ranks on their counts: whether the stream is done (the batch is full, or the budget
        is spent and every admitted group scored), else the groups this rank admits now."""
        agreed = self.agree(run.counts() + self._failure_flags(run.failures))
        kept, flying, scored, qualified, admitted, idle = agreed[:6]
        self._stop_if_any_failed(agreed[6:], run.failures, run.stream)
        if kept >= missing:
            run.outcome.full = True
            return True
        efficiency = self.efficiency(qualified, scored)
        grant = self.allowance(missing, kept, flying, efficiency, budget - admitted, cap - flying)
        room = math.floor((cap - flying) / self.world) if cap != math.inf else math.inf
        grant = max(grant, run.free_groups(budget - admitted, room))
        if grant:
            run.admit(grant)
        elif idle == self.world and admitted >= budget:
            return True  # the budget is spent and every admitted group is scored: a partial batch
        elif idle == self.world and not flying:
            run.admit(1)  # nothing in flight and the estimate says enough: the estimate was wrong, keep going
        return False

    def _stop(self, run: StreamRun) -> None:
        """The rows in flight once the stream is done, as `in_flight` says: decoded to their end and scored
        ("finish", every rank agreeing once more on failures), left as they are ("carry"), or dropped."""
        if self.in_flight == "finish":
            while run.stream is not None and not run.stream.idle and not run.failures:
                run.collect(run.step())
            self._stop_if_any_failed(self.agree(self._failure_flags(run.failures)), run.failures, run.stream)
        elif self.in_flight == "carry":
            run.outcome.carried = run.in_flight()
        else:
            run.outcome.dropped_groups = len(run.pending)

    def _failure_flags(self, failures: list[Exception]) -> list[float]:
        """One flag per rank, set at this rank's place if its scoring failed: summed over ranks, who failed."""
        return [float(bool(failures) and rank == self.rank) for rank in range(self.world)]

    def _stop_if_any_failed(self, flags: list[float], failures: list[Exception], stream) -> None:
        """Every rank stops together once any rank's scoring failed (the others would wait in the next agreement):
        the failing rank raises its error, which names the group, the others say which rank failed."""
        failed = [rank for rank, flag in enumerate(flags) if flag]
        if not failed:
            return
        if stream is not None:
            stream.close()
        if failures:
            raise failures[0]
        raise RuntimeError(
            f"stream mode: rank {', '.join(map(str, failed))} failed scoring a group (its error is raised there); "
            "every rank stops."
        )


def _shown(row: dict[str, Any], limit: int = 200) -> str:
    """A group's prompt for an error message, cut to `limit` characters."""
    text = repr(row.get("prompt"))
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class _PendingGroup:
    """A group admitted to this stream and not yet ended: what it entered with (`group`), the stream row of each
    sample it decodes, the samples that ended since, and how many still decode."""

    group: CarriedGroup
    stream_rows: dict[int, int] = field(default_factory=dict)  # sample -> stream row
    ended: set[int] = field(default_factory=set)
    left: int = 0

    def merged(self, stream) -> CarriedGroup:
        """The group's samples as they stand: the ones it entered with, updated from the stream's rows (tokens so
        far, their logprobs, whether each ended); `earlier_tokens` is then every token it holds."""
        group = self.group
        samples = sorted(self.stream_rows)
        if not samples:  # every sample had ended before it entered
            return dataclasses.replace(group, earlier_tokens=sum(map(len, group.tokens)))
        new_tokens, new_logprobs = stream.outputs([self.stream_rows[i] for i in samples])
        new_logprobs = new_logprobs.cpu()
        logprobs = torch.zeros(len(group.tokens), new_logprobs.size(1))
        logprobs[:, : group.logprobs.size(1)] = group.logprobs
        tokens, ended = list(group.tokens), list(group.ended)
        for index, sample in enumerate(samples):
            tokens[sample], logprobs[sample] = new_tokens[index], new_logprobs[index]
            ended[sample] = sample in self.ended
        return dataclasses.replace(
            group, tokens=tokens, logprobs=logprobs, ended=ended, earlier_tokens=sum(map(len, tokens))
        )


class StreamRun:
    """One run of a driver (`GroupStream`, or rounds mode's `PartialRound`) on this rank: the engine's stream it
    drives (started by the first rows it enters), the groups in flight, and what became of those that ended: scored
    and kept (`kept`) when the driver has a `score`, else kept unscored with the agreement at which their end was
    seen (`outcome.ended`); and this rank's scoring error (every rank stops at the next agreement)."""

    def __init__(self, driver, score: ScoreGroup | None, step: int) -> None:
        self.driver, self.score, self.step_weights, self.outcome = driver, score, step, StreamOutcome()
        self.stream = None
        self.pending: dict[int, _PendingGroup] = {}  # by admission index
        self.row_group: dict[int, tuple[int, int]] = {}  # stream row -> (admission index, sample)
        self.kept: list[StreamedGroup] = []
        self.failures: list[Exception] = []
        self.resumed_tokens = 0  # tokens of carried rows sampled before this call (the stream counts them again)
        self.agreements = 0  # agreements so far (the driver counts them): when an unscored group's end was seen

    def counts(self) -> list[float]:
        """What the ranks agree on: kept and in-flight groups, groups scored and qualified, admitted, idle."""
        stats = self.outcome.stats
        return [len(self.kept), len(self.pending), stats.generated_groups, stats.qualified_groups,
                self.outcome.admitted_groups, float(self.idle)]  # fmt: skip

    @property
    def idle(self) -> bool:
        """No row of this rank waits or decodes."""
        return self.stream is None or self.stream.idle

    def flying_rows(self) -> int:
        return sum(pending.left for pending in self.pending.values())

    def enter(self, groups: list[CarriedGroup]) -> None:
        """Queue groups: rows still to decode (resumed after their tokens so far), samples already ended kept; a group
        whose samples have all ended is complete at once."""
        prompts, resumed, owners, complete, kept = [], [], [], [], []
        for group in groups:
            # the group hands its kept KV to the stream, which copies it into its pool: freed once adopted
            kept_rows, group.kept = group.kept or [None] * len(group.tokens), None
            group = group.entered(self.step_weights)
            index, pending = self.outcome.admitted_groups, _PendingGroup(group)
            self.pending[index] = pending
            for sample in range(self.driver.num_generations):
                if not group.ended[sample]:
                    prompts.append(group.prompt_ids)
                    resumed.append((group.tokens[sample], group.logprobs[sample]))
                    owners.append((index, sample))
                    kept.append(kept_rows[sample])
                    pending.left += 1
                    self.resumed_tokens += len(group.tokens[sample])
            if not pending.left:
                complete.append(index)
            self.outcome.admitted_groups += 1
        if prompts and self.stream is None:
            self.stream = self.driver.start(prompts, resumed)
            rows = list(range(len(prompts)))
        else:
            rows = self.stream.add(prompts, resumed) if prompts else []
        for row, (index, sample) in zip(rows, owners, strict=True):
            self.pending[index].stream_rows[sample] = row
            self.row_group[row] = (index, sample)
        adopted = [(row, keep) for row, keep in zip(rows, kept, strict=True) if keep is not None]
        if adopted:
            self.stream.adopt(*map(list, zip(*adopted, strict=True)))
        self._complete(complete)

    def admit(self, count: int) -> None:
        """`count` new groups from the rank's next prompts."""
        if count > 0:
            drawn = [self.driver.next_prompt() for _ in range(count)]
            self.enter([CarriedGroup.fresh(row, ids, self.driver.num_generations) for row, ids in drawn])

    def free_groups(self, budget_left: float, room: float) -> int:
        """Whole groups that fit the rank's free slots (`fill_rows` minus its rows in flight), within its share of
        the admission budget and its share of the `room` left under the cap on groups in flight."""
        free = (self.driver.fill_rows - self.flying_rows()) // self.driver.num_generations
        return max(0, min(free, math.floor(budget_left / self.driver.world), room))

    def step(self) -> list[int]:
        """One step of the engine's stream: the stream rows that ended (none without a stream)."""
        return [] if self.stream is None else self.stream.step()

    def collect(self, ended: list[int]) -> None:
        """Note the stream rows that ended; complete each group whose last row ended (nothing after a failure)."""
        if self.failures:
            return
        done = []
        for row in ended:
            index, sample = self.row_group.pop(row)
            pending = self.pending[index]
            pending.ended.add(sample)
            pending.left -= 1
            if pending.left == 0:
                done.append(index)
        self._complete(done)

    def _complete(self, indices: list[int]) -> None:
        """Groups whose every sample ended: scored and kept or filtered, or kept unscored without a `score`."""
        for index in indices:
            pending = self.pending.pop(index)
            if self.score is None:
                self.outcome.ended.append((self.agreements, pending.merged(self.stream)))
            elif not self._score(pending):
                return

    def _score(self, pending: _PendingGroup) -> bool:
        """Score a finished group and keep or filter it; False once the scoring failed (the error is kept)."""
        group, G = pending.merged(self.stream), self.driver.num_generations
        try:
            rewards, metric = self.score(group.rows, group.prompt_ids, group.tokens)
        except Exception as error:
            error.add_note(
                f"stream mode: raised on rank {self.driver.rank} scoring the group of prompt {_shown(group.rows[0])}"
            )
            self.failures.append(error)
            return False
        metric, earlier = metric.detach().float().cpu(), pending.group.earlier_tokens
        if bool(self.outcome.stats.count_groups(metric, G, self.driver.keep_groups)[0]):
            self.kept.append(
                StreamedGroup(group.rows, group.prompt_ids, group.tokens, group.logprobs, rewards, len(self.kept),
                              earlier, group.segments)
            )  # fmt: skip
        else:
            self.outcome.stats.filtered_tokens += sum(len(t) for t in group.tokens) - earlier
        return True

    def in_flight(self) -> list[CarriedGroup]:
        """The groups still in flight as they stand, to be carried; with the driver's `keep_cache_bytes`, each with
        the KV of those of its rows still decoding that fit that budget, kept for the next stream to continue from."""
        groups = [pending.merged(self.stream) for pending in self.pending.values()]
        if not self.driver.keep_cache_bytes or self.stream is None:
            return groups
        owned = [(group, pending.stream_rows) for group, pending in zip(groups, self.pending.values(), strict=True)]
        kept = self.stream.keep([row for _, rows in owned for row in rows.values()], self.driver.keep_cache_bytes)
        return [
            dataclasses.replace(group, kept=[kept.get(rows[sample]) if sample in rows else None
                                             for sample in range(len(group.tokens))])
            for group, rows in owned
        ]  # fmt: skip

    def close(self) -> StreamOutcome:
        """The outcome with the engine's counts: tokens generated by this call, slot-steps, prefilled tokens."""
        outcome = self.outcome
        if self.stream is not None:
            engine = self.stream.close()
            outcome.stats.generated_tokens = engine.generated_tokens - self.resumed_tokens
            outcome.generation = GenerationStats.from_engine(engine)
        outcome.carried_tokens = sum(group.earlier_tokens for group in outcome.carried) - sum(
            pending.group.earlier_tokens for pending in self.pending.values()
        )
        outcome.kept = self.kept
        return outcome
