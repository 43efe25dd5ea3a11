"""The paged continuous-batching rollout engine on the CPU (eager, the same scheduler as on CUDA): greedy tokens equal
`generate`'s, sampled logprobs equal a teacher-forced forward, sampling follows the tempered truncated distribution,
preemption and refills change nothing, prompts are prefilled once per group, LoRA is merged, weights sync in place,
a row cut and resumed by another call ends as it would have uncut, the call's tail and its resumed and unfinished rows
are counted, every supported model type is served, and a set-up the engine cannot serve falls back to TRL's path,
logging why."""

import ast
import logging
import math
import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from helpers import (
    INTERPRETER_LOOP_PROBE,
    arithmetic_prompts,
    dapo_args,
    first_token_parity,
    needs_triton,
    run_in_triton_interpreter,
)
from trl_dapo import DAPOTrainer
from trl_dapo.rollout import SUPPORTED_MODEL_TYPES, TokenSampling, generation
from trl_dapo.rollout.architectures import BY_MODEL_TYPE, UnsupportedArchitecture
from trl_dapo.rollout.architectures.llama import LlamaArchitecture
from trl_dapo.rollout.architectures.qwen3 import Qwen3Architecture
from trl_dapo.rollout.engine_view import EngineView
from trl_dapo.rollout.paged_engine import PagedRolloutEngine
from trl_dapo.tiny_model import build_tiny_model
from trl_dapo.trainer.collection.engine_choice import select_rollout_engine
from trl_dapo.trainer.trl_view import engine_set_up


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def prompts(tokenizer, count=6):
    texts = [f"What is {i} + {2 * i % 7}? Answer:" + " x" * (i % 3) for i in range(count)]  # uneven lengths
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def engine_for(model, tokenizer, **options):
    settings = dict(page_size=4, sync_every=5)  # small pages and syncs: rows span pages, slots refill mid-call
    settings.update(options)
    return PagedRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32,
        cuda_graph=False, **settings,
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


def greedy_reference(model, tokenizer, prompt, new_tokens):
    return model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
        max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )[0, len(prompt) :].tolist()  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [{}, {"max_rows": 2}, {"max_cache_tokens": 96, "max_rows": 8}],
    ids=["all-rows-at-once", "two-slots-refilled", "short-cache-preempts"],
)
def test_greedy_tokens_equal_generate(model_and_tokenizer, options):
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer) * 2
    out = engine_for(model, tokenizer, **options).generate(batch, TokenSampling(max_new_tokens=16, greedy=True))
    for prompt, completion in zip(batch, out.completions, strict=True):
        assert completion == greedy_reference(model, tokenizer, prompt, 16)
    if "max_cache_tokens" in options:
        assert out.stats.preemptions > 0  # 12 rows of ~30 tokens do not fit in 96 cache tokens at once
    # every decode step of a row generated one of its tokens; the others come from a prefill: one per admission
    admissions = len(batch) + out.stats.preemptions
    assert out.stats.busy_slot_steps == sum(map(len, out.completions)) - admissions


@pytest.mark.parametrize(
    "options", [{"max_rows": 2}, {"max_cache_tokens": 96, "max_rows": 8}], ids=["refill", "preempt"]
)
def test_a_stream_fed_while_it_decodes_gives_generates_rows(model_and_tokenizer, options):
    """Rows added mid-call (slots refilled, outputs grown past the first allocation, a longer prompt widening the page
    table) end with the tokens and logprobs a single greedy `generate` gives them; every row is reported once."""
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer) * 2 + [prompts(tokenizer)[0] * 3]  # the last prompt is longer than any before
    settings = TokenSampling(max_new_tokens=16, greedy=True)
    engine = engine_for(model, tokenizer, **options)
    expected = engine.generate(batch, settings)
    stream = engine.stream(batch[:2], settings)
    queued, ended = 2, {}
    while not stream.idle or queued < len(batch):
        rows = stream.step()
        assert not set(rows) & set(ended)
        if rows:
            ended.update(zip(rows, zip(*stream.outputs(rows), strict=True), strict=True))
        if queued < len(batch):  # new prompts after every synchronisation
            added = batch[queued : queued + 4]
            assert stream.add(added) == list(range(queued, queued + len(added)))
            queued += len(added)
    assert sorted(ended) == list(range(len(batch)))
    for row, (completion, logprobs) in ended.items():
        assert completion == expected.completions[row]
        torch.testing.assert_close(logprobs, expected.logprobs[row])
    stats = stream.close()
    assert stats.generated_tokens == sum(map(len, expected.completions))
    if "max_cache_tokens" in options:
        assert stats.preemptions > 0
    assert 0 < stats.busy_slot_steps <= stats.pool_slot_steps == stats.decode_steps * engine.max_rows


@pytest.mark.parametrize(
    ("settings", "options"),
    [
        (TokenSampling(16, temperature=0.8), {}),
        (TokenSampling(16, top_k=20, top_p=0.9), {}),
        (TokenSampling(16, temperature=1.2), {"max_cache_tokens": 96, "max_rows": 8}),
    ],
    ids=["tempered", "top-k-top-p", "preempted"],
)
def test_sampled_logprobs_match_a_teacher_forced_forward(model_and_tokenizer, settings, options):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    batch = prompts(tokenizer) * 2
    out = engine_for(model, tokenizer, **options).generate(batch, settings)
    assert any(len(c) > 3 for c in out.completions)
    if options:
        assert out.stats.preemptions > 0  # recomputed rows continue with the right logprobs
    for prompt, completion, logps in zip(batch, out.completions, trimmed(out.logprobs, out.completions), strict=True):
        expected = teacher_forced_logprobs(model, prompt, completion, settings.temperature)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


