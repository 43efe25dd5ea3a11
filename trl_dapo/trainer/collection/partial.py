"""Partial rollouts in rounds mode (`partial_rollouts=True`): each round (the generation batch's one round without
dynamic sampling, each candidate round with it) runs on the paged engine until the groups it must deliver have ended
(`sampling/partial_round.py`), and what is still in flight is carried, whole, into the next round or batch.

The delivered groups go through TRL's method as rows already generated (`StreamedRows` without rewards), so TRL scores
them as it scores any round: every reward function TRL supports works (reward models and async functions included).
Each row carries its rollout logprobs as sampled (an earlier policy's for a carried row's earlier tokens, the old
policy of the ratio) and, per token, the optimizer step whose weights sampled it (the age metrics).

- `PartialRounds` (`dynamic_sampling=False`): one partial round of the generation batch's groups; the dataloader's
  prompts always enter, the prompt stream's fill the slots beyond them.
- `PartialCandidateRounds` (`dynamic_sampling_mode="rounds"`): each candidate round a partial round of the buffer's
  planned size; the buffer filters and keeps the surplus as it does for any round.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import gather_object

from ...sampling import DynamicSamplingBuffer, GenerationStats, SamplingStats
from ...sampling.carried import CarriedGroups
from ...sampling.partial_round import PartialRound, delivery_order, in_flight_cap
from .collect import CandidateRounds, Collected, Collector, sum_over_ranks
from .engine_choice import (
    EngineWeights,
    check_paged_engine_settings,
    keep_cache_bytes,
    paged_engine_needed,
    token_sampling,
)
from .round import Round, StreamedRows, TRLRounds
from .streamed import padded, prompt_token_ids


def check_partial_rollouts(args, reward_funcs: list, reward_names: Sequence[str], rollout_func, calls_tools) -> None:
    """Partial rollouts need the paged engine to generate (not TRL's path, vLLM or a `rollout_func`), as far as the
    settings tell before any model loads."""
    check_paged_engine_settings(args, rollout_func, calls_tools, "partial_rollouts=True", "partial_rollouts=False")


class PartialRoundRunner:
    """One partial round through TRL's method, with this rank's carried groups (`carried`) between rounds.

    `batch_groups`: the groups of one generation batch (the in-flight cap is counted in those); `tokenize`: TRL's
    `_tokenize_prompts`."""

    def __init__(
        self,
        rounds: TRLRounds,
        engine: EngineWeights | None,
        prompt_stream,
        tokenize: Callable[[list], tuple],
        accelerator,
        args,
        batch_groups: int,
        num_generations: int,
    ) -> None:
        if engine is None:
            raise paged_engine_needed(
                args, "partial_rollouts=True", "on this set-up TRL's path generates, see the log for why",
                "partial_rollouts=False",
            )  # fmt: skip
        self.rounds, self.engine, self.prompt_stream, self.tokenize = rounds, engine, prompt_stream, tokenize
        self.accelerator, self.args = accelerator, args
        self.batch_groups, self.num_generations = batch_groups, num_generations
        self.carried = CarriedGroups(args.partial_rollout_max_age)

    def run(self, first_rows: list[dict[str, Any]], target: int, step: int, trained_as_generated: bool) -> Round:
        """A round delivering `target` groups (every rank's), `first_rows` (one row per prompt, the same on every rank)
        admitted first; the round's global batch and this rank's counts: the engine's, and the carried groups that
        aged out before it."""
        rank, world, G = self.accelerator.process_index, self.accelerator.num_processes, self.num_generations
        young, aged = self.carried.resume(step)
        engine, settings = self.engine.current(step), token_sampling(self.args)
        keep_bytes = keep_cache_bytes(self.args, engine)  # the stream's pool leaves it free for what its end keeps
        order = AdmissionOrder(first_rows, self.prompt_stream)
        driver = PartialRound(
            start=lambda prompt_ids, resumed: engine.stream(prompt_ids, settings, resumed, keep_bytes),
            draw=order.draw,
            tokenize=lambda row: prompt_token_ids(self.tokenize, row),
            agree=functools.partial(sum_over_ranks, self.accelerator),
            num_generations=G,
            world=world,
            rank=rank,
            slots=engine.max_rows,
            step=step,
            keep_cache_bytes=keep_bytes,
        )
        cap = in_flight_cap(self.args.partial_rollout_max_in_flight, self.batch_groups, target)
        outcome = driver.run(target, cap, young, len(first_rows), self.carried.next_serial)
        everyone = gather_object([(rank, outcome.ended)])
        ordered = delivery_order([(seen, owner, group) for owner, ended in everyone for seen, group in ended])
        delivered, rest = ordered[:target], ordered[target:]
        self.carried.carry([group for _, owner, group in rest if owner == rank] + outcome.in_flight)
        self.carried.next_serial = outcome.next_serial
        rows = [(group, sample) for _, _, group in delivered for sample in range(G)]
        share = len(rows) // world
        mine = rows[rank * share : (rank + 1) * share]
        width, device = settings.max_new_tokens, self.accelerator.device
        streamed = StreamedRows(
            prompt_ids=[group.prompt_ids for group, _ in mine],
            completions=[group.tokens[sample] for group, sample in mine],
            logprobs=torch.stack([padded(group.logprobs[sample], width) for group, sample in mine]).to(device),
            rewards=None,
            token_steps=torch.stack([group.token_steps(width)[sample] for group, sample in mine]),
        )
        generated = self.rounds.run([group.rows[sample] for group, sample in mine], trained_as_generated, streamed)
        counts = dataclasses.replace(outcome.generation)
        counts.aged_out_groups, counts.aged_out_tokens = len(aged), sum(sum(map(len, g.tokens)) for g in aged)
        return dataclasses.replace(generated, generation=counts)


class AdmissionOrder:
    """A round's prompts in the order every rank admits them: its first rows (the dataloader's batch), then the prompt
    stream's, drawn by every rank alike so the stream stays at the same position on each."""

    def __init__(self, first_rows: list[dict[str, Any]], prompt_stream) -> None:
        self.first, self.prompt_stream = list(first_rows), prompt_stream

    def draw(self, count: int) -> list[dict[str, Any]]:
        taken, self.first = self.first[:count], self.first[count:]
        return taken + (self.prompt_stream.take(count - len(taken)) if count > len(taken) else [])


class PartialRounds(Collector):
    """`partial_rollouts=True` without dynamic sampling: each generation batch is one partial round delivering its
    groups, trained as delivered."""

    check = staticmethod(check_partial_rollouts)

    def __init__(self, runner: PartialRoundRunner, accelerator, target: int, num_generations: int) -> None:
        self.runner, self.accelerator, self.target, self.num_generations = runner, accelerator, target, num_generations
        self.carried = runner.carried

    def collect(self, inputs: list[dict[str, Any]], step: int) -> Collected:
        prompts = gather_object(inputs)[:: self.num_generations]  # the dataloader batch repeats each prompt G times
        delivered = self.runner.run(prompts, self.target, step, trained_as_generated=True)
        return Collected(delivered.batch, None, self.batch_generation([delivered.generation], self.accelerator))


class PartialCandidateRounds(CandidateRounds):
    """`partial_rollouts=True` with dynamic sampling in rounds: each candidate round is a partial round of the size
    the buffer plans, the dataloader's prompts admitted first in the first."""

    check = staticmethod(check_partial_rollouts)

    def __init__(
        self,
        runner: PartialRoundRunner,
        buffer: DynamicSamplingBuffer,
        prompt_stream,
        accelerator,
        target: int,
        progress: bool,
    ) -> None:
        super().__init__(runner.rounds, buffer, prompt_stream, accelerator, target, progress)
        self.runner = runner
        self.carried = runner.carried

    def _round(self, inputs: list[dict[str, Any]], groups: int, round_index: int, step: int) -> Round:
        prompts = gather_object(inputs)[:: self.buffer.num_generations] if round_index == 0 else []
        return self.runner.run(prompts, groups, step, trained_as_generated=False)

    def _account(self, stats: SamplingStats, generation: GenerationStats) -> None:
        """The batch's generated tokens are the engine's (the candidates' tokens include earlier ones, and tokens of
        groups still in flight are in none); carried groups that aged out were never trained."""
        stats.generated_tokens = generation.generated_tokens
        stats.untrained_tokens += generation.aged_out_tokens
