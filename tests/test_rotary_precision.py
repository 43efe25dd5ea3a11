"""Rotary frequencies in float32 whatever built the model. DeepSpeed ZeRO-3's `zero.Init`, under which transformers
builds a model named by a string, casts the buffers a module creates to the training dtype: on a GPU with bf16 the
launch-config test's ZeRO-3 run held bf16 frequencies, cos / sin off by up to 0.36, and sampled other tokens than
`single_gpu` before any update. A model the trainer builds from its name gets them rebuilt in float32; a model the
caller built is left as it is, with a warning naming the fix."""

import logging

import torch
from transformers import AutoModelForCausalLM

from helpers import arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.models import ensure_float32_rotary


def rotary_buffers(model) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{buffer}": getattr(module, buffer).clone()
        for name, module in model.named_modules()
        for buffer in ("inv_freq", "original_inv_freq")
        if isinstance(getattr(module, buffer, None), torch.Tensor)
    }


def as_zero_init_leaves_them(model) -> None:
    """The frequencies cast to bf16, as `zero.Init` casts them on a GPU."""
    for module in model.modules():
        for buffer in ("inv_freq", "original_inv_freq"):
            if isinstance(getattr(module, buffer, None), torch.Tensor):
                setattr(module, buffer, getattr(module, buffer).bfloat16())


def test_bf16_frequencies_are_rebuilt_as_float32_ones_bit_for_bit(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected = rotary_buffers(model)
    assert expected and all(value.dtype == torch.float32 for value in expected.values())
    as_zero_init_leaves_them(model)
    assert not all(torch.equal(value.float(), expected[name]) for name, value in rotary_buffers(model).items())
    ensure_float32_rotary(model, built_by_trainer=True)
    rebuilt = rotary_buffers(model)
    assert rebuilt.keys() == expected.keys()
    for name, value in rebuilt.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name


def test_a_model_the_caller_built_is_left_as_it_is_with_a_warning(tiny_model, tmp_path, caplog):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    as_zero_init_leaves_them(model)
    before = rotary_buffers(model)
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        DAPOTrainer(
            model=model, reward_funcs=length_reward, train_dataset=arithmetic_prompts(8),
            args=dapo_args(tmp_path, max_steps=1),
        )  # fmt: skip
    after = rotary_buffers(model)
    assert all(after[name].dtype == torch.bfloat16 and torch.equal(after[name], before[name]) for name in before)
    assert "rotary frequencies in torch.bfloat16" in caplog.text and "Pass the model's name or path" in caplog.text