def test_rows_of_one_prompt_are_prefilled_once_and_sampled_independently(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    batch = [prompt for prompt in prompts(tokenizer, 3) for _ in range(8)]  # groups of 8 samples, as DAPO does
    out = engine_for(model, tokenizer).generate(batch, TokenSampling(8))
    assert out.stats.prefill_tokens == sum(len(p) for p in prompts(tokenizer, 3))  # not 8 times that
    for group in range(3):
        samples = out.completions[8 * group : 8 * group + 8]
        assert len({tuple(s) for s in samples}) > 1  # one prefill, distinct samples


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
    out = engine_for(model, tokenizer).generate(
        [prompt] * draws, TokenSampling(1, temperature=temperature, top_k=top_k, top_p=top_p)
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    expected = truncated_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(torch.tensor([c[0] for c in out.completions]), minlength=expected.numel()).float()
    assert counts[expected == 0].sum() == 0  # nothing outside the truncated set is ever drawn
    assert (expected > 0).sum() > 2  # the distribution is not degenerate
    support = expected > 0
    chi_square = ((counts[support] - draws * expected[support]) ** 2 / (draws * expected[support])).sum().item()
    degrees = support.sum().item() - 1
    assert chi_square < degrees + 4 * (2 * degrees) ** 0.5


def test_min_new_tokens_and_eos_handling(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    out = engine_for(model, tokenizer).generate(prompts(tokenizer), TokenSampling(10, min_new_tokens=10))
    assert all(len(c) == 10 and tokenizer.eos_token_id not in c for c in out.completions)
    assert out.logprobs.shape == (6, 10) and (out.logprobs < 0).all()
    # the random model rarely ends a row: take its most frequent greedy token as the end of sequence instead, so
    # rows end at different points; each stops right after it, keeping it, as `generate` does
    greedy = engine_for(model, tokenizer).generate(prompts(tokenizer), TokenSampling(12, greedy=True))
    stop = torch.tensor([t for c in greedy.completions for t in c]).mode().values.item()
    engine = PagedRolloutEngine(
        model, eos_token_ids=[stop], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, cuda_graph=False,
        page_size=4, sync_every=5,
    )  # fmt: skip
    out = engine.generate(prompts(tokenizer), TokenSampling(12, greedy=True))
    for prompt, completion in zip(prompts(tokenizer), out.completions, strict=True):
        reference = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop,
        )[0, len(prompt) :].tolist()  # fmt: skip
        reference = reference[: reference.index(stop) + 1] if stop in reference else reference
        assert completion == reference
    assert len({len(c) for c in out.completions}) > 1 and any(c[-1] == stop for c in out.completions)


@pytest.mark.parametrize("options", [{}, {"max_cache_tokens": 48, "max_rows": 8}], ids=["pool", "preempting"])
def test_each_row_stops_at_its_own_cap_and_with_stops_blocked_exactly_there(model_and_tokenizer, options):
    """Per-row caps (`row_max_new_tokens`, what a benchmark gives every engine so that all do the same work): with the
    stop ids blocked up to the call's `max_new_tokens`, each row ends exactly at its cap, never at a stop id; without,
    a greedy row ends at the earlier of its first stop id and its cap, the same tokens as the uncapped call's. A pool
    too small for every row at once preempts rows and recomputes them, their caps kept."""
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer) * 2  # 12 rows of about 20 tokens: 48 cache tokens hold two at once
    greedy = engine_for(model, tokenizer).generate(batch, TokenSampling(12, greedy=True))
    stop = torch.tensor([t for c in greedy.completions for t in c]).mode().values.item()  # ends rows early
    engine = PagedRolloutEngine(
        model, eos_token_ids=[stop], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, cuda_graph=False,
        page_size=4, sync_every=5, **options,
    )  # fmt: skip
    caps = [12, 12, 3, 12, 7, 12, 12, 9, 1, 12, 12, 5]
    pinned = engine.generate(batch, TokenSampling(12, min_new_tokens=12), row_max_new_tokens=caps)
    assert [len(c) for c in pinned.completions] == caps and all(stop not in c for c in pinned.completions)
    assert pinned.stats.generated_tokens == sum(caps)
    assert [int((row != 0).sum()) for row in pinned.logprobs] == caps  # logprobs to each row's cap, zero after
    uncapped = engine.generate(batch, TokenSampling(12, greedy=True))
    capped = engine.generate(batch, TokenSampling(12, greedy=True), row_max_new_tokens=caps)
    assert capped.completions == [c[:cap] for c, cap in zip(uncapped.completions, caps, strict=True)]
    assert any(len(c) < cap for c, cap in zip(capped.completions, caps, strict=True))  # a stop id came first
    if options:
        assert pinned.stats.preemptions > 0
    with pytest.raises(ValueError, match="row_max_new_tokens: one cap per prompt"):
        engine.generate(batch, TokenSampling(12), row_max_new_tokens=[13, *caps[1:]])


def stop_ids_for(greedy: list[list[int]], vocab_size: int, count: int = 256) -> list[int]:
    """`count` stop ids in a seeded order: none of the last greedy row's tokens, and the first token of a greedy row
    that does not share it, so that greedy rows end at different points."""
    never = set(greedy[-1])
    first = next(completion[0] for completion in greedy if completion[0] not in never)
    order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0)).tolist()
    return [first, *[token for token in order if token not in never and token != first][: count - 1]]


