"""The token-level loss is the exact global mean of each optimizer step, whatever the micro-batch split.

A real `DAPOTrainer.train()` runs on the tiny model with a scripted rollout (completions of uneven lengths, rollout
logprobs that differ from the model's). Its parameter updates are compared with an independent computation: one
big batch per optimizer step, the paper's formula written out here, plain SGD.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import arithmetic_prompts, dapo_args, length_reward, trained_rows
from trl_dapo import DAPOTrainer
from trl_dapo.testing import ScriptedRollout

LR = 0.1


def train(tiny_model, tmp_path, **overrides) -> DAPOTrainer:
    args = dapo_args(tmp_path / "run", learning_rate=LR, **overrides)
    rollout = ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))
    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=arithmetic_prompts(40),
        rollout_func=rollout,
    )
    trainer.train()
    return trainer


def pad_right(tensors, value):
    width = max(t.size(1) for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1)), value=value) for t in tensors])


def reference_sgd_step(model, batch, eps_low=0.2, eps_high=0.28, clip_c=10.0) -> int:
    """One SGD step on `batch`'s rows: Σ token losses / token count, written out by hand."""
    micro_batches = [batch]
    prompt = torch.cat([mb["prompt_ids"] for mb in micro_batches])
    assert all(mb["prompt_mask"].all() for mb in micro_batches), "test prompts must need no padding"
    completion = pad_right([mb["completion_ids"] for mb in micro_batches], 0)
    mask = pad_right([mb["completion_mask"] for mb in micro_batches], 0).float()
    old = pad_right([mb["old_per_token_logps"] for mb in micro_batches], 0.0)
    advantages = torch.cat([mb["advantages"] for mb in micro_batches]).unsqueeze(1)
    input_ids = torch.cat([prompt, completion], dim=1)
    attention = torch.cat([torch.ones_like(prompt), mask.long()], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt.size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(2, completion.unsqueeze(2)).squeeze(2)
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    per_token = torch.where(advantages < 0, torch.min(per_token, -clip_c * advantages), per_token)
    tokens = int(mask.sum())
    loss = (per_token * mask).sum() / tokens
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= LR * parameter.grad
    return tokens


def assert_same_parameters(model_a, model_b, atol=1e-6):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_one_step_is_the_same_for_one_big_batch_and_uneven_micro_batches(tiny_model, tmp_path, padding_free):
    """Micro-batches of uneven token counts; padding-free, with a cap of 40 tokens (a prompt is 26), one row per pass
    and two passes per micro-batch: either way the step's update is the one big batch's."""
    big = train(
        tiny_model, tmp_path / "big", per_device_train_batch_size=16, gradient_accumulation_steps=1, max_steps=1
    )
    cap = dict(padding_free_max_tokens=40) if padding_free else {}
    small = train(
        tiny_model, tmp_path / "small", per_device_train_batch_size=2, gradient_accumulation_steps=8, max_steps=1,
        padding_free=padding_free, **cap,
    )  # fmt: skip
    micro_batches = small._buffered_inputs
    counts = [int(trained_rows(small, [mb])["completion_mask"].sum()) for mb in micro_batches]
    assert len(set(counts)) > 1, f"micro-batches should carry uneven token counts, got {counts}"
    if padding_free:
        assert [len(mb.passes) for mb in micro_batches] == [2] * 8  # the cap split micro-batches into passes

    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    reference_sgd_step(reference, trained_rows(small))
    assert_same_parameters(small.model, reference)
    assert_same_parameters(big.model, reference)


def test_two_optimizer_steps_of_one_generation_batch_each_use_their_own_token_count(tiny_model, tmp_path):
    trainer = train(
        tiny_model,
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=2,
    )
    micro_batches = trainer._buffered_inputs
    reference = AutoModelForCausalLM.from_pretrained(tiny_model)
    first = reference_sgd_step(reference, trained_rows(trainer, micro_batches[:2]))
    second = reference_sgd_step(reference, trained_rows(trainer, micro_batches[2:]))
    assert first != second, "the test needs steps with different token counts to tell the normalisers apart"
    assert [int(mb.step_tokens) for mb in micro_batches] == [first, first, second, second]
    assert_same_parameters(trainer.model, reference)


@pytest.mark.parametrize("num_iterations", [2])
def test_ratio_moves_off_one_across_updates_of_one_generation_batch(tiny_model, tmp_path, num_iterations):
    trainer = train(
        tiny_model,
        tmp_path,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_iterations=num_iterations,
        max_steps=4,
    )
    history = [h for h in trainer.state.log_history if "ratio_std" in h]
    assert len(history) == 4
    # scripted rollout logprobs differ from the model's: the ratio is never identically one
    assert all(h["ratio_std"] > 0 for h in history)
    assert any(h["clip_ratio/region_mean"] > 0 for h in history)
