"""Streaming dynamic sampling on the paged engine (CPU): groups are scored as they end and slots refilled, and with
pinned lengths and a reward fixed by the prompt the kept groups are exactly the ones predicted from the prompt order."""

import itertools
from types import SimpleNamespace

import pytest
import torch

from helpers import ScriptedStream, arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.sampling import DynamicSamplingLimitError, filter_groups
from trl_dapo.sampling.stream import GroupStream
from trl_dapo.tiny_model import build_tiny_tokenizer
from trl_dapo.trainer.collection.scoring import FilterMetric, GroupScorer

PROMPTS = 40
TARGET_GROUPS = 4  # per_device_train_batch_size 8 x gradient_accumulation_steps 2 / num_generations 4


def reward_by_prompt(completion_ids, index, **kwargs) -> list[float]:
    """Informative (0, 1, 0, 1 within the group) for prompts with index % 3 == 1, constant for the others. Every call
    holds whole groups, in order, in both modes."""
    return [float(j % 2) if i % 3 == 1 else float(i % 3 == 0) for j, i in enumerate(index)]


class RecordingTrainer(DAPOTrainer):
    """Keeps the dataloader's batch, the accepted batch and the groups carried in flight of each generation batch."""

    def _collect_generation_batch(self, inputs):
        batch = super()._collect_generation_batch(inputs)
        if self.model.training:
            batch_copy = {k: v.clone() for k, v in batch.items()}
            carried = list(self.collector.state.carried) if self.args.dynamic_sampling_mode == "stream" else []
            self.record.append(([row["index"] for row in inputs], batch_copy, carried))
            buffer = self.sampling_buffer
            born_now = (buffer.surplus_birth == self.state.global_step).repeat_interleave(self.num_generations)
            self.surplus_tokens.append(
                0 if buffer.surplus is None else int(buffer.surplus["completion_mask"][born_now].sum())
            )
        return batch


def stream_trainer(tiny_model, tmp_path, **overrides) -> RecordingTrainer:
    args = dict(
        per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=1, learning_rate=0.01,
        rollout_engine="paged", dynamic_sampling_mode="stream", rollout_max_rows=16,
        generation_kwargs={"min_new_tokens": 8},  # pinned lengths: groups end in the order they were admitted
    )  # fmt: skip
    reward, extra = overrides.pop("reward_funcs", reward_by_prompt), {}
    if "processing_class" in overrides:
        extra["processing_class"] = overrides.pop("processing_class")
    args.update(overrides)
    trainer = RecordingTrainer(
        model=tiny_model, reward_funcs=reward, args=dapo_args(tmp_path, **args),
        train_dataset=arithmetic_prompts(PROMPTS), **extra,
    )  # fmt: skip
    trainer.record, trainer.surplus_tokens = [], []
    return trainer