def assert_rows_stop_at_their_first_stop_id(completions: list[list[int]], stops: list[int], max_new: int) -> None:
    """A stop id only as a row's last token, and a row without one runs to `max_new`; some rows stop midway."""
    for completion in completions:
        ends = [index for index, token in enumerate(completion) if token in stops]
        assert ends in ([], [len(completion) - 1]) and (ends or len(completion) == max_new)
    assert any(1 < len(completion) < max_new for completion in completions)


def test_any_number_of_stop_ids_ends_rows_as_generate_does(model_and_tokenizer):
    """256 stop ids (tokenizers with several end ids, users adding their own): the engine looks each sampled token
    up in a table over the vocabulary; greedy rows stop right after the first stop id, as `generate` given the same
    ids does, sampled rows too, and with `min_new_tokens` no stop id is sampled before."""
    model, tokenizer = model_and_tokenizer
    batch = prompts(tokenizer)
    free = engine_for(model, tokenizer).generate(batch, TokenSampling(12, greedy=True))
    stops = stop_ids_for(free.completions, len(tokenizer))
    engine = PagedRolloutEngine(
        model, eos_token_ids=stops, pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, cuda_graph=False,
        page_size=4, sync_every=5,
    )  # fmt: skip
    assert engine.stop_table.nonzero().flatten().tolist() == sorted(stops)
    out = engine.generate(batch, TokenSampling(12, greedy=True))
    for prompt, completion in zip(batch, out.completions, strict=True):
        reference = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, eos_token_id=stops,
        )[0, len(prompt) :].tolist()  # fmt: skip
        ends = [index for index, token in enumerate(reference) if token in stops]
        assert completion == (reference[: ends[0] + 1] if ends else reference)
    assert len({len(completion) for completion in out.completions}) > 1 and out.completions[-1] == free.completions[-1]
    torch.manual_seed(0)
    assert_rows_stop_at_their_first_stop_id(engine.generate(batch * 4, TokenSampling(12)).completions, stops, 12)
    held = engine.generate(batch, TokenSampling(8, min_new_tokens=8))
    assert all(len(c) == 8 and not set(c) & set(stops) for c in held.completions)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_cuda_graph_decode_step_captures_with_256_stop_ids(tiny_model):
    """On CUDA the decode step is captured as a graph: with `torch.isin` over 24 or more stop ids at 128 rows its
    capture failed (`cudaErrorStreamCaptureInvalidated`). With 256 ids and 128 rows the captured steps must run, every
    row stopping right after its first stop id, and with `min_new_tokens` none sampled before (compiled head too), each
    row at its own cap where the call gives one."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).cuda().eval()
    batch = (prompts(tokenizer) * 22)[:128]

    def engine(stops: list[int], **options) -> PagedRolloutEngine:
        return PagedRolloutEngine(
            model, eos_token_ids=stops, pad_token_id=tokenizer.pad_token_id, dtype=torch.bfloat16,
            device=torch.device("cuda"), **options,
        )  # fmt: skip

    stops = torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(0))[:256].tolist()
    for options in ({"compile_decode": False}, {}):  # graphs of eager kernels, and of the compiled ones (the default)
        captured = engine(stops, cuda_graph=True, **options)
        torch.manual_seed(0)
        out = captured.generate(batch, TokenSampling(24))
        assert_rows_stop_at_their_first_stop_id(out.completions, stops, 24)
        assert out.stats.decode_steps > 0
        held = captured.generate(batch, TokenSampling(8, min_new_tokens=8))
        assert all(len(c) == 8 and not set(c) & set(stops) for c in held.completions)
        caps = [1 + row % 8 for row in range(128)]  # each row's own cap, read by the captured step
        capped = captured.generate(batch, TokenSampling(8, min_new_tokens=8), row_max_new_tokens=caps)
        assert [len(c) for c in capped.completions] == caps


def test_lora_adapters_are_merged_into_the_snapshot(model_and_tokenizer, tiny_model):
    _, tokenizer = model_and_tokenizer
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    ).eval()
    batch = prompts(tokenizer, 3)
    out = engine_for(peft_model, tokenizer).generate(batch, TokenSampling(8))
    for prompt, completion, logps in zip(batch, out.completions, trimmed(out.logprobs, out.completions), strict=True):
        torch.testing.assert_close(
            logps, teacher_forced_logprobs(peft_model, prompt, completion), atol=1e-4, rtol=1e-4
        )


def test_weight_sync_reaches_the_next_generation(model_and_tokenizer, tiny_model):
    _, tokenizer = model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    engine = engine_for(model, tokenizer)
    tensors = dict(engine.snapshot.tensors)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    engine.sync_weights(model)
    assert all(engine.snapshot.tensors[name] is tensor for name, tensor in tensors.items())  # same tensors
    batch = prompts(tokenizer, 2)
    out = engine.generate(batch, TokenSampling(6))
    for prompt, completion, logps in zip(batch, out.completions, trimmed(out.logprobs, out.completions), strict=True):
        torch.testing.assert_close(logps, teacher_forced_logprobs(model, prompt, completion), atol=1e-4, rtol=1e-4)


def test_a_partial_rollout_resumes_under_new_weights_keeping_its_old_logprobs(tiny_model):
    """Rows stopped mid-way under the old weights, then resumed in a new stream after a weight sync: the tokens sampled
    before keep the old policy's logprobs (teacher-forced under the old weights), the KV is recomputed, and every
    later token is sampled, and scored, by the new weights."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    old = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    engine = engine_for(model, tokenizer)
    batch = prompts(tokenizer, 3)
    settings = TokenSampling(max_new_tokens=16)
    torch.manual_seed(0)
    first = engine.stream(batch, settings)
    assert first.step() == []  # 1 sampled by the prefill + 5 decode steps: every row is 6 tokens in
    partial = list(zip(*first.outputs([0, 1, 2]), strict=True))
    assert [len(tokens) for tokens, _ in partial] == [6, 6, 6]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    engine.sync_weights(model)
    second = engine.stream([batch[0]], settings)  # a fresh row beside the resumed ones
    rows = second.add(batch, resumed=partial)
    ended = []
    while not second.idle:
        ended += second.step()
    assert sorted(ended) == [0, *rows]
    completions, logprobs = second.outputs(rows)
    for prompt, (tokens, _), completion, logps in zip(batch, partial, completions, logprobs, strict=True):
        assert completion[:6] == tokens and len(completion) == 16
        torch.testing.assert_close(logps[:6], teacher_forced_logprobs(old, prompt, tokens), atol=1e-4, rtol=1e-4)
        new = teacher_forced_logprobs(model, prompt, completion)
        torch.testing.assert_close(logps[6:16], new[6:], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(logps[:6], new[:6], atol=1e-2)  # the two policies differ on the old tokens


def run_to_end(stream) -> None:
    while not stream.idle:
        stream.step()


@pytest.mark.parametrize(
    ("settings", "options"),
    [(TokenSampling(16, greedy=True), {}), (TokenSampling(16, temperature=0.9), {"max_rows": 1})],
    ids=["greedy-rows-in-other-slots", "sampled-one-slot"],
)
def test_a_row_cut_and_resumed_ends_as_it_would_have_uncut(model_and_tokenizer, settings, options):
    """A stream stopped after its first synchronisation (each row 1 + 5 tokens in), its rows resumed by a new stream
    under the same weights: every row ends with the tokens a call never cut gives it, the tokens sampled before the
    cut keep their logprobs as they were, and the later logprobs are the uncut call's up to summation order (the
    resumed row's KV is recomputed by a prefill, the uncut row's was written by decode steps).

    Greedy rows continue exactly in any slot: here resumed in reverse order behind a fresh row. Sampled rows read
    their Gumbel noise from one draw of the global generator per decode step for the whole slot bucket, each row its
    slot's part, so a row's draws depend on its slot, the bucket and every other draw of the call: a resumed row
    draws what it would have drawn uncut only when it is alone in one slot (`max_rows=1`, the case here: every
    draw, the prefill's first token and each decode step's, is then exactly its own). Noise drawn per row from a
    counter-based generator keyed by the row and its token index would make sampled rows exact in any slot."""
    model, tokenizer = model_and_tokenizer
    engine = engine_for(model, tokenizer, **options)
    batch = prompts(tokenizer, 3) if settings.greedy else prompts(tokenizer, 1)
    torch.manual_seed(0)
    uncut = engine.generate(batch, settings)
    torch.manual_seed(0)
    first = engine.stream(batch, settings)
    assert first.step() == []  # 1 token sampled by the prefill + 5 decode steps: every row is 6 tokens in
    partial = list(zip(*first.outputs(list(range(len(batch)))), strict=True))
    first.close()
    assert all(len(tokens) == 6 and not torch.equal(logps, torch.zeros_like(logps)) for tokens, logps in partial)
    order = list(reversed(range(len(batch)))) if settings.greedy else [0]
    if settings.greedy:
        second = engine.stream(prompts(tokenizer, 5)[4:], settings)  # a fresh row takes the first slot
        rows = second.add([batch[i] for i in order], resumed=[partial[i] for i in order])
    else:
        second = engine.stream(batch, settings, resumed=partial)
        rows = [0]
    run_to_end(second)
    completions, logprobs = second.outputs(rows)
    for index, completion, logps in zip(order, completions, logprobs, strict=True):
        assert completion == uncut.completions[index] and len(completion) == 16
        assert torch.equal(logps[:6], partial[index][1][:6].to(logps))  # copied, not recomputed
        torch.testing.assert_close(logps, uncut.logprobs[index], atol=1e-5, rtol=1e-5)


def test_the_engine_counts_its_tail_and_the_rows_it_resumes_and_leaves_unfinished(model_and_tokenizer):
    """Hand-derived counts. Tail: 8 slots, so a step with fewer than 2 busy rows is the tail; rows pinned to 8
    tokens, 5 decode steps per synchronisation. 4 rows decode 5 steps (4 busy); 2 rows join (their first token from
    the prefill) as the 4 need 2 more: busy [6, 6, 2, 2, 2], exactly a quarter, no tail; a 7th row joins as the 2
    need 2 more: [3, 3, 1, 1, 1], 3 steps of the tail; then its last 2 steps alone, 2 more.
    Resumed and unfinished rows: 2 slots, 3 rows pinned to 16 tokens, stopped after one synchronisation: 2 rows hold
    6 tokens, the third waits with none. A second stream resumes them in a cache that preempts: each partial row's
    prompt and 6 tokens are prefilled once as a resumed row, the prefills of preempted rows are not resumed ones."""
    model, tokenizer = model_and_tokenizer
    pinned = TokenSampling(8, min_new_tokens=8, greedy=True)
    stream = engine_for(model, tokenizer, max_rows=8).stream(prompts(tokenizer, 4), pinned)
    assert stream.step() == []
    stream.add(prompts(tokenizer, 6)[4:])
    assert stream.step() == [0, 1, 2, 3]
    stream.add(prompts(tokenizer, 7)[6:])
    run_to_end(stream)
    stats = stream.close()
    assert (stats.decode_steps, stats.tail_decode_steps) == (5 + 5 + 5 + 2, 3 + 2)
    assert stats.busy_slot_steps == 4 * 5 + (4 * 2 + 2 * 5) + (2 * 2 + 5) + 2 == 7 * 8 - 7  # tokens - admissions
    assert (stats.generated_tokens, stats.unfinished_rows, stats.resumed_rows) == (7 * 8, 0, 0)

    pinned = TokenSampling(16, min_new_tokens=16, greedy=True)
    batch = prompts(tokenizer, 3)
    first = engine_for(model, tokenizer, max_rows=2).stream(batch, pinned)
    assert first.step() == []
    partial = list(zip(*first.outputs([0, 1, 2]), strict=True))
    assert [len(tokens) for tokens, _ in partial] == [6, 6, 0]
    left = first.close()
    assert (left.unfinished_rows, left.unfinished_tokens, left.resumed_rows) == (3, 12, 0)
    second = engine_for(model, tokenizer, max_rows=8, max_cache_tokens=96).stream(batch, pinned, resumed=partial)
    fresh = prompts(tokenizer, 8)[3:]
    second.add(fresh)
    run_to_end(second)
    stats = second.close()
    assert stats.preemptions > 0 and (stats.resumed_rows, stats.resumed_tokens, stats.unfinished_rows) == (2, 12, 0)
    assert stats.resumed_prefill_tokens == len(batch[0]) + len(batch[1]) + 2 * 6
    # every prompt once (the waiting row's and the fresh ones), the resumed rows, then what preemption recomputed
    assert stats.prefill_tokens > stats.resumed_prefill_tokens + len(batch[2]) + sum(map(len, fresh))
    assert stats.generated_tokens - stats.resumed_tokens == 8 * 16 - 12


def test_closing_a_stream_frees_its_kv_pool_while_the_stream_is_still_referenced(model_and_tokenizer):
    """A caller (or a cycle through a wrapper of its methods) may keep a closed stream alive; its KV pool, sized for
    every slot, must not outlive `close` into the training passes. The outputs stay readable; decoding again is an
    error."""
    model, tokenizer = model_and_tokenizer
    stream = engine_for(model, tokenizer, max_rows=4).stream(prompts(tokenizer, 2), TokenSampling(16, greedy=True))
    stream.step()
    pool = [weakref.ref(tensor) for cache in stream._generation.caches for tensor in cache if tensor is not None]
    assert all(ref() is not None for ref in pool)
    tokens, _ = stream.outputs([0, 1])
    stream.close()
    assert all(ref() is None for ref in pool)
    assert stream.outputs([0, 1])[0] == tokens
    with pytest.raises(RuntimeError, match="the stream is closed"):
        stream.step()
    with pytest.raises(RuntimeError, match="the stream is closed"):
        stream.add(prompts(tokenizer, 1))


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_compiled_layer_and_head_match_the_eager_ones_and_compile_once(model_and_tokenizer):
    """The CUDA default compiles the projections and the sampling head; the compiled cache writes must be the same
    function (checked here with the CPU compiler, float32). Calls of other row counts, and so other pool sizes, reuse
    the first call's compiles: a recompile inside a call costs seconds on a GPU (it did, for every new pool size)."""
    from torch._dynamo.utils import counters

    model, tokenizer = model_and_tokenizer
    settings = TokenSampling(12, greedy=True)
    compiled, eager = engine_for(model, tokenizer, compile_decode=True), engine_for(model, tokenizer)
    compiles = []
    for rows in (6, 15, 11):
        batch = (prompts(tokenizer) * 3)[:rows]
        expected, out = eager.generate(batch, settings), compiled.generate(batch, settings)
        assert out.completions == expected.completions
        torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-5, rtol=1e-5)
        compiles.append(counters["stats"]["unique_graphs"])
    assert compiles[0] > 0 and compiles[1:] == [compiles[0]] * 2


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_engines_of_other_models_compile_for_their_own_sizes(model_and_tokenizer):
    """Engines of models of three widths in one process share the compiled code: each width gets its own compile
    (specialised, as a training run's one model is), not a symbolic-width one made on the second model and reused."""
    from torch._dynamo.utils import counters

    _, tokenizer = model_and_tokenizer
    graphs, batch = [], prompts(tokenizer, count=3)
    for hidden in (64, 96, 128):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config).eval()
        out = engine_for(model, tokenizer, compile_decode=True).generate(batch, TokenSampling(4, greedy=True))
        for prompt, completion in zip(batch, out.completions, strict=True):
            assert completion == greedy_reference(model, tokenizer, prompt, 4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] < graphs[1] < graphs[2]


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_the_compiled_sampling_head_returns_the_sampled_tokens_logprobs(model_and_tokenizer):
    """Sampling (tempered, top-k) through the compiled head: the logprob returned for each sampled token is a
    teacher-forced forward's."""
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    batch, settings = prompts(tokenizer), TokenSampling(12, temperature=0.8, top_k=20)
    out = engine_for(model, tokenizer, compile_decode=True).generate(batch, settings)
    assert any(len(c) > 3 for c in out.completions)
    for prompt, completion, logps in zip(batch, out.completions, trimmed(out.logprobs, out.completions), strict=True):
        expected = teacher_forced_logprobs(model, prompt, completion, settings.temperature)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


