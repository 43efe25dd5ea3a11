"""The static-cache rollout engine on the CPU: greedy tokens equal `generate`'s, sampled logprobs equal a
teacher-forced forward pass, LoRA is merged (rounded once), the head's logits take the training head's precision, and
a DAPOTrainer trains with it."""

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import dapo_args
from trl_dapo.rollout import SamplingSettings, StaticRolloutEngine, sampling_settings
from trl_dapo.rollout.sampling import chunked_argmax, chunked_logsumexp, pick_tokens, truncate
from trl_dapo.rollout.weights import linear_weight


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def prompts(tokenizer, count=6):
    texts = [f"What is {i} + {2 * i % 7}? Answer:" + " x" * (i % 3) for i in range(count)]  # uneven lengths
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def engine_for(model, tokenizer, **options):
    return StaticRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32,
        cuda_graph=False, **options,
    )  # fmt: skip


def trimmed(logprobs: torch.Tensor, completions: list[list[int]]) -> list[torch.Tensor]:
    """The engine's (rows, max_new_tokens) logprobs cut to each completion's length; the rest must be zero."""
    for row, completion in zip(logprobs, completions, strict=True):
        assert (row[len(completion) :] == 0).all()
    return [row[: len(completion)] for row, completion in zip(logprobs, completions, strict=True)]


def teacher_forced_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def test_greedy_tokens_equal_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer)
    completions, _ = engine_for(model, tokenizer).generate(batch, SamplingSettings(max_new_tokens=12, greedy=True))
    for prompt, completion in zip(batch, completions, strict=True):
        reference = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert completion == reference[: len(completion)] and len(completion) == len(reference)


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_compiled_decode_layer_matches_the_eager_one(model_and_tokenizer):
    """The CUDA default compiles the decode step's layer; the compiled cache writes and attention must be the same
    function (checked here with the CPU compiler, float32)."""
    model, tokenizer = model_and_tokenizer
    batch, settings = prompts(tokenizer), SamplingSettings(max_new_tokens=12, greedy=True)
    compiled_engine = engine_for(model, tokenizer, compile_decode=True)
    eager_ids, eager_logps = engine_for(model, tokenizer).generate(batch, settings)
    compiled_ids, compiled_logps = compiled_engine.generate(batch, settings)
    assert compiled_ids == eager_ids and sum(map(len, eager_ids)) > 2 * len(batch)
    torch.testing.assert_close(compiled_logps, eager_logps, atol=1e-5, rtol=1e-5)
    # sampling through the compiled head: the returned logprobs are those of the sampled tokens
    sampling = SamplingSettings(12, temperature=0.8, top_k=20)
    completions, logprobs = compiled_engine.generate(batch, sampling)
    for prompt, completion, logps in zip(batch, completions, trimmed(logprobs, completions), strict=True):
        expected = teacher_forced_logprobs(model, prompt, completion, sampling.temperature)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "settings", [SamplingSettings(16, temperature=0.8), SamplingSettings(16, top_k=20, top_p=0.9)]
)
def test_sampled_logprobs_match_a_teacher_forced_forward(model_and_tokenizer, settings):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    batch = prompts(tokenizer)
    completions, logprobs = engine_for(model, tokenizer).generate(batch, settings)
    assert any(len(c) > 3 for c in completions)
    for prompt, completion, logps in zip(batch, completions, trimmed(logprobs, completions), strict=True):
        expected = teacher_forced_logprobs(model, prompt, completion, settings.temperature)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


def truncated_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k tokens, then to the smallest head whose mass reaches top_p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass > top_p:
            break
        keep[token], mass = True, mass + probs[token].item()
    kept = probs * keep
    return kept / kept.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 6, 1.0), (0.5, 0, 0.5)])
