"""Partial rollouts (`partial_rollouts=True`): a round stops once the groups it must deliver have ended and carries the
rest, whole, into the next round, where each carried row continues exactly and keeps the logprobs of the policy that
sampled each of its tokens. Driver decisions by hand on a scripted stream; the trainer on the paged engine (CPU) with
a model whose greedy rows end at lengths set by their prompt."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import (
    SAMPLED,
    ScriptedStream,
    alternating_reward,
    arithmetic_prompts,
    dapo_args,
    partial_trainer,
    record_batches,
    rows_of,
    teacher_forced_logprobs,
)
from trl_dapo import DAPOTrainer
from trl_dapo.sampling import filter_groups
from trl_dapo.sampling.carried import CarriedGroups
from trl_dapo.sampling.partial_round import PartialRound, delivery_order
from trl_dapo.sampling.stream import CarriedGroup, GroupStream, sampling_steps
from trl_dapo.trainer.collection.engine_choice import token_sampling
from trl_dapo.trainer.trainer import SAMPLING_STATE_FILE


def scripted_round(streams: list, first: list[int], lengths: list[int], step: int, slots: int = 4) -> PartialRound:
    """A one-rank round of groups of 2 on a scripted stream of `slots` slots: the first prompts' lengths `first`, then
    the prompt stream's `lengths`; a prompt is its row's length."""
    extra = iter(lengths)

    def draw(count: int) -> list[dict]:
        taken = [{"length": first.pop(0)} for _ in range(min(count, len(first)))]
        return taken + [{"length": next(extra)} for _ in range(count - len(taken))]

    def start(prompts, resumed):
        streams.append(ScriptedStream(prompts, slots=slots, resumed=resumed))
        return streams[-1]

    return PartialRound(start, draw, tokenize=lambda row: [row["length"]], agree=lambda values: values,
                        num_generations=2, world=1, rank=0, slots=slots, step=step)  # fmt: skip


def test_a_round_stops_once_its_groups_ended_and_the_next_resumes_what_it_carried():
    """Groups of 2 rows, 4 slots, 2 groups to deliver, at most 3 in flight. Round 1 (step 0): the batch's prompts a (2
    tokens) and b (6) enter (agreement 0); a ends in step 2 (seen at agreement 1); with b alone in flight the slots
    have room for one group: c (3) enters at agreement 2 and ends in step 5 (agreement 4): 2 ended, the round stops
    with b 5 tokens into its 6, carried. A round without partial rollouts would have decoded 6 steps for a and b and
    kept the slots half idle from step 3 on; here every slot is busy at every one of the 5 steps.

    Round 2 (step 1): b enters first, then the batch's prompts f (1) and g (2) (always admitted, though g then waits
    for a slot); b's last token and f end in the first step, both seen at agreement 0: b is delivered first (its
    serial is older), and g, which never got a slot, is carried with no token."""
    streams = []
    first = scripted_round(streams, first=[2, 6], lengths=[3, 5, 4], step=0).run(
        target=2, max_in_flight=3, carried=[], first=2, next_serial=0
    )
    assert [(seen, group.prompt_ids, group.serial) for seen, group in first.ended] == [(1, [2], 0), (4, [3], 2)]
    ((b,),) = [first.in_flight]
    assert (b.prompt_ids, b.serial, b.tokens, b.ended, b.birth) == ([6], 1, [[5] * 5] * 2, [False, False], 0)
    assert first.next_serial == 3 and first.generated_tokens == 2 * (2 + 5 + 3)
    assert (streams[0].steps, first.generation.busy_slot_steps, first.generation.pool_slot_steps) == (5, 20, 20)

    second = scripted_round(streams, first=[1, 2], lengths=[], step=1).run(
        target=2, max_in_flight=3, carried=first.in_flight, first=2, next_serial=first.next_serial
    )
    ended = delivery_order([(seen, 0, group) for seen, group in second.ended])
    assert [(seen, group.prompt_ids, group.serial) for seen, _, group in ended] == [(0, [6], 1), (0, [1], 3)]
    delivered_b = ended[0][2]
    assert delivered_b.tokens == [[5] * 6] * 2 and delivered_b.ended == [True, True]
    # its first 5 tokens were sampled under step 0's weights, the last under step 1's
    assert delivered_b.segments == [[(0, 0), (1, 5)]] * 2
    assert delivered_b.token_steps(8).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]] * 2
    ((g,),) = [second.in_flight]
    assert (g.prompt_ids, g.serial, g.tokens, g.birth) == ([2], 4, [[], []], 1)
    assert second.generated_tokens == 2 * (1 + 1)  # b's last token and f's one; b's 5 earlier ones not again


def test_a_group_whose_samples_all_ended_completes_as_it_enters():
    """A carried group can hold only ended samples (rounds mode carries the groups that ended beyond a round's
    target). Entering a round or a stream, it must complete at once: no row of it decodes, so no row would ever
    report its end, and the driver would wait for it forever. Here the round ends before any step, the stream keeps
    the group (scored as it enters) without drawing a prompt."""
    done = CarriedGroup([{"p": 1}] * 2, [3], [[5, 5, 5], [5]], torch.zeros(2, 3), [True, True], birth=0, serial=0)
    streams = []
    outcome = scripted_round(streams, first=[], lengths=[], step=1).run(
        target=1, max_in_flight=3, carried=[done], first=0, next_serial=1
    )
    assert [(seen, group.tokens) for seen, group in outcome.ended] == [(0, [[5, 5, 5], [5]])]
    assert not streams and not outcome.in_flight and outcome.generated_tokens == 0

    def no_prompt():
        raise AssertionError("the carried group covers the batch: nothing new is drawn")

    stream = GroupStream(
        start=lambda prompts, resumed: ScriptedStream(prompts, slots=4, resumed=resumed), next_prompt=no_prompt,
        score=lambda rows, ids, tokens: (torch.zeros(2, 1), torch.tensor([0.0, 1.0])), agree=lambda values: values,
        num_generations=2, world=1, rank=0, keep_groups=filter_groups, in_flight="carry", fill_rows=4,
    )  # fmt: skip
    kept = stream.run(missing=1, budget=10, max_in_flight=2, carried=[done])
    assert kept.full and [group.completions for group in kept.kept] == [[[5, 5, 5], [5]]]


def test_filling_the_slots_stays_within_the_cap_on_groups_in_flight():
    """Stream mode with `carry` fills free slots while groups are missing, but never beyond the cap on groups in flight
    (carried ones included): 16 slots would take 8 groups of 2, the cap is 3. Groups of lengths 4, 4, 4, 4, ... that
    all qualify, 1 group missing at the start: 3 enter (1 for the deficit, 2 to fill within the cap), they end
    together at step 4 and the batch is full. Uncapped, the fill would admit 8."""
    drawn = []

    def next_prompt():
        drawn.append(4)
        return {"n": len(drawn)}, [4]

    def stream_with(cap):
        drawn.clear()
        return GroupStream(
            start=lambda prompts, resumed: ScriptedStream(prompts, slots=16, resumed=resumed), next_prompt=next_prompt,
            score=lambda rows, ids, tokens: (torch.zeros(2, 1), torch.tensor([0.0, 1.0])),
            agree=lambda values: values, num_generations=2, world=1, rank=0, keep_groups=filter_groups,
            in_flight="carry", fill_rows=16,
        ).run(missing=1, budget=100, max_in_flight=cap)  # fmt: skip

    capped = stream_with(3)
    assert capped.admitted_groups == len(drawn) == 3 and len(capped.kept) == 3
    assert stream_with(None).admitted_groups == 8


def test_segments_say_which_steps_weights_sampled_each_token():
    """A sample's segments start a new stretch each time it resumes under newer weights; a resume that added no token
    (the row waited) leaves no empty stretch; an ended sample gains none."""
    group = CarriedGroup.fresh({"p": 1}, [3], 2).entered(4)
    assert group.segments == [[(4, 0)], [(4, 0)]] and group.birth == 4
    group.tokens, group.ended = [[7, 7], []], [False, False]
    group = group.entered(6)  # sample 0 resumes after 2 tokens, sample 1 waited with none
    assert group.segments == [[(4, 0), (6, 2)], [(6, 0)]] and group.birth == 4
    group.tokens, group.ended = [[7, 7, 7], [7]], [True, False]
    group = group.entered(9)
    assert group.segments == [[(4, 0), (6, 2)], [(6, 0), (9, 1)]]
    assert sampling_steps(group.segments, 4).tolist() == [[4, 4, 6, 6], [6, 9, 9, 9]]


def test_carried_groups_age_out_and_are_dealt_anew_on_another_number_of_ranks():
    """`partial_rollout_max_age`: a group first admitted more than that many steps ago is dropped. A checkpoint's
    groups go back to the rank that saved them; saved on 2 ranks and resumed on 3, they are dealt in saved order."""
    carried = CarriedGroups(max_age=2)
    groups = [CarriedGroup.fresh({"p": i}, [i + 1], 2, serial=i).entered(step) for i, step in enumerate([1, 3, 4])]
    carried.carry(groups)
    young, aged = carried.resume(step=4)
    assert [g.serial for g in young] == [1, 2] and [g.serial for g in aged] == [0] and not len(carried)
    assert CarriedGroups(max_age=None).max_age is None

    saved = []
    for rank_groups in (groups[:2], groups[2:]):
        state = CarriedGroups(max_age=None)
        state.carry(rank_groups)
        state.next_serial = 7
        saved.append(state.state_dict())
    same = CarriedGroups(max_age=None)
    same.load_state_dict(saved, rank=1, world=2)
    assert [g.serial for g in same] == [2] and same.next_serial == 7
    dealt = [CarriedGroups(max_age=None) for _ in range(3)]
    for rank, state in enumerate(dealt):
        state.load_state_dict(saved, rank=rank, world=3)
    assert [[g.serial for g in state] for state in dealt] == [[0], [1], [2]]
    restored = next(iter(dealt[1]))
    assert restored.segments == groups[1].segments and restored.rows == groups[1].rows and restored.birth == 3


def test_a_carried_group_with_a_column_a_checkpoint_cannot_hold_is_named():
    group = CarriedGroup.fresh({"prompt": "2 + 2", "image": object()}, [3], 2)
    with pytest.raises(TypeError, match=r"dataset column 'image' of type object"):
        group.state_dict()


def test_the_in_flight_cap_counts_generation_batches_and_covers_a_larger_round():
    from trl_dapo.sampling.partial_round import in_flight_cap

    assert in_flight_cap(3.0, batch_groups=8, target=8) == 24
    assert in_flight_cap(1.5, batch_groups=3, target=2) == math.ceil(4.5)
    assert in_flight_cap(3.0, batch_groups=8, target=32) == 32  # a candidate round of 4 batches


# ----------------------------------------------------------------------------------------------- the trainer (CPU)


@pytest.mark.parametrize(
    ("mode", "dynamic_sampling"),
    [("rounds", False), ("rounds", True), ("stream", True)],
    ids=["one", "rounds", "stream"],
)
def test_a_carried_row_ends_as_a_row_never_cut(ending_model, tmp_path, mode, dynamic_sampling):
    """Same weights throughout (learning rate 0) and greedy rows: every trained row, carried over one or more steps or
    not, holds the tokens and rollout logprobs the engine gives its prompt in one call never cut; every one ended
    (EOS) before it was trained. With rounds, no group is trained twice or lost: the groups trained plus those still
    carried are the groups admitted."""
    trainer = partial_trainer(
        ending_model, tmp_path, learning_rate=0.0, dynamic_sampling=dynamic_sampling, dynamic_sampling_mode=mode
    )
    records = record_batches(trainer)
    trainer.train()
    settings = token_sampling(trainer.args)
    eos, carried_rows = trainer._tokenizer.eos_token_id, 0
    for step, batch, _ in records:
        rows = rows_of(batch)
        uncut = trainer.paged_engine.generate([prompt for prompt, _ in rows], settings)
        for row, (_, completion) in enumerate(rows):
            assert completion == uncut.completions[row] and completion[-1] == eos
            length = len(completion)
            torch.testing.assert_close(
                batch["old_per_token_logps"][row, :length], uncut.logprobs[row, :length], atol=1e-5, rtol=1e-5
            )
            carried_rows += bool((batch["sampling_step"][row, :length] < step).any())
    assert carried_rows >= 8  # rows begun under an earlier step's weights and continued
    if mode == "rounds":
        carried = trainer.collector.carried
        assert 4 * len(records) + len(carried) == carried.next_serial


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_each_token_keeps_the_logprob_of_the_policy_that_sampled_it(ending_model, tmp_path, old_logprobs):
    """The weights move every step: a carried row's tokens were sampled by several steps' weights, and each token's
    rollout logprob (the ratio's old policy with `old_logprobs="rollout"`; with `"recompute"`, what the mismatch
    correction divides by) is the one the weights of its own step give it, teacher-forced, not the current step's.
    `dapo/old_policy_token_share` counts those tokens."""
    correction = {"rollout_correction": "token_truncate"} if old_logprobs == "recompute" else {}
    trainer = partial_trainer(ending_model, tmp_path, old_logprobs=old_logprobs, **SAMPLED, **correction)
    records = record_batches(trainer)
    trainer.train()
    key = "old_per_token_logps" if old_logprobs == "rollout" else "sampling_per_token_logps"
    model = AutoModelForCausalLM.from_pretrained(ending_model)
    weights_of = {step: weights for step, _, weights in records}
    earlier_tokens = resumed_rows = 0  # rows resumed mid-way hold tokens of the current step and of an earlier one
    shares = [entry["dapo/old_policy_token_share"] for entry in trainer.state.log_history if "loss" in entry]
    for (step, batch, _), share in zip(records, shares, strict=True):
        mask, sampled_at = batch["completion_mask"].bool(), batch["sampling_step"]
        expected = torch.zeros_like(batch[key])
        for sampler in sampled_at[mask].unique().tolist():
            model.load_state_dict(weights_of[sampler])
            chosen = mask & (sampled_at == sampler)
            expected[chosen] = teacher_forced_logprobs(model, batch)[chosen]
        torch.testing.assert_close(batch[key][mask], expected[mask], atol=1e-4, rtol=1e-4)
        earlier = mask & (sampled_at < step)
        if earlier.any():  # the current weights would give those tokens other logprobs
            model.load_state_dict(weights_of[step])
            assert (teacher_forced_logprobs(model, batch)[earlier] - batch[key][earlier]).abs().max() > 1e-3
        earlier_tokens += int(earlier.sum())
        resumed_rows += int((earlier.any(1) & (mask & (sampled_at == step)).any(1)).sum())
        assert share == pytest.approx(float(earlier.sum() / mask.sum()), abs=1e-4)
    assert earlier_tokens >= 20 and resumed_rows >= 2


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_a_resumed_run_continues_the_rows_its_checkpoint_carried(ending_model, tmp_path, steps_per_generation):
    """3 optimizer steps straight against the first step's checkpoint resumed: the checkpoint holds the carried groups
    (in `dapo_sampling_state.pt`), and the resumed run trains the straight run's later batches, their carried rows'
    tokens and logprobs as they were sampled before the checkpoint, and ends with its parameters. With 2 steps per
    generation batch the checkpoint falls inside one (its rest in the generation-batch file)."""
    settings = dict(
        max_steps=3, save_strategy="steps", save_steps=1, steps_per_generation=steps_per_generation,
        per_device_train_batch_size=8 // steps_per_generation, **SAMPLED,
    )  # fmt: skip
    straight = partial_trainer(ending_model, tmp_path / "straight", **settings)
    straight_batches = record_batches(straight)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    saved = torch.load(checkpoint / SAMPLING_STATE_FILE, weights_only=True)["carried"]
    assert len(saved) == 1 and len(saved[0]["groups"]) > 0

    resumed = partial_trainer(ending_model, tmp_path / "resumed", **settings)
    resumed_batches = record_batches(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    later = straight_batches[1:]  # steps 1 and 2 with a batch per step; step 2 with one per 2 steps
    assert [step for step, _, _ in resumed_batches] == [step for step, _, _ in later]
    for (_, batch, _), (_, expected, _) in zip(resumed_batches, later, strict=True):
        for key in ("completion_ids", "completion_mask", "old_per_token_logps", "sampling_step", "advantages"):
            assert torch.equal(batch[key], expected[key]), key
    first = resumed_batches[0][1]
    assert (first["sampling_step"][first["completion_mask"].bool()] == 0).any()  # sampled before the checkpoint
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_partial_rollouts_need_the_paged_engine_and_are_stream_modes_carry(tiny_model, tmp_path):
    """On the CPU `rollout_engine="auto"` generates with TRL's path, which cannot resume rows: refused before a model
    loads, naming the way out. In stream mode `partial_rollouts=True` and `dynamic_sampling_in_flight="carry"` are
    one switch: either sets the other."""
    with pytest.raises(ValueError, match=r"^DAPOConfig.partial_rollouts=True needs .*'auto': without a CUDA device"):
        DAPOTrainer(
            model=tiny_model, reward_funcs=alternating_reward, train_dataset=arithmetic_prompts(8),
            args=dapo_args(tmp_path, partial_rollouts=True),
        )  # fmt: skip
    stream = dict(dynamic_sampling_mode="stream", rollout_engine="paged")
    assert dapo_args(tmp_path, dynamic_sampling_in_flight="carry", **stream).partial_rollouts
    assert dapo_args(tmp_path, partial_rollouts=True, **stream).dynamic_sampling_in_flight == "carry"