def test_a_cache_too_small_for_one_row_is_a_clear_error(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(
        ValueError,
        match=r"cannot hold row \d+ of this call: \d+ prompt \+ 64 new tokens; .* lower max_completion_length\.",
    ):
        engine_for(model, tokenizer, max_cache_tokens=32).generate(prompts(tokenizer), TokenSampling(64))


@needs_triton
def test_triton_decode_kernel_matches_the_reference_in_the_interpreter():
    """The CUDA decode-attention kernel, run by Triton's CPU interpreter, against the float32 reference: rows of
    different lengths (an idle one, one whose only token is the new one), pages scattered through the pool, one to
    several splits per row, Qwen3's q/k norms; the new token's k and v written to the same cache slots."""
    probe = run_in_triton_interpreter(INTERPRETER_LOOP_PROBE)
    if probe.returncode != 0:
        pytest.skip(f"Triton's interpreter cannot run a loop with a loaded bound here: {probe.stderr.strip()[-300:]}")
    script = """
import math, torch
from trl_dapo.rollout.paged_attention import reference_decode_attention, triton_decode_attention
from trl_dapo.testing import paged_decode_case
torch.manual_seed(0)
cases = [(4, 2, 16, 4, [5, 0, 37, 1], 3, False), (14, 2, 32, 16, [100, 33], 4, True), (6, 3, 16, 4, [9, 2], 1, False)]
for heads, kv_heads, dim, page, lengths, splits, norm in cases:
    case = paged_decode_case(heads, kv_heads, dim, page, lengths)
    qkv, cos, sin, write, k, v, table, lens = case.values()
    qk_norm = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if norm else None
    k_out, v_out = k.clone(), v.clone()
    args = (page, heads, qk_norm, 1e-6)
    expected = reference_decode_attention(qkv, cos, sin, write, k, v, table, lens, *args, max(lengths))
    out = triton_decode_attention(qkv, cos, sin, write, k_out, v_out, table, lens, *args, splits, block_n=16)
    assert (out - expected).abs().max() < 1e-4, (out - expected).abs().max()
    assert (out[lens == 0] == 0).all()
    assert (k_out - k).abs().max() < 1e-5 and (v_out == v).all()
"""
    result = run_in_triton_interpreter(script)
    assert result.returncode == 0, result.stderr[-2000:]


class ShiftedLogprobs:
    """The trainer's engine with every returned logprob lowered by `shift`: a rollout policy the training forward
    can tell apart from its own, so the ratio shows which logprobs the loss used as the old policy."""

    def __init__(self, engine, shift: float) -> None:
        self.engine, self.shift = engine, shift

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def generate(self, prompt_ids, settings):
        out = self.engine.generate(prompt_ids, settings)
        return out._replace(logprobs=out.logprobs - self.shift)


def engine_trainer(tiny_model, tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, max_steps=1, rollout_engine="paged")
    settings.update(overrides)
    return DAPOTrainer(
        model=tiny_model,
        reward_funcs=first_token_parity,
        args=dapo_args(tmp_path, **settings),
        train_dataset=arithmetic_prompts(40),
    )


def test_trainer_builds_the_engine_from_its_config(tiny_model, tmp_path):
    trainer = engine_trainer(tiny_model, tmp_path, rollout_memory_fraction=0.5, rollout_max_rows=3)
    engine = trainer.paged_engine
    assert isinstance(engine, PagedRolloutEngine) and (engine.memory_fraction, engine.max_rows) == (0.5, 3)
    trainer.train()  # 8 rows through 3 decode slots
    gaps = [h["logprob_gap_max"] for h in trainer.state.log_history if "logprob_gap_max" in h]
    assert gaps and max(gaps) < 1e-3  # engine logprobs agree with the training forward before any update


def test_the_loss_takes_the_engines_logprobs_as_the_old_policy(tiny_model, tmp_path):
    """At the first update the training logprobs equal the engine's (within 1e-4 on the CPU), so with the engine's
    logprobs lowered by 0.25 the ratio must be exp(0.25): it would be 1 if the trainer recomputed the old policy
    itself, or used anything but what the engine returned."""
    trainer = engine_trainer(tiny_model, tmp_path)
    trainer.engine_weights.engine = ShiftedLogprobs(trainer.paged_engine, shift=0.25)  # what rounds generate with
    trainer.train()
    (logs,) = [h for h in trainer.state.log_history if "ratio_mean" in h]
    assert logs["ratio_mean"] == pytest.approx(math.exp(0.25), abs=2e-4)
    assert logs["ratio_std"] < 1e-3
    assert logs["rollout_logprobs_mean"] == pytest.approx(logs["train_logprobs_mean"] - 0.25, abs=1e-4)


def test_the_engine_refuses_what_it_cannot_serve(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"rollout_engine='paged' cannot be used here: a rollout_func generates"):
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=first_token_parity,
            args=dapo_args(tmp_path, per_device_train_batch_size=8, rollout_engine="paged"),
            train_dataset=arithmetic_prompts(8),
            rollout_func=lambda prompts, trainer: {},
        )