def test_sampled_tokens_follow_the_tempered_truncated_distribution(model_and_tokenizer, temperature, top_k, top_p):
    """Gumbel-max must draw from the same distribution as softmax sampling with top-k / top-p: a chi-square test
    of 4,000 draws (the tiny model's distribution is flat, so the bound is on the statistic, at about p = 1e-4; the
    same draws scored against temperature 1 exceed it several times over)."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    prompt = prompts(tokenizer, 1)[0]
    draws = 4000
    completions, _ = engine_for(model, tokenizer).generate(
        [prompt] * draws, SamplingSettings(1, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    expected = truncated_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(torch.tensor([c[0] for c in completions]), minlength=expected.numel()).float()
    assert counts[expected == 0].sum() == 0  # nothing outside the truncated set is ever drawn
    assert (expected > 0).sum() > 2  # the distribution is not degenerate
    support = expected > 0
    chi_square = ((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support])).sum().item()
    degrees = support.sum().item() - 1
    assert chi_square < degrees + 4 * (2 * degrees) ** 0.5


def test_min_new_tokens_and_eos_handling(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    completions, logprobs = engine_for(model, tokenizer).generate(
        prompts(tokenizer), SamplingSettings(10, min_new_tokens=10)
    )
    assert all(len(c) == 10 for c in completions)
    assert all(tokenizer.eos_token_id not in c for c in completions)
    assert logprobs.shape == (len(completions), 10) and (logprobs < 0).all()


def test_lora_adapters_are_merged_into_the_snapshot(model_and_tokenizer, tiny_model):
    _, tokenizer = model_and_tokenizer
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    )
    peft_model.eval()
    batch = prompts(tokenizer, 3)
    completions, logprobs = engine_for(peft_model, tokenizer).generate(batch, SamplingSettings(8))
    for prompt, completion, logps in zip(batch, completions, trimmed(logprobs, completions), strict=True):
        expected = teacher_forced_logprobs(peft_model, prompt, completion)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


def test_weight_sync_reaches_the_next_generation(model_and_tokenizer, tiny_model):
    _, tokenizer = model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    engine = engine_for(model, tokenizer)
    snapshot = {name: tensor for name, tensor in engine.weights.items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    engine.sync_weights(model)
    assert all(engine.weights[name] is tensor for name, tensor in snapshot.items())  # same tensors, new values
    batch = prompts(tokenizer, 2)
    completions, logprobs = engine.generate(batch, SamplingSettings(6))
    for prompt, completion, logps in zip(batch, completions, trimmed(logprobs, completions), strict=True):
        torch.testing.assert_close(logps, teacher_forced_logprobs(model, prompt, completion), atol=1e-4, rtol=1e-4)


def test_row_buckets_give_the_same_completions(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer, 5)
    greedy = SamplingSettings(8, greedy=True)
    plain, _ = engine_for(model, tokenizer).generate(batch, greedy)
    bucketed_engine = StaticRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32,
        cuda_graph=False, bucket_rows=True,
    )  # fmt: skip
    bucketed, logprobs = bucketed_engine.generate(batch, greedy)
    assert bucketed == plain and len(logprobs) == 5
    assert bucketed_engine._buffers_key[0] == 16  # 5 rows ran as a bucket of 16


def test_fp32_logits_are_the_unrounded_products_and_follow_the_training_head(tmp_path):
    """bf16 head and hidden state; the greedy tokens' logits lie near 10, where a bf16 step is 2^-4: rounded logits put
    their logprob off the float64 value by up to half a step, float32 ones only by float32 accumulation error. The
    engines take the float32 path exactly when the training head is float32 (`cast_lm_head_to_fp32`)."""
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
    settings = SamplingSettings(4, temperature=0.7, top_k=top_k, top_p=top_p)
    token, logprob = pick_tokens(hidden, lm_head, noise, settings, torch.tensor([2]), torch.zeros(()))
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
    settings = SamplingSettings(4, temperature=0.7, min_new_tokens=2)
    eos, generated = torch.tensor([2]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    for vocab in (2048, 1536, 5100):
        generator = torch.Generator().manual_seed(vocab)
        hidden, lm_head = torch.randn(8, 16, generator=generator), torch.randn(vocab, 16, generator=generator)
        noise = torch.rand(8, vocab, generator=generator)
        token, logprob = compiled(hidden, lm_head, noise, settings, eos, generated)
        expected_token, expected_logprob = pick_tokens(hidden, lm_head, noise, settings, eos, generated)
        assert torch.equal(token, expected_token)
        torch.testing.assert_close(logprob, expected_logprob)
