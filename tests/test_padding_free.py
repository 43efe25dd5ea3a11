"""Padding-free training: packed rows, the attention that keeps them apart, the token-balanced deal of a step's rows,
and a whole run against the padded passes (CPU, float32)."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl.trainer.utils import add_fused_lm_head

from helpers import arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.testing import ScriptedRollout
from trl_dapo.trainer.training.micro_batches import deal_by_tokens, plan_step
from trl_dapo.trainer.training.packed_attention import (
    PACKABLE_MODEL_TYPES,
    enable_packed_attention,
    forward_packed,
    packed_attention,
    reference_packed_attention,
    why_model_cannot_pack,
)
from trl_dapo.trainer.training.packing import IGNORED_LABEL, pack_rows, unpack_scores

P = 0  # pad id

# Two rows: prompts left-padded, completions right-padded; the last 3 columns are the completion.
INPUT_IDS = torch.tensor([[P, 5, 6, 7, 8, P], [9, 10, 11, 12, P, P]])
ATTENTION = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])


def test_rows_pack_into_one_sequence_with_positions_restarting_per_row():
    packed = pack_rows(INPUT_IDS, ATTENTION, scored_width=3)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    ignored = IGNORED_LABEL
    assert packed.labels.tolist() == [[ignored, ignored, 7, 8, ignored, ignored, ignored, 12]]
    assert packed.cu_seq_lens.tolist() == [0, 4, 8] and packed.max_length == 4


def test_scores_unpack_to_the_padded_completion_columns():
    """The fused head's value at packed position t scores token t + 1: token t's value lands on its padded column."""
    packed = pack_rows(INPUT_IDS, ATTENTION, scored_width=3)
    values = torch.arange(1.0, 8.0).unsqueeze(0)  # token t (t >= 1) gets the value t
    assert unpack_scores(values, packed, scored_width=3).tolist() == [[2.0, 3.0, 0.0], [7.0, 0.0, 0.0]]


def test_the_reference_attention_keeps_rows_apart():
    """Each row of the packed sequence attends as it would alone; a change in one row leaves the other's output."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    bounds = torch.tensor([0, 3, 7])
    out = reference_packed_attention(query, key, value, bounds, scaling=None)
    alone = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, 3:], key[:, :, 3:], value[:, :, 3:], is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out[:, 3:], alone.transpose(1, 2))
    key[:, :, :3] += 1.0
    torch.testing.assert_close(reference_packed_attention(query, key, value, bounds, None)[:, 3:], out[:, 3:])


def test_rows_of_one_length_attend_as_a_dense_batch():
    """Equal rows take the dense path: the same outputs and gradients as the per-row reference."""
    torch.manual_seed(0)
    inputs = [torch.randn(1, heads, 12, 8, requires_grad=True) for heads in (4, 2, 2)]
    bounds = torch.tensor([0, 4, 8, 12])
    out = packed_attention(*inputs, bounds, max_length=4, scaling=None)
    reference = reference_packed_attention(*inputs, bounds, scaling=None)
    torch.testing.assert_close(out, reference)
    for got, expected in zip(
        torch.autograd.grad(out.sum(), inputs), torch.autograd.grad(reference.sum(), inputs), strict=True
    ):
        torch.testing.assert_close(got, expected)


def uneven_rows(width: int = 9):
    """Rows of prompt + completion tokens: prompts of 3-6 tokens, completions of 1 token, of `width` (the longest a
    completion may be) and between; left-padded prompts, right-padded completions, as TRL lays them out."""
    prompts = [[11, 12, 13], [14, 15, 16, 17, 18, 19], [20, 21, 22, 23], [24, 25, 26]]
    completions = [[30], list(range(40, 40 + width)), [50, 51, 52], [60, 61, 62, 63, 64, 65]]
    prompt_width = max(map(len, prompts))
    rows, masks = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        left, right = prompt_width - len(prompt), width - len(completion)
        rows.append([P] * left + prompt + completion + [P] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(completion)) + [0] * right)
    return torch.tensor(rows), torch.tensor(masks)


# A tiny model of each packable family: 2 layers, width 64, 4 query / 2 key-value heads of 16 dims, small experts.
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
)  # fmt: skip
EXPERTS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def tiny_model_of(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **EXPERTS.get(model_type, {}))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", sorted(PACKABLE_MODEL_TYPES))
def test_a_packed_forward_scores_each_row_as_its_own_forward(model_type):
    """For each model family that packs: through the model's own (switched) attention and TRL's fused head, each
    packed row's logprobs and entropies are those of a forward over that row alone; the padded forward is unchanged
    by the switch."""
    model = tiny_model_of(model_type)
    input_ids, attention = uneven_rows()
    padded_before = model(input_ids=input_ids, attention_mask=attention).logits
    assert why_model_cannot_pack(model, is_multimodal=False) is None
    enable_packed_attention(model)
    padded_after = model(input_ids=input_ids, attention_mask=attention).logits
    torch.testing.assert_close(padded_after, padded_before)

    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    width = 9
    packed = pack_rows(input_ids, attention, width)
    out = forward_packed(model, packed)
    logps, entropy = (unpack_scores(values, packed, width) for values in (out.log_probs, out.entropy))
    for row in range(input_ids.size(0)):
        real = attention[row].bool()
        ids = input_ids[row, real].unsqueeze(0)
        completion = int(attention[row, -width:].sum())
        logits = model(input_ids=ids).logits[0, -completion - 1 : -1].float() / 0.7
        expected = logits.log_softmax(-1).gather(1, ids[0, -completion:].unsqueeze(1)).squeeze(1)
        expected_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        torch.testing.assert_close(logps[row, :completion], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[row, :completion], expected_entropy, atol=1e-5, rtol=1e-5)
        assert not logps[row, completion:].any()