def tiny_config(config_class, tokenizer, **overrides):
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    return config_class(**{**settings, **overrides})


@pytest.mark.parametrize(
    "config_class",
    [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config],
    ids=["llama", "mistral", "qwen2", "qwen3"],
)
def test_every_supported_model_type_generates_what_generate_does(model_and_tokenizer, config_class):
    """The tiny model is a Qwen2 (q/k/v biases, tied head); these have an untied head, Llama and Mistral no biases,
    Qwen2 its q/k/v biases and Qwen3 its q/k norms: greedy tokens equal `generate`'s and sampled logprobs a
    teacher-forced forward's. Biases and norm weights are drawn at random: initialised as zeros and ones, a bias or
    norm the engine dropped or misplaced would go unseen."""
    _, tokenizer = model_and_tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(config_class, tokenizer)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(0.5 * torch.randn_like(parameter))
    assert model.config.model_type in SUPPORTED_MODEL_TYPES and not model.config.tie_word_embeddings
    batch = prompts(tokenizer)
    greedy = engine_for(model, tokenizer).generate(batch, TokenSampling(max_new_tokens=12, greedy=True))
    for prompt, completion in zip(batch, greedy.completions, strict=True):
        assert completion == greedy_reference(model, tokenizer, prompt, 12)
    sampled = engine_for(model, tokenizer).generate(batch, TokenSampling(12, temperature=0.8, top_k=20))
    logprobs = trimmed(sampled.logprobs, sampled.completions)
    for prompt, completion, logps in zip(batch, sampled.completions, logprobs, strict=True):
        expected = teacher_forced_logprobs(model, prompt, completion, temperature=0.8)
        torch.testing.assert_close(logps, expected, atol=1e-4, rtol=1e-4)


