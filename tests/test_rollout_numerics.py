"""The rollout engine's numerics, apart from any engine: the head's logits take the training head's precision
(float32 products with `cast_lm_head_to_fp32`), its vocabulary-wide reductions run in chunks with the full
reductions' results (compiled too), and LoRA is merged into the weight snapshot in float32, rounded once."""

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from helpers import dapo_args
from trl_dapo.rollout import TokenSampling
from trl_dapo.rollout.merged_linear import linear_weight
from trl_dapo.rollout.token_sampling import chunked_argmax, chunked_logsumexp, pick_tokens, stop_table, truncate
from trl_dapo.trainer.collection.engine_choice import token_sampling


def test_fp32_logits_are_the_unrounded_products_and_follow_the_training_head(tmp_path):
    """bf16 head and hidden state; the greedy tokens' logits lie near 10, where a bf16 step is 2^-4: rounded logits put
    their logprob off the float64 value by up to half a step, float32 ones only by float32 accumulation error. The
    engine takes the float32 path exactly when the training head is float32 (`cast_lm_head_to_fp32`)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 256, generator=generator).bfloat16()
    lm_head = (torch.randn(512, 256, generator=generator) / 4).bfloat16()
    exact = torch.log_softmax(hidden.double() @ lm_head.double().T, dim=-1)
    stops, none = stop_table([2], 512, "cpu"), torch.zeros(())
    errors = {}
    for fp32 in (False, True):
        settings = TokenSampling(1, greedy=True, fp32_logits=fp32)
        token, logprob = pick_tokens(hidden, lm_head, None, settings, stops, none)
        errors[fp32] = (logprob.double() - exact.gather(1, token[:, None]).squeeze(1)).abs().max().item()
    assert errors[True] < 1e-5 < 1e-3 < errors[False] < 2**-4
    for cast in (False, True):
        assert token_sampling(dapo_args(tmp_path, cast_lm_head_to_fp32=cast)).fp32_logits is cast


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


@pytest.mark.parametrize("vocab", [152064, 2048, 5100, 97])
def test_the_vocabulary_is_reduced_in_chunks_with_the_full_reductions_results(vocab):
    """The head reduces each row chunk by chunk (a decode batch has too few rows to fill a GPU one row per program):
    the argmax is the first maximal index however the ties fall across chunks, the logsumexp the float64 one."""
    generator = torch.Generator().manual_seed(vocab)
    values = torch.randn(5, vocab, generator=generator) * 8
    values[1] = 0.5  # one tie across every chunk: the first index wins
    values[2, [7, vocab - 1]] = 100.0  # a tie between the first and the last chunk
    values[3, vocab - 1] = 100.0  # the maximum in the last chunk
    assert chunked_argmax(values).tolist() == [values[0].argmax().item(), 0, 7, vocab - 1, values[4].argmax().item()]
    exact = values.double().logsumexp(dim=-1)
    torch.testing.assert_close(chunked_logsumexp(values).double(), exact, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 0.9)])
def test_the_head_picks_the_gumbel_max_token_and_its_tempered_logprob(top_k, top_p):
    """Against the formula written out over the full vocabulary: the token maximising the truncated tempered logits
    plus Gumbel noise, and `log_softmax(logits / temperature)` of it."""
    generator = torch.Generator().manual_seed(1)
    hidden, lm_head = torch.randn(16, 32, generator=generator), torch.randn(2048, 32, generator=generator)
    noise = torch.rand(16, 2048, generator=generator)
    settings = TokenSampling(4, temperature=0.7, top_k=top_k, top_p=top_p)
    token, logprob = pick_tokens(hidden, lm_head, noise, settings, stop_table([2], 2048, "cpu"), torch.zeros(()))
    logits = (hidden @ lm_head.T) / 0.7
    candidates = truncate(logits, settings) if top_k else logits
    expected = (candidates - torch.log(-torch.log(noise))).argmax(dim=-1)
    assert torch.equal(token, expected)
    torch.testing.assert_close(logprob, torch.log_softmax(logits, dim=-1).gather(1, expected[:, None]).squeeze(1))


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_the_compiled_head_serves_models_of_other_vocabularies():
    """Engines of models with different vocabularies share the head's compiled code, so the second vocabulary size
    makes it symbolic: the compiled head must still give the eager head's tokens and logprobs."""
    compiled = torch.compile(pick_tokens, fullgraph=True)
    settings = TokenSampling(4, temperature=0.7, min_new_tokens=2)
    generated = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    for vocab in (2048, 1536, 5100):
        generator = torch.Generator().manual_seed(vocab)
        hidden, lm_head = torch.randn(8, 16, generator=generator), torch.randn(vocab, 16, generator=generator)
        noise, stops = torch.rand(8, vocab, generator=generator), stop_table([2], vocab, "cpu")
        token, logprob = compiled(hidden, lm_head, noise, settings, stops, generated)
        expected_token, expected_logprob = pick_tokens(hidden, lm_head, noise, settings, stops, generated)
        assert torch.equal(token, expected_token)
        torch.testing.assert_close(logprob, expected_logprob)