def test_a_row_with_an_empty_prompt_is_not_scored_from_the_row_before():
    """A row whose prompt has no real token starts with a completion token: it has no earlier token of its own row,
    so it gets no label (scored from the previous row's last token it would mix the rows)."""
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    packed = pack_rows(ids, (ids != 0).long(), scored_width=2)
    assert packed.labels.tolist() == [[IGNORED_LABEL, IGNORED_LABEL, 7, 8, IGNORED_LABEL, 10]]


def test_models_that_cannot_pack_say_why(tmp_path):
    """Eager attention, a multimodal model, a convolution layer between attention layers (LFM2: it would run across
    the packed rows), a sliding window, a family not checked."""
    from trl_dapo.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m")
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    assert "attn_implementation='eager'" in why_model_cannot_pack(eager, is_multimodal=False)
    assert "multimodal" in why_model_cannot_pack(AutoModelForCausalLM.from_pretrained(path), is_multimodal=True)
    lfm2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "lfm2", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
    )
    assert "'lfm2' is not among" in why_model_cannot_pack(lfm2, is_multimodal=False)
    windowed = tiny_model_of("mistral")
    windowed.config.sliding_window = 8
    assert "a window of 8 tokens" in why_model_cannot_pack(windowed, is_multimodal=False)


def test_rows_are_dealt_longest_first_to_the_lightest_bin():
    # 10 -> bin 0; 8 -> bin 1; 7 -> bin 1 (8 < 10); 3 -> bin 0 (10 < 15); 1 -> bin 0 (13 < 15)
    assert deal_by_tokens([10, 1, 7, 3, 8], range(5), 2) == [[0, 3, 1], [4, 2]]


def test_a_step_plan_caps_passes_and_keeps_every_rank_in_step():
    """Ranks get 14 and 15 tokens; a cap of 9 needs 2 passes on the heavier rank, so both run 2; the 10-token row
    trains alone though it exceeds the cap; each rank's lighter pass comes first."""
    plans = plan_step([10, 1, 7, 3, 8], world=2, micro_batches=2, max_tokens=9)
    assert plans == [[[[3, 1]], [[0]]], [[[2]], [[4]]]]


@pytest.mark.parametrize(("world", "micro_batches", "cap"), [(1, 4, None), (2, 3, 50), (3, 2, 17), (4, 2, None)])
def test_every_row_is_planned_once_within_the_cap(world, micro_batches, cap):
    tokens = [int(7 + 60 * abs(math.sin(i * 1.7))) for i in range(23)]
    plans = plan_step(tokens, world, micro_batches, cap)
    rows = sorted(row for plan in plans for micro in plan for rows in micro for row in rows)
    assert rows == list(range(len(tokens)))
    shapes = [[len(micro) for micro in plan] for plan in plans]
    assert all(shape == shapes[0] for shape in shapes) and len(shapes[0]) == micro_batches
    for plan in plans:
        passes = [rows for micro in plan for rows in micro]
        loads = [sum(tokens[r] for r in rows) for rows in passes]
        assert loads == sorted(loads)  # lighter passes first, so the step's last pass trains rows
        assert all(cap is None or load <= cap or len(rows) == 1 for rows, load in zip(passes, loads, strict=True))
    per_rank = [sum(tokens[r] for micro in plan for rows in micro for r in rows) for plan in plans]
    assert max(per_rank) - min(per_rank) <= max(tokens)