def test_a_generation_reads_of_the_engine_what_its_view_names(model_and_tokenizer):
    """`Generation` reads the engine through `EngineView` (so that their modules import each other one way only): the
    engine has every member the view names (the rotary tables once a call built them), and the generation reads no
    member of the engine that the view does not name."""
    model, tokenizer = model_and_tokenizer
    engine = engine_for(model, tokenizer)
    assert not isinstance(engine, EngineView)  # no `cos` / `sin` before a call: the check looks at every member
    engine.generate(prompts(tokenizer, 1), TokenSampling(max_new_tokens=2, greedy=True))
    assert isinstance(engine, EngineView)
    named = set(EngineView.__annotations__) | {
        name for name in vars(EngineView) if callable(getattr(EngineView, name))
    }
    tree = ast.parse(Path(generation.__file__).read_text())
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("engine", "self.engine")
    }
    assert len(read) > 30
    assert read - named == set()


def test_each_supported_model_type_is_served_by_its_architecture():
    """The registry: Llama, Mistral and Qwen2 share one layout, Qwen3 adds its q/k norms."""
    expected = {"llama": LlamaArchitecture, "mistral": LlamaArchitecture, "qwen2": LlamaArchitecture}
    expected["qwen3"] = Qwen3Architecture
    assert expected == BY_MODEL_TYPE
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3")