def prompt_indices(trainer, batch) -> list[int]:
    """The dataset index of each accepted group, from its prompt tokens."""
    dataset = trainer.train_dataset
    ids = trainer._tokenize_prompts([row["prompt"] for row in dataset])[0]
    by_ids = {tuple(p): row["index"] for p, row in zip(ids, dataset, strict=True)}
    rows = [tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    return [by_ids[row] for row in rows[::4]]


def test_stream_keeps_the_first_informative_groups_in_prompt_order(tiny_model, tmp_path):
    """The real trainer and engine, 16 slots (4 groups), pinned lengths shorter than one engine synchronisation, so
    every admitted group ends at the next one, in admission order. Draw order here: 4, 16, 21, 5 (the dataloader's),
    then 5, 36, 12, 17, 11, 18, 13, 30, 23, 34, ... (the extra stream). 4 and 16 qualify (efficiency 1/2, 2 missing:
    4 groups admitted), none of 5, 36, 12, 17 (efficiency 2/8: 8 admitted, 4 wait for slots), 13 of 11, 18, 13, 30
    (1 missing, 4 in flight at 3/12: none admitted), then 34: 16 groups generated, the slots always full."""
    trainer = stream_trainer(tiny_model, tmp_path)
    trainer.train()
    ((dataloader, batch, _),) = trainer.record
    # prompts are drawn from the dataloader's batch, then from the extra stream (seed + 1, first epoch)
    extra = torch.randperm(PROMPTS, generator=torch.Generator().manual_seed(trainer.args.seed + 1)).tolist()
    order = dataloader[::4] + extra
    assert order[:14] == [4, 16, 21, 5, 5, 36, 12, 17, 11, 18, 13, 30, 23, 34]
    informative = [i for i in order if i % 3 == 1]
    assert prompt_indices(trainer, batch) == informative[:TARGET_GROUPS] == [4, 16, 13, 34]
    metrics = next(h for h in trainer.state.log_history if "dapo/generated_groups" in h)
    assert metrics["dapo/generated_groups"] == 16 and metrics["dapo/qualified_groups"] == 4
    assert metrics["dapo/sampling_efficiency"] == 0.25 and metrics["dapo/slot_occupancy"] == 1.0
    assert metrics["dapo/generated_tokens"] == 16 * 4 * 8 and metrics["dapo/untrained_tokens"] == 0
    assert metrics["dapo/surplus_groups"] == 0 and metrics["dapo/partial_batch"] == 0
    # each of the 16 groups' prompts prefilled once (its 4 rows share the pages), nothing preempted or resumed
    ids = trainer._tokenize_prompts([row["prompt"] for row in trainer.train_dataset])[0]
    assert metrics["dapo/prefill_tokens"] == sum(len(ids[i]) for i in order[:16])


def test_rounds_count_the_prompts_the_engine_prefilled(tiny_model, tmp_path):
    """Rounds mode draws the same prompts in the same order (the dataloader's, then the extra stream) and logs the
    same engine counts: each generated group's prompt prefilled once."""
    trainer = stream_trainer(tiny_model, tmp_path, dynamic_sampling_mode="rounds")
    trainer.train()
    ((dataloader, _, _),) = trainer.record
    extra = torch.randperm(PROMPTS, generator=torch.Generator().manual_seed(trainer.args.seed + 1)).tolist()
    metrics = next(h for h in trainer.state.log_history if "dapo/generated_groups" in h)
    generated = int(metrics["dapo/generated_groups"])
    assert metrics["dapo/gen_batches"] > 1 and generated > TARGET_GROUPS
    ids = trainer._tokenize_prompts([row["prompt"] for row in trainer.train_dataset])[0]
    drawn = (dataloader[::4] + extra)[:generated]
    assert metrics["dapo/prefill_tokens"] == sum(len(ids[i]) for i in drawn)
    assert 0 < metrics["dapo/slot_occupancy"] <= 1


@pytest.mark.parametrize("policy", ["finish", "drop"])
def test_the_stream_admits_on_the_expected_yield_and_finishes_or_drops_what_is_in_flight(policy):
    """Groups of 2 rows, 4 slots, 2 groups missing. Prompts (length, informative): g0 (2, yes), g1 (6, no), g2 (3,
    yes), g3 (5, yes). At the start the efficiency is 1: g0 and g1 are admitted (2 expected to qualify). g0 ends at
    step 2 (1 kept, 1 in flight at efficiency 1: nothing admitted, two slots idle); g1 ends at step 6, filtered:
    efficiency 1/2, deficit 1, so 1 / (1/2) = 2 groups admitted, g2 and g3. g2 ends at step 9: 2 kept, the batch is
    full with g3 three tokens into its five. `finish` decodes g3 to its end (steps 10 and 11) and keeps it (surplus);
    `drop` leaves it, six tokens generated for nothing."""
    script = iter([(2, True), (6, False), (3, True), (5, True), (1, True)])
    streams = []

    def start(prompts, resumed):
        streams.append(ScriptedStream(prompts, slots=4, resumed=resumed))
        return streams[0]

    def next_prompt():
        length, informative = next(script)
        return {"informative": informative}, [length]

    def score(rows, prompt_ids, completions):
        metric = torch.tensor([0.0, 1.0] if rows[0]["informative"] else [1.0, 1.0])
        return metric.unsqueeze(1), metric

    stream = GroupStream(start, next_prompt, score, agree=lambda values: values, num_generations=2, world=1, rank=0,
                         keep_groups=filter_groups, in_flight=policy)  # fmt: skip
    outcome = stream.run(missing=2, budget=100)
    assert outcome.full and outcome.admitted_groups == 4
    assert [group.prompt_ids for group in outcome.kept] == ([[2], [3], [5]] if policy == "finish" else [[2], [3]])
    assert outcome.stats.generated_groups == (4 if policy == "finish" else 3)
    assert (outcome.stats.qualified_groups, outcome.stats.filtered_all_correct, outcome.stats.filtered_tokens) == (
        outcome.stats.generated_groups - 1,
        1,
        12,
    )
    assert outcome.dropped_groups == (0 if policy == "finish" else 1)
    # tokens: g0 2 x 2, g1 6 x 2, g2 3 x 2, g3 5 x 2 (finished) or 3 x 2 (dropped)
    assert outcome.stats.generated_tokens == (32 if policy == "finish" else 28)
    # busy rows per step: 4, 4, then 2 for steps 3-6, 4 for steps 7-9, 2 for the finishing steps 10-11
    assert (outcome.generation.busy_slot_steps, outcome.generation.pool_slot_steps) == (
        (32, 44) if policy == "finish" else (28, 36)
    )


def test_carried_groups_resume_in_the_next_stream_where_they_stopped():
    """The same script with `carry`: g3 stops three tokens into its five when the batch fills and is handed back with
    those tokens; the next stream (1 group missing) resumes it first, expects it to qualify (efficiency 1: nothing
    else admitted), decodes its last two tokens and keeps it. Each call counts only the tokens it generated."""
    script = iter([(2, True), (6, False), (3, True), (5, True)])

    def stream_with(next_prompt):
        return GroupStream(
            start=lambda prompts, resumed: ScriptedStream(prompts, slots=4, resumed=resumed), next_prompt=next_prompt,
            score=lambda rows, ids, tokens: (torch.zeros(2, 1), torch.tensor([float(not rows[0]["informative"]), 1.0])),
            agree=lambda values: values, num_generations=2, world=1, rank=0, keep_groups=filter_groups,
            in_flight="carry",
        )  # fmt: skip

    first = stream_with(lambda: (lambda n, informative: ({"informative": informative}, [n]))(*next(script)))
    outcome = first.run(missing=2, budget=100)
    assert [group.prompt_ids for group in outcome.kept] == [[2], [3]] and outcome.dropped_groups == 0
    ((carried,),) = [outcome.carried]
    assert carried.prompt_ids == [5] and carried.tokens == [[5] * 3] * 2 and carried.ended == [False, False]
    assert (outcome.stats.generated_tokens, outcome.carried_tokens) == (28, 6)

    def no_new_prompts():
        raise AssertionError("the carried group covers the expected need: nothing new is drawn")

    second = stream_with(no_new_prompts).run(missing=1, budget=100, carried=[carried])
    assert second.full and second.admitted_groups == 1 and not second.carried
    ((kept,),) = [second.kept]
    assert kept.completions == [[5] * 5] * 2 and kept.fresh_tokens == 4 and second.stats.generated_tokens == 4


def test_carry_fills_the_free_slots_while_groups_are_missing():
    """The first test's script with `carry` and the 4 slots kept full: g0 and g1 enter (2 expected to qualify, all 4
    slots). g0 ends at step 2: 1 kept, 1 expected from g1, so the deficit admits nothing, but its 2 slots are free:
    g2 enters and ends at step 5, the second kept group; the batch is full with g1 five tokens into its six,
    carried. Full at step 5 instead of 9, every slot busy at every step."""
    script = iter([(2, True), (6, False), (3, True), (5, True)])
    stream = GroupStream(
        start=lambda prompts, resumed: ScriptedStream(prompts, slots=4, resumed=resumed),
        next_prompt=lambda: (lambda length, informative: ({"informative": informative}, [length]))(*next(script)),
        score=lambda rows, ids, completions: (torch.zeros(2, 1), torch.tensor([float(not rows[0]["informative"]), 1.0])),
        agree=lambda values: values, num_generations=2, world=1, rank=0, keep_groups=filter_groups,
        in_flight="carry", fill_rows=4,
    )  # fmt: skip
    outcome = stream.run(missing=2, budget=100)
    assert outcome.full and outcome.admitted_groups == 3
    assert [group.prompt_ids for group in outcome.kept] == [[2], [3]]
    ((carried,),) = [outcome.carried]
    assert carried.prompt_ids == [6] and carried.tokens == [[5] * 5] * 2
    # tokens: g0 2 x 2, g2 3 x 2, g1 5 x 2 so far; 5 steps of 4 busy slots
    assert (outcome.stats.generated_tokens, outcome.carried_tokens) == (20, 10)
    assert (outcome.generation.busy_slot_steps, outcome.generation.pool_slot_steps) == (20, 20)
    with pytest.raises(ValueError, match="only 'carry' keeps"):
        GroupStream(None, None, None, None, num_generations=2, world=1, rank=0, keep_groups=filter_groups,
                    in_flight="finish", fill_rows=4)  # fmt: skip


def test_the_groups_in_flight_stay_within_their_cap():
    """The same script with at most one group in flight: g0 (kept), then g1 (filtered; the deficit of 1 at efficiency
    1/2 asks for 2 groups, the cap allows 1), then g2 (kept): full after 2 + 6 + 3 steps, one slot pair busy."""
    script = iter([(2, True), (6, False), (3, True), (5, True)])
    stream = GroupStream(
        start=lambda prompts, resumed: ScriptedStream(prompts, slots=4, resumed=resumed),
        next_prompt=lambda: (lambda length, informative: ({"informative": informative}, [length]))(*next(script)),
        score=lambda rows, ids, completions: (torch.zeros(2, 1), torch.tensor([float(not rows[0]["informative"]), 1.0])),
        agree=lambda values: values, num_generations=2, world=1, rank=0, keep_groups=filter_groups,
    )  # fmt: skip
    outcome = stream.run(missing=2, budget=100, max_in_flight=1)
    assert outcome.full and outcome.admitted_groups == 3
    assert [group.prompt_ids for group in outcome.kept] == [[2], [3]]
    assert (
        outcome.stats.generated_tokens,
        outcome.generation.busy_slot_steps,
        outcome.generation.pool_slot_steps,
    ) == (
        22,
        22,
        44,
    )


def test_carried_rows_are_trained_next_batch_with_the_logprobs_they_were_sampled_with(tiny_model, tmp_path):
    """`carry` on the real trainer and engine: rows stopped when a batch fills resume in the next batch's stream, and
    a group trained there has its rows start with the carried tokens, whose old policy (rollout logprobs) is still
    the one that sampled them. (That the resumed tokens are decoded and scored by the new weights is the engine's
    test, `test_a_partial_rollout_resumes_under_new_weights_keeping_its_old_logprobs`.)"""
    trainer = stream_trainer(
        tiny_model, tmp_path, dynamic_sampling_in_flight="carry", max_completion_length=32, generation_kwargs=None,
        max_steps=3,
    )  # fmt: skip
    trainer.paged_engine.sync_every = 2  # rows span several synchronisations: some are in flight when a batch fills
    trainer.train()
    resumed = 0
    for (_, _, carried), (_, batch, _) in itertools.pairwise(trainer.record):
        prompts = [p[m.bool()].tolist() for p, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
        completions = [
            c[m.bool()].tolist() for c, m in zip(batch["completion_ids"], batch["completion_mask"], strict=True)
        ]
        for group in carried:
            for tokens, logprobs in zip(group.tokens, group.logprobs, strict=True):
                rows = [r for r, (p, c) in enumerate(zip(prompts, completions, strict=True))
                        if tokens and p == group.prompt_ids and c[: len(tokens)] == tokens]  # fmt: skip
                for row in rows:
                    assert len(completions[row]) > len(tokens)  # decoded further in the next batch
                    torch.testing.assert_close(
                        batch["old_per_token_logps"][row, : len(tokens)], logprobs[: len(tokens)]
                    )
                    resumed += 1
    assert resumed >= 2
    # the carried rows' tokens are kept for later, not lost: in the first batch that carries (nothing was carried
    # into it), its surplus tokens are the carried groups' tokens and those of its new surplus groups
    metrics = [h for h in trainer.state.log_history if "dapo/surplus_tokens" in h]
    first = next(i for i, (_, _, carried) in enumerate(trainer.record) if carried)
    assert not any(trainer.record[i][2] for i in range(first))
    carried_tokens = sum(group.earlier_tokens for group in trainer.record[first][2])
    assert carried_tokens > 0
    assert metrics[first]["dapo/surplus_tokens"] == carried_tokens + trainer.surplus_tokens[first]


def test_a_stream_that_spends_its_budget_says_so(tiny_model, tmp_path):
    def constant(completion_ids, **kwargs):
        return [1.0] * len(completion_ids)

    trainer = DAPOTrainer(
        model=tiny_model, reward_funcs=constant, train_dataset=arithmetic_prompts(PROMPTS),
        args=dapo_args(tmp_path, per_device_train_batch_size=8, dynamic_sampling_mode="stream", rollout_engine="paged",
                       max_num_gen_batches=1, dynamic_sampling_on_limit="raise", max_steps=1),
    )  # fmt: skip
    with pytest.raises(
        DynamicSamplingLimitError, match=r"Streaming dynamic sampling admitted its budget .* 0 of the 2"
    ):
        trainer.train()


def test_stream_mode_names_what_it_needs(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="rollout_engine='paged'"):  # 'auto' on the CPU generates with TRL's path
        DAPOTrainer(
            model=tiny_model, reward_funcs=reward_by_prompt, train_dataset=arithmetic_prompts(PROMPTS),
            args=dapo_args(tmp_path, per_device_train_batch_size=8, dynamic_sampling_mode="stream"),
        )  # fmt: skip

    async def async_reward(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="reward_funcs: 'async_reward'"):
        DAPOTrainer(
            model=tiny_model, reward_funcs=async_reward, train_dataset=arithmetic_prompts(PROMPTS),
            args=dapo_args(tmp_path, per_device_train_batch_size=8, dynamic_sampling_mode="stream",
                           rollout_engine="paged"),
        )  # fmt: skip


def spread_by_prompt(completion_ids, index, **kwargs) -> list[float]:
    """By prompt index modulo 3: 0, 1, 0, 1 within the group (std 0.58) for 1; 0, 0, 0, 1 (std 0.5) for 2; constant
    for 0. DAPO's filter keeps the groups of 1 and 2; a threshold on the std between the two keeps those of 1 only."""
    pattern = {0: (1.0,) * 4, 1: (0.0, 1.0, 0.0, 1.0), 2: (0.0, 0.0, 0.0, 1.0)}
    return [pattern[i % 3][j % 4] for j, i in enumerate(index)]


def std_above(threshold: float):
    def keep(values: torch.Tensor, num_generations: int) -> torch.Tensor:
        return values.view(-1, num_generations).std(dim=1) > threshold

    return keep


@pytest.mark.parametrize("mode", ["rounds", "stream"])
def test_the_trainers_group_filter_decides_in_both_modes(tiny_model, tmp_path, monkeypatch, mode):
    """The trainer hands its group filter in one place (its buffer), and both modes keep what it keeps: with a std
    threshold, the groups of prompts 1 mod 3 only. Drawn in the order of the first test (4, 16, 21, 5, then 5, 36,
    12, 17, 11, 18, 13, 30, 23, 34): DAPO's own filter would keep 4, 16, 5, 5."""
    monkeypatch.setattr("trl_dapo.trainer.trainer.filter_groups", std_above(0.55))
    trainer = stream_trainer(tiny_model, tmp_path, dynamic_sampling_mode=mode, reward_funcs=spread_by_prompt)
    trainer.train()
    ((_, batch, _),) = trainer.record
    assert prompt_indices(trainer, batch) == [4, 16, 13, 34]


def test_stream_mode_refuses_a_tokenizer_whose_completions_trl_parses(tiny_model, tmp_path):
    """TRL parses completions with the tokenizer's response template or schema (`parse_response`) before the reward
    functions see them; stream mode scores decoded text on its rank, so it refuses such a tokenizer at set-up rather
    than score other completions than rounds mode would."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer = add_response_schema(tokenizer)
    with pytest.raises(ValueError, match=r"processing_class: the tokenizer has a response_(template|schema)"):
        stream_trainer(tiny_model, tmp_path, processing_class=tokenizer)


def test_log_extra_in_stream_mode_warns_once(tiny_model, tmp_path, caplog):
    def logs_a_column(completion_ids, index, log_extra, **kwargs) -> list[float]:
        log_extra("index", index)
        return reward_by_prompt(completion_ids, index)

    trainer = stream_trainer(tiny_model, tmp_path, reward_funcs=logs_a_column)
    with caplog.at_level("WARNING", logger="trl_dapo"):
        trainer.train()
    assert caplog.text.count("log_extra columns are not logged in stream mode") == 1
    assert "log_extra('index', ...)" in caplog.text


def test_a_group_is_scored_from_explicit_values_as_trl_scores_rows():
    """`GroupScorer` without a trainer: each reward function gets the prompts, the decoded completions as one
    assistant message each (conversational prompts), their ids, the dataset's other columns, `trainer_state` and
    `log_metric`; the rewards are one column per function (NaN where a function skips a completion) and the filter
    metric is the weighted total. Values by hand: lengths 3 and 1 give 3 - 2 = 1 and 1 - 2 = -1, halved: 0.5, -0.5;
    the second function skips the first completion and gives 4 to the second; totals 0.5 and -0.5 + 2 x 4 = 7.5."""
    tokenizer = build_tiny_tokenizer()
    seen, logged = {}, []

    def length_over_two(prompts, completions, completion_ids, target, trainer_state, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, target=target, step=trainer_state.global_step)
        log_metric("lengths", float(sum(map(len, completion_ids))))
        return [(len(c) - 2) / 2 for c in completion_ids]

    def second_only(completion_ids, **kwargs):
        return [None, 4.0]

    scorer = GroupScorer(
        [length_over_two, second_only], ["length", "second"], num_task_rewards=2,
        decode=tokenizer.batch_decode, log_metric=lambda name, value: logged.append((name, value)),
        state=lambda: SimpleNamespace(global_step=7), filter_metric=FilterMetric(None, torch.tensor([1.0, 2.0])),
    )  # fmt: skip
    prompt = [{"role": "user", "content": "2 + 2?"}]
    rows = [{"prompt": prompt, "target": 4}, {"prompt": prompt, "target": 4}]
    rewards, metric = scorer(rows, [1, 2, 3], [[5, 6, 7], [8]])
    torch.testing.assert_close(rewards, torch.tensor([[0.5, torch.nan], [-0.5, 4.0]]), equal_nan=True)
    torch.testing.assert_close(metric, torch.tensor([0.5, 7.5]))
    decoded = tokenizer.batch_decode([[5, 6, 7], [8]], skip_special_tokens=True)
    assert seen == {
        "prompts": [prompt, prompt],
        "completions": [[{"role": "assistant", "content": text}] for text in decoded],
        "target": [4, 4],
        "step": 7,
    }
    assert logged == [("lengths", 4.0)]  # 3 + 1 completion ids, handed on as they are