def train(tiny_model, output, **overrides) -> DAPOTrainer:
    rollout = ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))
    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=length_reward,
        args=dapo_args(output, learning_rate=0.05, **overrides),
        train_dataset=arithmetic_prompts(40),
        rollout_func=rollout,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "settings",
    [
        dict(gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2),
        dict(
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            old_logprobs="recompute",
            gradient_checkpointing=True,
        ),
        dict(gradient_accumulation_steps=4, old_logprobs="recompute", rollout_correction="token_mask"),
    ],
    ids=["iterations", "recompute-checkpointing", "correction"],
)
def test_padding_free_training_equals_padded_training(tiny_model, tmp_path, settings):
    """The same run (scripted rows of 1 to 8 completion tokens, 8 the limit) padded and padding-free, with a cap of
    60 tokens (2 rows a pass): the same parameters after every update, and every logged metric the same. With
    gradient checkpointing the packed layers are recomputed in the backward, after the packed forward returned."""
    common = dict(per_device_train_batch_size=4, max_steps=4, **settings)
    padded = train(tiny_model, tmp_path / "padded", padding_free=False, **common)
    packed = train(tiny_model, tmp_path / "packed", padding_free=True, padding_free_max_tokens=60, **common)
    assert packed.padding_free and not padded.padding_free
    logs = [[h for h in trainer.state.log_history if "loss" in h] for trainer in (padded, packed)]
    # trained completions of one token and at the limit
    assert min(h.get("completions/min_length", 9) for h in logs[1]) == 1
    assert max(h.get("completions/max_length", 0) for h in logs[1]) == 8
    assert max(len(mb.passes) for mb in packed._buffered_inputs) > 1  # the cap cut micro-batches into passes
    for (name, a), b in zip(padded.model.named_parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=0, msg=name)
    assert len(logs[0]) == len(logs[1]) == 4
    for expected, actual in zip(*logs, strict=True):
        assert set(expected) == set(actual)
        for name, value in expected.items():
            if name not in ("step_time",):
                assert actual[name] == pytest.approx(value, rel=2e-4, abs=2e-6), name


def test_padding_free_is_automatic_where_flash_attention_runs(tiny_model, tmp_path, caplog):
    """None: padded on the CPU (the per-row reference costs more than it saves there), saying why at INFO; True
    packs anywhere; a cap without padding-free passes is an error naming both fields."""
    with caplog.at_level("INFO", logger="trl_dapo"):
        automatic = DAPOTrainer(
            model=tiny_model, reward_funcs=length_reward, args=dapo_args(tmp_path / "a"),
            train_dataset=arithmetic_prompts(8),
        )  # fmt: skip
    assert not automatic.padding_free and "CUDA with bf16 or fp16" in caplog.text
    forced = DAPOTrainer(
        model=tiny_model, reward_funcs=length_reward, args=dapo_args(tmp_path / "b", padding_free=True),
        train_dataset=arithmetic_prompts(8),
    )  # fmt: skip
    assert forced.padding_free and forced.model.config._attn_implementation == "sdpa"  # switched while training
    with pytest.raises(ValueError, match=r"padding_free_max_tokens=100 is invalid: .*padding_free=True"):
        dapo_args(tmp_path / "c", padding_free=False, padding_free_max_tokens=100)
    with pytest.raises(ValueError, match="padding_free_max_tokens=0 is invalid"):
        dapo_args(tmp_path / "d", padding_free_max_tokens=0)


def test_a_token_cap_the_padded_passes_cannot_use_is_a_warning_naming_it(tiny_model, tmp_path, caplog):
    """padding_free=None where passes fall back to padded (the CPU here): the cap is not refused, as it is with
    padding_free=False (a GPU config runs unchanged on the CPU), but warned about once, naming it."""
    with caplog.at_level("INFO", logger="trl_dapo"):
        trainer = DAPOTrainer(
            model=tiny_model, reward_funcs=length_reward, args=dapo_args(tmp_path, padding_free_max_tokens=100),
            train_dataset=arithmetic_prompts(8),
        )  # fmt: skip
    assert not trainer.padding_free
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trl_dapo.trainer.training.passes"]
    assert records == [
        (
            "WARNING",
            "Training passes are padded: padding_free=None packs where flash attention runs (CUDA with bf16 or fp16). "
            "DAPOConfig.padding_free_max_tokens=100 does not apply: it caps padding-free passes.",
        )
    ]


class RaiseAtTrainBegin(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        raise RuntimeError("stopped at train begin")


def test_the_callers_model_gets_its_attention_back_after_training_and_evaluation(tiny_model, tmp_path):
    """The dispatcher is the model's attention only while the trainer runs: training and evaluation pack (the packed
    forwards run), and the caller's model reads its own implementation after each, an error included."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    own = model.config._attn_implementation
    trainer = DAPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=dapo_args(tmp_path, per_device_train_batch_size=8, max_steps=1, padding_free=True),
        train_dataset=arithmetic_prompts(8),
        eval_dataset=arithmetic_prompts(4, offset=50),
        rollout_func=ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model)),
    )
    assert trainer.padding_free and model.config._attn_implementation == own
    seen, forward = [], trainer.passes._packed_forward

    def recorded(*args, **kwargs):
        seen.append(model.config._attn_implementation)
        return forward(*args, **kwargs)

    trainer.passes._packed_forward = recorded
    trainer.train()
    assert seen and set(seen) == {f"trl_dapo_packed_{own}"}
    assert model.config._attn_implementation == own
    seen.clear()
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert seen and set(seen) == {f"trl_dapo_packed_{own}"}
    assert model.config._attn_implementation == own
    trainer.add_callback(RaiseAtTrainBegin)
    with pytest.raises(RuntimeError, match="stopped at train begin"):
        trainer.train()
    assert model.config._attn_implementation == own