def test_the_engine_names_the_supported_model_types_when_it_refuses_one(unsupported_model, model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(unsupported_model)
    expected = (
        r"the rollout engine cannot serve this model: model type 'qwen3_moe' is not supported \(the rollout engine "
        r"serves \('llama', 'mistral', 'qwen2', 'qwen3'\)\)\.$"
    )
    with pytest.raises(UnsupportedArchitecture, match=expected):
        engine_for(model, tokenizer)


def test_a_llama_with_biases_the_engine_would_not_apply_is_refused(model_and_tokenizer):
    """Llama's `attention_bias` also biases the output projection, and `mlp_bias` the MLP: the engine adds biases to
    q/k/v only, so such a model would decode with other logprobs than its training forward's."""
    _, tokenizer = model_and_tokenizer
    for option in ("attention_bias", "mlp_bias"):
        model = AutoModelForCausalLM.from_config(tiny_config(LlamaConfig, tokenizer, **{option: True}))
        with pytest.raises(
            UnsupportedArchitecture, match=rf"{option}=True \(the rollout engine applies biases to q/k/v"
        ):
            engine_for(model, tokenizer)


def test_a_model_with_a_sliding_window_shorter_than_its_context_is_refused_by_the_engine_itself(model_and_tokenizer):
    """The refusal is the architecture's, so an engine built without the trainer (benchmarks, scripts) refuses too:
    past the window its logprobs would not be the training forward's."""
    _, tokenizer = model_and_tokenizer
    model = AutoModelForCausalLM.from_config(tiny_config(MistralConfig, tokenizer, sliding_window=16))
    with pytest.raises(UnsupportedArchitecture, match=r"sliding-window attention \(a window of 16 tokens; the engine"):
        engine_for(model, tokenizer)


@pytest.mark.parametrize(
    ("option", "reason"),
    [
        (dict(mlp_bias=True), "mlp_bias=True (the rollout engine applies biases to q/k/v only)"),
        (dict(attention_bias=True), "attention_bias=True (the rollout engine applies biases to q/k/v only)"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' (the rollout engine runs a SiLU-gated MLP)"),
    ],
    ids=["mlp_bias", "attention_bias", "gelu"],
)
def test_a_model_option_the_engine_refuses_falls_back_or_is_refused_at_set_up(
    model_and_tokenizer, tmp_path, caplog, monkeypatch, option, reason
):
    """The engine's own refusals are asked before it is built: `"auto"` on CUDA falls back to TRL's path logging the
    option, and `"paged"` is refused with it when the trainer is built, before any training."""
    _, tokenizer = model_and_tokenizer
    model = AutoModelForCausalLM.from_config(tiny_config(LlamaConfig, tokenizer, **option))
    settings = dict(processing_class=tokenizer, reward_funcs=first_token_parity, train_dataset=arithmetic_prompts(8))
    trainer = DAPOTrainer(
        model=model, args=dapo_args(tmp_path, per_device_train_batch_size=8, rollout_engine="trl"), **settings
    )
    trainer.args.rollout_engine = "auto"
    monkeypatch.setattr(type(trainer.accelerator), "device", property(lambda accelerator: torch.device("cuda")))
    with caplog.at_level(logging.INFO, logger="trl_dapo.trainer.collection.engine_choice"):
        assert select_rollout_engine(engine_set_up(trainer)) is None
    assert caplog.messages == [f"rollout_engine='auto' falls back to TRL's generation path: {reason}."]
    monkeypatch.undo()
    expected = re.escape(f"DAPOConfig.rollout_engine='paged' cannot be used here: {reason}.")
    with pytest.raises(ValueError, match=f"^{expected}$"):
        DAPOTrainer(
            model=model, args=dapo_args(tmp_path, per_device_train_batch_size=8, rollout_engine="paged"), **settings
        )


def test_the_attention_kernel_is_the_reference_off_cuda_and_triton_is_refused_there(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert engine_for(model, tokenizer).attention_kernel == "reference"
    with pytest.raises(ValueError, match="attention_kernel='triton' needs a CUDA device"):
        engine_for(model, tokenizer, attention_kernel="triton")
    with pytest.raises(ValueError, match="must be one of"):
        engine_for(model, tokenizer, attention_kernel="flash")


@pytest.fixture(scope="module")
def unsupported_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("moe-model"), kind="moe")


def test_an_unsupported_set_up_falls_back_to_trls_path_and_logs_why(unsupported_model, tmp_path, caplog, monkeypatch):
    """`"auto"` takes TRL's path without a CUDA device, and on CUDA for a set-up the engine cannot serve, logging
    why; asking for `"paged"` there is an error with the same reason."""
    trainer = DAPOTrainer(
        model=unsupported_model,
        reward_funcs=first_token_parity,
        args=dapo_args(tmp_path, per_device_train_batch_size=8, rollout_engine="trl"),
        train_dataset=arithmetic_prompts(8),
    )
    assert trainer.paged_engine is None
    trainer.args.rollout_engine = "auto"
    with caplog.at_level(logging.INFO, logger="trl_dapo.trainer.collection.engine_choice"):
        assert select_rollout_engine(engine_set_up(trainer)) is None
    assert caplog.messages == ["rollout_engine='auto': no CUDA device, using TRL's generation path."]
    caplog.clear()
    monkeypatch.setattr(type(trainer.accelerator), "device", property(lambda accelerator: torch.device("cuda")))
    with caplog.at_level(logging.INFO, logger="trl_dapo.trainer.collection.engine_choice"):
        assert select_rollout_engine(engine_set_up(trainer)) is None
    reason = (
        "model type 'qwen3_moe' is not supported (the rollout engine serves ('llama', 'mistral', 'qwen2', 'qwen3'))"
    )
    assert caplog.messages == [f"rollout_engine='auto' falls back to TRL's generation path: {reason}."]
    trainer.args.rollout_engine = "paged"
    expected = re.escape(f"DAPOConfig.rollout_engine='paged' cannot be used here: {reason}.")
    with pytest.raises(ValueError, match=f"^{expected}$"):
        select_rollout_engine(engine_set_up(trainer))


def test_a_sliding_window_model_is_refused_by_the_engine(model_and_tokenizer, tmp_path):
    """The engine attends to every earlier token: for a model whose attention window is shorter than its context
    (Mistral v0.1) its logprobs would not be the training forward's past the window."""
    _, tokenizer = model_and_tokenizer
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=16,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"cannot be used here: sliding-window attention \(a window of 16 tokens"):
        DAPOTrainer(
            model=AutoModelForCausalLM.from_config(config),
            processing_class=tokenizer,
            reward_funcs=first_token_parity,
            args=dapo_args(tmp_path, per_device_train_batch_size=8, rollout_engine="paged"),
            train_dataset=arithmetic_prompts(8),
        )
