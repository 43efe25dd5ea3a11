"""Kept KV for partial rollouts (`partial_rollout_keep_cache`, `trl_dapo/rollout/kept.py`): a carried row keeps its KV
pages across the training step and the next stream continues it from them instead of prefilling its prompt and tokens
again. Under unchanged weights a greedy row so continued ends exactly as a row never cut; under changed weights it
continues from KV the older weights wrote, as a hand-built transformers cache does; rows the byte budget, the slots or
the pool leave out are prefilled, and the counts say which. Then the trainer on the CPU's paged engine."""

import dataclasses
import os
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import SAMPLED, partial_trainer, record_batches, rows_of
from trl_dapo.rollout import TokenSampling
from trl_dapo.rollout.kept import pool_room
from trl_dapo.rollout.paged_engine import PagedRolloutEngine
from trl_dapo.sampling.carried import CarriedGroups
from trl_dapo.sampling.stream import CarriedGroup
from trl_dapo.trainer.collection.engine_choice import token_sampling
from trl_dapo.trainer.trainer import SAMPLING_STATE_FILE

GREEDY = TokenSampling(16, greedy=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def fresh_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def engine_for(model, tokenizer, **options) -> PagedRolloutEngine:
    settings = dict(page_size=4, sync_every=5) | options  # small pages: a row spans several, a group shares some
    return PagedRolloutEngine(
        model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32,
        cuda_graph=False, **settings,
    )  # fmt: skip


def group_prompts(tokenizer, prompts: int = 2, samples: int = 2) -> list[list[int]]:
    """`samples` rows of each of `prompts` prompts of uneven lengths (rows of one prompt share its full pages)."""
    texts = [f"What is {i} + {2 * i % 7}? Answer:" + " x" * (2 * i) for i in range(prompts)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(samples)]


def cut(engine, batch, max_bytes: int):
    """A stream stopped after its first synchronisation (each row 1 + 5 tokens in), its rows' KV kept within
    `max_bytes` and the stream closed: each row's tokens and logprobs, the kept rows by index, the closed stats."""
    first = engine.stream(batch, GREEDY)
    assert first.step() == []
    partial = list(zip(*first.outputs(list(range(len(batch)))), strict=True))
    kept = first.keep(list(range(len(batch))), max_bytes)
    return partial, kept, first.close()


def resume(engine, batch, partial, kept: dict, fresh: list[int]):
    """A new stream whose first row is `fresh`, then every cut row resumed, the kept ones adopted; run to its end."""
    second = engine.stream([fresh], GREEDY)
    rows = second.add(batch, resumed=partial)
    adopted = [index for index in range(len(batch)) if index in kept]
    second.adopt([rows[index] for index in adopted], [kept[index] for index in adopted])
    while not second.idle:
        second.step()
    completions, logprobs = second.outputs(rows)
    return completions, logprobs, second.close()


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_a_row_continued_from_its_kept_cache_ends_as_a_row_never_cut(tiny_model, tokenizer, kv_cache_dtype):
    """Same weights: every row continues from its kept KV (no prefill but the fresh row's prompt) and ends with the
    tokens and logprobs of a call never cut, also with an FP8 cache (its values and scales kept bitwise). The samples
    of a prompt share its full pages in the kept cache, which is freed once its rows are adopted and dropped."""
    engine = engine_for(fresh_model(tiny_model), tokenizer, kv_cache_dtype=kv_cache_dtype)
    batch, fresh = group_prompts(tokenizer), group_prompts(tokenizer, 3, 1)[2]
    uncut = engine.generate(batch, GREEDY)
    partial, kept, left = cut(engine, batch, max_bytes=1 << 30)
    assert sorted(kept) == [0, 1, 2, 3] and all(len(tokens) == 6 for tokens, _ in partial)
    page_bytes = 4 * engine.cache_bytes_per_token()  # an FP8 cache: a byte a value and a float32 scale a head
    own_pages = sum(len(row.pages) for row in kept.values())
    shared = {row.cache for row in kept.values()}
    assert len(shared) == 1 and left.kept_cache_bytes == shared.pop().pages * page_bytes < own_pages * page_bytes
    assert engine.kept.bytes == left.kept_cache_bytes  # held until adopted: a new stream's pool counts it as its own
    completions, logprobs, stats = resume(engine, batch, partial, kept, fresh)
    assert completions == uncut.completions
    torch.testing.assert_close(logprobs, uncut.logprobs, atol=1e-6, rtol=1e-6)
    assert (stats.kept_cache_rows, stats.resumed_rows, stats.resumed_prefill_tokens) == (4, 4, 0)
    assert stats.prefill_tokens == len(fresh)
    assert stats.kept_cache_tokens == sum(len(prompt) + 6 for prompt in batch)
    cache = weakref.ref(kept[0].cache)
    kept.clear()
    assert cache() is None  # the stream copied it into its pool and holds no reference: freed once the rows let go
    assert engine.kept.bytes == 0


def test_a_stream_pool_leaves_room_for_what_it_keeps_less_the_kept_caches_it_adopts():
    """Bytes of a pool: the budget left (kept caches alive excluded), less the keep room not already held by the
    caches alive, which the stream adopts and frees: pool + caches stay within the budget, and after adoption the
    room is free for the stream's own keep."""
    assert pool_room(100, kept_bytes=0, keep_room=0) == 100
    assert pool_room(100, kept_bytes=0, keep_room=30) == 70
    assert pool_room(100, kept_bytes=20, keep_room=30) == 90  # 20 of the 30 held now, freed at adoption
    assert pool_room(100, kept_bytes=30, keep_room=30) == 100


def test_a_carried_group_too_old_to_resume_lets_its_kept_cache_go(tiny_model, tokenizer):
    """A group dropped by `partial_rollout_max_age` holds no kept KV: the cache every row of one keep shares would
    otherwise stay allocated through the next stream and training step. A young group keeps its own."""
    engine = engine_for(fresh_model(tiny_model), tokenizer)
    batch = group_prompts(tokenizer)
    partial, kept, _ = cut(engine, batch, max_bytes=1 << 30)
    groups = CarriedGroups(max_age=2)
    for birth, rows in ((0, (0, 1)), (3, (2, 3))):
        group = CarriedGroup.fresh({"prompt": "p"}, batch[rows[0]], 2)
        group = dataclasses.replace(
            group, birth=birth, tokens=[partial[r][0] for r in rows], kept=[kept[r] for r in rows]
        )
        groups.carry([group])
    cache = weakref.ref(kept[0].cache)
    kept.clear()
    del group
    young, aged = groups.resume(step=4)
    assert [g.birth for g in young] == [3] and [g.birth for g in aged] == [0]
    assert aged[0].kept is None and all(row is not None for row in young[0].kept)
    young.clear()
    assert cache() is None and engine.kept.bytes == 0


def hand_built_continuation(old, new, prompt, tokens, eos, length=16):
    """The reference for a kept row: transformers' own KV cache of the prompt and all tokens but the last under the
    `old` weights, then greedy decoding under the `new` weights from that cache (the last token fed first)."""
    completion, logprobs = list(tokens), []
    with torch.no_grad():
        past = old(input_ids=torch.tensor([prompt + tokens[:-1]]), use_cache=True).past_key_values
        token = tokens[-1]
        while len(completion) < length and token != eos:
            output = new(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, scores = output.past_key_values, output.logits[0, -1].float().log_softmax(-1)
            token = int(scores.argmax())
            completion.append(token)
            logprobs.append(float(scores[token]))
    return completion, torch.tensor(logprobs)


def test_under_new_weights_a_kept_row_reads_the_older_weights_kv(tiny_model, tokenizer):
    """The weights change between the cut and the resume. A kept row's later tokens are those of transformers decoding
    under the new weights from a cache the old weights wrote (its earlier tokens' logprobs kept as sampled); a row
    prefilled again reads KV the new weights recompute, so its logprobs differ from the kept row's from the first new
    token on."""
    old, model = fresh_model(tiny_model), fresh_model(tiny_model)
    engine = engine_for(model, tokenizer)
    batch, fresh = group_prompts(tokenizer), group_prompts(tokenizer, 3, 1)[2]
    partial, kept, _ = cut(engine, batch, max_bytes=1 << 30)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    engine.sync_weights(model)
    completions, logprobs, stats = resume(engine, batch, partial, kept, fresh)
    assert stats.kept_cache_rows == 4
    _, prefilled_logprobs, again = resume(engine, batch, partial, {}, fresh)
    assert again.kept_cache_rows == 0 and again.resumed_prefill_tokens == sum(len(p) + 6 for p in batch)
    for index, (prompt, (tokens, old_logprobs)) in enumerate(zip(batch, partial, strict=True)):
        expected, expected_logprobs = hand_built_continuation(old, model, prompt, tokens, tokenizer.eos_token_id)
        assert completions[index] == expected
        assert torch.equal(logprobs[index, :6], old_logprobs[:6].to(logprobs))
        torch.testing.assert_close(logprobs[index, 6 : len(expected)], expected_logprobs, atol=1e-5, rtol=1e-5)
        gap = (logprobs[index, 6] - prefilled_logprobs[index, 6]).abs()
        assert gap > 1e-3, "a kept row must not read KV recomputed under the new weights"


def test_rows_the_budget_the_slots_or_the_pool_leave_out_are_prefilled(tiny_model, tokenizer):
    """Pages of 4 tokens, rows cut 6 tokens in. A budget of 6 pages keeps the first prompt's 2 rows (10 prompt tokens
    + 5 tokens of KV each: its 2 full pages shared, 2 pages of each row's own), not the second prompt's (14 + 5: 5
    more pages for its first row); resumed with one decode slot, the first kept row adopts it, the other waits and is
    prefilled, as are the rows not kept; every row kept but resumed in a pool of 9 pages, the second prompt's rows
    find too few pages and are prefilled. Every row ends as uncut; the counts say which way each went."""
    engine = engine_for(fresh_model(tiny_model), tokenizer)
    batch = group_prompts(tokenizer)
    uncut = engine.generate(batch, GREEDY)
    page_bytes = 4 * engine.cache_bytes_per_token()
    partial, kept, left = cut(engine, batch, max_bytes=7 * page_bytes - 1)
    assert sorted(kept) == [0, 1] and left.kept_cache_bytes == 6 * page_bytes
    one_slot = engine_for(fresh_model(tiny_model), tokenizer, max_rows=1)
    completions, logprobs, stats = resume(one_slot, batch, partial, kept, group_prompts(tokenizer, 3, 1)[2])
    assert completions == uncut.completions
    torch.testing.assert_close(logprobs, uncut.logprobs, atol=1e-5, rtol=1e-5)
    assert (stats.kept_cache_rows, stats.resumed_rows) == (1, 4)
    assert stats.resumed_prefill_tokens == sum(len(prompt) + 6 for prompt in batch[1:])

    # every row kept, resumed in a pool of 9 pages (1 kept free): the first row takes 4 pages for its KV and 1 for its
    # next 5 tokens, the second shares 2 of them and takes 3 (2 of its own, 1 ahead); the free page is all that is left
    partial, kept, _ = cut(engine, batch, max_bytes=1 << 30)
    small_pool = engine_for(fresh_model(tiny_model), tokenizer, max_cache_tokens=36)
    completions, logprobs, stats = resume(small_pool, batch, partial, kept, batch[0])
    assert completions == uncut.completions
    torch.testing.assert_close(logprobs, uncut.logprobs, atol=1e-5, rtol=1e-5)
    assert (stats.kept_cache_rows, stats.resumed_rows, stats.cache_tokens) == (2, 4, 36)


def test_only_a_resumed_row_not_yet_prefilled_adopts_a_kept_cache(tiny_model, tokenizer):
    engine = engine_for(fresh_model(tiny_model), tokenizer)
    batch = group_prompts(tokenizer, 1, 1)
    _, kept, _ = cut(engine, batch, max_bytes=1 << 30)
    stream = engine.stream(batch, GREEDY)  # a fresh row: nothing to continue from
    with pytest.raises(ValueError, match="only a resumed row that waits"):
        stream.adopt([0], [kept[0]])


# ----------------------------------------------------------------------------------------------- the trainer (CPU)


def kept_counts(trainer) -> tuple[float, float]:
    """Carried rows continued from a kept cache and prefilled again, over the run's logged steps (a step whose batch
    the carried groups alone filled ran no engine call and logs neither)."""
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return tuple(
        sum(entry.get(f"dapo/carried_rows_{way}", 0) for entry in logs) for way in ("kept_cache", "reprefilled")
    )


@pytest.mark.parametrize(("mode", "dynamic_sampling"), [("rounds", False), ("stream", True)], ids=["rounds", "stream"])
def test_the_trainer_continues_carried_rows_from_their_kept_cache(ending_model, tmp_path, mode, dynamic_sampling):
    """Same weights (learning rate 0), greedy rows, a budget that holds every carried row: no carried row is prefilled
    again, and every trained row holds the tokens and logprobs of a call never cut."""
    trainer = partial_trainer(ending_model, tmp_path, learning_rate=0.0, dynamic_sampling=dynamic_sampling,
                              dynamic_sampling_mode=mode, partial_rollout_keep_cache=0.01)  # fmt: skip
    records = record_batches(trainer)
    trainer.train()
    kept, prefilled = kept_counts(trainer)
    assert kept >= 8 and prefilled == 0
    assert not any(entry.get("dapo/resumed_prefill_tokens") for entry in trainer.state.log_history)
    for _, batch, _ in records:
        rows = rows_of(batch)
        uncut = trainer.paged_engine.generate([prompt for prompt, _ in rows], token_sampling(trainer.args))
        for row, (_, completion) in enumerate(rows):
            assert completion == uncut.completions[row]
            torch.testing.assert_close(batch["old_per_token_logps"][row, : len(completion)],
                                       uncut.logprobs[row, : len(completion)], atol=1e-5, rtol=1e-5)  # fmt: skip


def test_a_budget_below_one_page_prefills_every_carried_row(ending_model, tmp_path):
    """A share of memory smaller than one KV page keeps nothing: every carried row is prefilled, as without the
    setting, and the run trains what it trains without it."""
    page_bytes = 16 * 512  # 16 tokens x 2 layers x k, v x 2 KV heads x 16 dims x 4 bytes
    share = page_bytes / 2 / (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    runs = {}
    for name, keep in (("off", 0.0), ("below-a-page", share)):
        trainer = partial_trainer(ending_model, tmp_path / name, partial_rollout_keep_cache=keep, **SAMPLED)
        runs[name] = (trainer, record_batches(trainer))
        trainer.train()
    trainer, records = runs["below-a-page"]
    kept, prefilled = kept_counts(trainer)
    assert kept == 0 and prefilled >= 4 and prefilled == kept_counts(runs["off"][0])[1]
    for (_, batch, _), (_, expected, _) in zip(records, runs["off"][1], strict=True):
        assert torch.equal(batch["completion_ids"], expected["completion_ids"])


def test_a_learning_run_keeps_carried_rows_and_a_resumed_one_prefills_them(ending_model, tmp_path):
    """Weights moving every step, sampled rows: carried rows continue from their kept cache (counted), every loss is
    finite. Checkpoints hold the carried groups without their cache: resumed from one, the carried rows are prefilled,
    and the run goes on."""
    settings = dict(partial_rollout_keep_cache=0.01, max_steps=3, save_strategy="steps", save_steps=1, **SAMPLED)
    trainer = partial_trainer(ending_model, tmp_path / "straight", **settings)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and torch.isfinite(torch.tensor(losses)).all()
    assert kept_counts(trainer)[0] >= 4
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    saved = torch.load(checkpoint / SAMPLING_STATE_FILE, weights_only=True)["carried"][0]["groups"]
    assert saved and all("kept" not in group for group in saved)

    resumed = partial_trainer(ending_model, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    first = next(entry for entry in resumed.state.log_history if "loss" in entry and entry["step"] == 2)
    assert first["dapo/carried_rows_kept_cache"] == 0 and first["dapo/carried_rows_reprefilled"] > 0
    assert resumed.state.global_step == 3
