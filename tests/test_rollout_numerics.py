"""The rollout engine's numerics, apart from any engine: the head's logits take the training head's precision
(float32 products with `cast_lm_head_to_fp32`), and LoRA is merged into the weight snapshot in float32, rounded once."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from helpers import dapo_args
from trl_dapo.rollout import SamplingSettings, sampling_settings
from trl_dapo.rollout.sampling import pick_tokens
from trl_dapo.rollout.weights import linear_weight


def test_fp32_logits_are_the_unrounded_products_and_follow_the_training_head(tmp_path):
    """bf16 head and hidden state; the greedy tokens' logits lie near 10, where a bf16 step is 2^-4: rounded logits put
    their logprob off the float64 value by up to half a step, float32 ones only by float32 accumulation error. The
    engine takes the float32 path exactly when the training head is float32 (`cast_lm_head_to_fp32`)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=generator).bfloat16()
    lm_head = (torch.randn(512, 256, generator=generator) / 4).bfloat16()
    exact = torch.log_softmax(hidden.double() @ lm_head.double().T, dim=-1)
    eos, none = torch.tensor([2]), torch.zeros(())
    errors = {}
    for fp32 in (False, True):
        settings = SamplingSettings(1, greedy=True, fp32_logits=fp32)
        token, logprob = pick_tokens(hidden, lm_head, None, settings, eos, none)
        errors[fp32] = (logprob.double() - exact.gather(1, token[:, None]).squeeze(1)).abs().max().item()
    assert errors[True] < 1e-5 < 1e-3 < errors[False] < 2**-4
    for cast in (False, True):
        assert sampling_settings(dapo_args(tmp_path, cast_lm_head_to_fp32=cast)).fp32_logits is cast


def test_lora_is_merged_in_float32_and_rounded_once(tiny_model):
    """A bf16 base with a trained-looking adapter (B non-zero): the snapshot's merged weight must be the float32 sum
    rounded once to bf16, which is closer to the exact merge than adding a delta already rounded to bf16."""
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    module = peft_model.get_base_model().model.layers[0].self_attn.q_proj
    weight, delta = module.base_layer.weight, module.get_delta_weight("default")
    exact = weight.double() + delta.double()
    merged = linear_weight(module)[0].to(torch.bfloat16)
    assert torch.equal(merged, (weight.float() + delta.float()).bfloat16())
    twice = weight + delta.to(torch.bfloat16)
    assert not torch.equal(merged, twice)
    assert (merged.double() - exact).abs().mean() < (twice.double() - exact).abs().mean()
