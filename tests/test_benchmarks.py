"""The benchmarks run end to end on the CPU (smoke runs, not timings) and count what they report correctly."""

import argparse
import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.core.workload import geometric_lengths

ROOT = Path(__file__).parent.parent
# The tiny local model (trl_dapo.testing): vocabulary 366, hidden 64, MLP 128, 2 layers, 4 query / 2 key-value heads
# of 16 dims, q/k/v biases, tied embeddings. Parameters: per layer q 64*64+64, k and v 64*32+32 each, o 64*64,
# gate/up/down 3*64*128, two norms 2*64 = 37,120; 2 layers + embedding 366*64 + final norm 64 = 97,728.
TINY_PARAMETERS = 97_728
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # keys and values, layers, kv heads, head dim, float32


def run_tiny(script: str, tmp_path: Path, *arguments: str) -> tuple[str, dict]:
    output = tmp_path / f"{script}.json"
    command = [sys.executable, "-m", f"benchmarks.{script}", "--tiny", *arguments, "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout, json.loads(output.read_text())


def test_bench_step_tiny_writes_finite_ratios(tmp_path):
    stdout, results = run_tiny(
        "trainer.bench_step", tmp_path, "--prompts", "4", "--generations", "4", "--new-tokens", "6", "--ga", "2",
        "--steps", "1", "trl=2", "--warmup", "1", "--profile",
    )  # fmt: skip
    assert "| tiny | DAPO/TRL |" in stdout
    comparison = results["models"]["tiny"]
    ratios = comparison["ratio"]
    assert {"step_s", "generation_s", "train_s", "generation_tokens_per_s"} <= set(ratios)
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())
    assert [len(comparison[kind]["step_times_s"]) for kind in ("trl", "dapo")] == [2, 1]  # steps per trainer
    for kind in ("trl", "dapo"):
        run = comparison[kind]
        assert run["completion_tokens_per_step"] == 16 * 6  # 16 rows, lengths pinned to 6
        # the parts of the rest of the step add up to it
        assert math.isclose(sum(run["rest_split_s"].values()), run["train_s"], rel_tol=1e-6, abs_tol=1e-9)
        # a profile of the first measured step of each trainer
        report = (tmp_path / f"profile_tiny_{kind}.txt").read_text()
        assert "aten::mm" in report and "(_generate_and_score_completions)" in report
    variants = results["variants"]
    assert set(variants) == {"gradient_checkpointing", "lora_r16_all_linear", "recompute_old_logprobs"}
    assert all(math.isfinite(r["logprob_pass_s"]) for r in variants.values())


def test_bench_step_variable_lengths_counts_generated_tokens(tmp_path):
    stdout, results = run_tiny(
        "trainer.bench_step", tmp_path, "--variable-lengths", "--prompts", "2", "--generations", "4", "--ga", "1",
        "--new-tokens", "200", "--warmup", "0",
    )  # fmt: skip
    assert results["setup"]["pin_lengths"] == "False" and results["setup"]["gradient_checkpointing"] == "True"
    assert "variants" not in results
    for kind in ("trl", "dapo"):
        run = results["models"]["tiny"][kind]
        assert len(run["step_times_s"]) == 1
        # unpinned: over 8 rows x 200 tokens some rows end early (a random-init model over 366 tokens samples EOS
        # with probability about 1/366 per token), and tokens/s counts what was generated
        assert 8 < run["completion_tokens_per_step"] < 8 * 200
        assert math.isclose(run["generation_tokens_per_s"], run["completion_tokens_per_step"] / run["generation_s"])
    # the training forwards' tokens: every trainer trains the same kind of rows (the prompts' and completions' real
    # tokens); padded passes run on rows x width, padding-free ones on the real tokens alone
    models = results["models"]["tiny"]
    packed, padded = models["dapo"], models["dapo_padded"]
    assert packed["padding_free"] and not padded["padding_free"]
    assert packed["trained_forward_tokens_per_step"] == packed["trained_real_tokens_per_step"]
    for run in (padded, models["trl"]):
        assert (
            run["trained_forward_tokens_per_step"]
            > run["trained_real_tokens_per_step"]
            > run["completion_tokens_per_step"]
        )
    # TRL ran on SDPA: the most FlashAttention could save it, from DAPO's packed over padded training of these rows
    bound = models["flash_bound_dapo_over_trl"]
    assert bound["packed_over_padded"] == packed["train_s"] / padded["train_s"]
    trl = models["trl"]
    saving = (trl["train_s"] + trl["logprob_pass_s"]) * max(0.0, 1 - bound["packed_over_padded"])
    assert bound["trl_step_s_at_least"] == pytest.approx(trl["step_s"] - saving) and saving >= 0
    assert "- tiny dapo/trl were TRL on FlashAttention: its forward passes at best x" in stdout


def test_bench_step_fair_gives_every_kind_the_same_work_micro_batch_and_steps(tmp_path):
    """`--fair` on the CPU: GRPOTrainer with `generate` and with continuous batching beside DAPOTrainer, every kind one
    warm-up step and two measured steps at micro-batch 4 (8 rows, GA 2), every row pinned to 8 tokens on each kind's
    generation path (so each samples the same 64 tokens a step), SDPA attention recorded (the CPU has no FlashAttention),
    no Liger; the steps per generated token are the step over those 64 tokens."""
    stdout, results = run_tiny(
        "trainer.bench_step", tmp_path, "--variable-lengths", "--fair", "--kinds", "trl", "dapo", "trl_cb",
        "--prompts", "2", "--generations", "4", "--ga", "2", "--new-tokens", "8",
    )  # fmt: skip
    assert (results["setup"]["fair"], results["setup"]["pin_lengths"], results["setup"]["attention"]) == (
        "True", "True", "sdpa",
    )  # fmt: skip
    models = results["models"]["tiny"]
    for kind in ("trl", "dapo", "trl_cb"):
        run = models[kind]
        assert (run["warmup_steps"], len(run["step_times_s"]), run["micro_batch"]) == (1, 2, 4), kind
        assert run["completion_tokens_per_step"] == 8 * 8, kind
        assert run["step_us_per_token"] == pytest.approx(1e6 * run["step_s"] / 64)
        assert (run["attention"], run["liger"], run["vllm_sleep"]) == ("sdpa", False, None)
    assert models["ratio_dapo_over_trl_cb"]["step_us_per_token"] == pytest.approx(
        models["dapo"]["step_us_per_token"] / models["trl_cb"]["step_us_per_token"]
    )
    assert "| tiny | trl_cb (micro-batch 4, warm-up 1, sdpa) |" in stdout and "| tiny | dapo/trl_cb |" in stdout


def test_bench_step_refuses_liger_where_it_is_not_installed(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer.bench_step", "--tiny", "--liger",
         "--output", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0 and "--liger: the liger_kernel package is not installed" in done.stderr
    assert not (tmp_path / "out.json").exists()  # refused before anything ran


def test_bench_step_counts_the_rows_stream_mode_carries_from_one_step_into_the_next(tmp_path):
    """`dapo_stream_carry` on the CPU (the paged engine, eager): 16 slots for batches of 4 groups of 2, so the stream
    keeps more groups in flight than a batch needs and stops with rows unfinished; the next step's stream resumes
    exactly their tokens (carried groups never age out by default), prefilling each resumed row's prompt (every prompt
    is 27 tokens: 24 words in the chat template) and tokens again."""
    _, results = run_tiny(
        "trainer.bench_step", tmp_path, "--variable-lengths", "--kinds", "dapo_stream_carry", "--prompts", "4",
        "--generations", "2", "--ga", "1", "--new-tokens", "96", "--max-rows", "16", "--warmup", "0", "--steps", "2",
    )  # fmt: skip
    setup = results["setup"]
    assert (setup["rollout_max_rows"], setup["partial_rollout_max_in_flight"], setup["partial_rollout_max_age"]) == (
        "16",
        "3.0",
        "None",
    )
    run = results["models"]["tiny"]["dapo_stream_carry"]
    engine = run["engine"]
    first, second = engine["calls"]  # one stream per step
    assert (first["step"], second["step"]) == (0, 1) and first["resumed_rows"] == 0
    assert first["unfinished_rows"] > 0 and second["resumed_tokens"] == first["unfinished_tokens"] > 0
    assert 0 < second["resumed_rows"] <= first["unfinished_rows"]  # a row left waiting has no token to resume
    assert second["resumed_prefill_tokens"] == second["resumed_tokens"] + 27 * second["resumed_rows"]
    generated = [call["generated_tokens"] - call["resumed_tokens"] for call in (first, second)]
    assert engine["generated_tokens_per_step"] == sum(generated) / 2
    assert engine["unfinished_rows_per_step"] == (first["unfinished_rows"] + second["unfinished_rows"]) / 2
    tail = (first["tail_decode_steps"] + second["tail_decode_steps"]) / (
        first["decode_steps"] + second["decode_steps"]
    )
    assert engine["tail_share"] == tail and 0 <= tail <= 1
    # the stream generates outside the generation hook: its time is the generation, its tokens the generated ones
    assert run["generation_s"] >= engine["seconds_per_step"] > 0
    assert math.isclose(run["generation_tokens_per_s"], engine["generated_tokens_per_step"] / run["generation_s"])


def test_bench_step_runs_partial_rollouts_beside_dapo_and_reports_what_they_carry(tmp_path):
    """`dapo_partial` on the CPU's paged engine (and `dapo`, for the ratio line): batches of 4 groups of 2, 16 slots,
    at most 2 batches of groups in flight, rows of up to 300 tokens (the random model ends one with probability about
    1/366 per token, so they end at varied lengths). Each step's round stops once 4 groups have ended; a step may
    find the 4 it needs among the groups carried whole (all ended) and generate nothing. The rows one call leaves in
    flight are exactly the rows the next call resumes, each prefilled again with its prompt (27 tokens) and tokens;
    the logged carried rows are the rows left in flight (none waited without a slot), and the tokens they brought
    are trained as sampled by an earlier step."""
    stdout, results = run_tiny(
        "trainer.bench_step", tmp_path, "--variable-lengths", "--kinds", "dapo", "dapo_partial", "--prompts", "4",
        "--generations", "2", "--ga", "1", "--new-tokens", "300", "--max-rows", "16", "--max-in-flight", "2",
        "--warmup", "0", "--steps", "4", "dapo=1",
    )  # fmt: skip
    models = results["models"]["tiny"]
    run = models["dapo_partial"]
    calls, metrics = run["engine"]["calls"], run["metrics"]
    resumed = [(before, after) for before, after in itertools.pairwise(calls) if after["resumed_rows"]]
    assert resumed, calls
    for before, after in resumed:
        assert after["step"] > before["step"]
        assert (after["resumed_rows"], after["resumed_tokens"]) == (
            before["unfinished_rows"],
            before["unfinished_tokens"],
        )
        assert after["resumed_prefill_tokens"] == after["resumed_tokens"] + 27 * after["resumed_rows"]
        assert metrics[before["step"]]["dapo/carried_rows"] == before["unfinished_rows"]
        assert metrics[after["step"]]["dapo/resumed_prefill_tokens"] == after["resumed_prefill_tokens"]
        assert metrics[after["step"]]["dapo/old_policy_token_share"] > 0
    assert set(models["ratio_dapo_partial"]) >= {"step_s", "generation_s", "train_s"}
    assert "| tiny | dapo_partial |" in stdout and "| tiny | dapo_partial/dapo |" in stdout


def test_bench_step_runs_partial_rollouts_keeping_their_kv_beside_dapo(tmp_path):
    """`dapo_partial_kept` on the CPU's paged engine, as `dapo_partial` above, its carried rows keeping their KV
    (`--keep-cache`, far more than they need) in a pool of 16 slots for 8 rows a step (`--carry-max-rows`; `dapo`'s
    own pool is 8): every row one call leaves decoding continues in the next from its kept KV, with no prefill; the
    prefill it saved is each one's prompt (27 tokens) and tokens."""
    stdout, results = run_tiny(
        "trainer.bench_step", tmp_path, "--variable-lengths", "--kinds", "dapo", "dapo_partial_kept", "--prompts", "4",
        "--generations", "2", "--ga", "1", "--new-tokens", "300", "--max-rows", "8", "--carry-max-rows", "16",
        "--max-in-flight", "2", "--keep-cache", "0.01", "--warmup", "0", "--steps", "4", "dapo=1",
    )  # fmt: skip
    setup, models = results["setup"], results["models"]["tiny"]
    assert (setup["rollout_max_rows"], setup["carry_max_rows"], setup["keep_cache"]) == ("8", "16", "0.01")
    calls = models["dapo_partial_kept"]["engine"]["calls"]
    resumed = [(before, after) for before, after in itertools.pairwise(calls) if after["resumed_rows"]]
    assert resumed, calls
    for before, after in resumed:
        assert before["kept_cache_bytes"] > 0 and after["resumed_prefill_tokens"] == 0
        assert after["kept_cache_rows"] == after["resumed_rows"] == before["unfinished_rows"]
        assert after["kept_cache_tokens"] == after["resumed_tokens"] + 27 * after["resumed_rows"]
    assert {call["pool_slot_steps"] // max(call["decode_steps"], 1) for call in calls} == {16}
    assert "| tiny | dapo_partial_kept/dapo |" in stdout


def test_bench_sampling_tiny_runs_each_mode(tmp_path):
    _, results = run_tiny(
        "trainer.bench_sampling", tmp_path, "--prompts", "4", "--generations", "4", "--new-tokens", "6", "--ga", "2",
        "--steps", "2", "--max-rows", "16", "--sampling-fractions", "0.5",
        "--sampling-modes", "1.0:True", "auto:False", "stream:finish", "stream:drop", "stream:carry",
    )  # fmt: skip
    sampling = results["sampling"]
    assert [(r["uninformative"], r["mode"]) for r in sampling] == [
        (0.5, "1.0:True"),
        (0.5, "auto:False"),
        (0.5, "stream:finish"),
        (0.5, "stream:drop"),
        (0.5, "stream:carry"),
    ]
    for r in sampling:
        # lengths pinned to 6 and shorter than one engine synchronisation: every generated row is whole
        assert r["generated_tokens_per_step"] == r["generated_groups_per_step"] * 4 * 6
        assert 0 < r["slot_occupancy"] <= 1 and 0 <= r["untrained_token_share"] <= 1
        assert 0 <= r["surplus_token_share"] <= 1
    assert all(r["generated_groups_per_step"] > 0 and r["rounds_per_step"] >= 1 for r in sampling[:2])


def test_bench_rollout_tiny_counts_tokens_and_bandwidth_floor(tmp_path):
    shapes = ("32x16p8-fixed", "16x96p8", "16x8p8-fixed-lora")
    stdout, results = run_tiny("rollout.bench_rollout", tmp_path, "--shapes", *shapes)
    by_shape = {}
    for r in results["results"]:
        assert "error" not in r, r
        by_shape.setdefault(r["shape"], {})[r["engine"]] = r
    assert {shape: set(runs) for shape, runs in by_shape.items()} == {shape: {"hf", "paged"} for shape in shapes}
    assert "| tiny | 32x16p8-fixed | paged |" in stdout and "| tiny | 32x16p8-fixed | hf |" in stdout
    weight_bytes = TINY_PARAMETERS * 4  # float32; the tied embedding read once, as the output projection
    for shape, rows, new, prompt in (("32x16p8-fixed", 32, 16, 8), ("16x8p8-fixed-lora", 16, 8, 8)):
        # pinned lengths: every row decodes `new` tokens, none of the decode work is on finished rows, and the floor
        # reads the weights `new` times (LoRA merged) plus each row's prompt + t keys/values at its step t
        floor = new * weight_bytes + rows * (new * prompt + new * (new - 1) // 2) * TINY_KV_BYTES_PER_TOKEN
        for r in by_shape[shape].values():
            assert r["useful_tokens"] == rows * new and r["lengths"]["min"] == new and r["finished_row_share"] == 0
        assert by_shape[shape]["hf"]["decode_steps"] == new and by_shape[shape]["hf"]["floor_bytes"] == floor
        # the paged engine samples each row's first token from its prefill, then decodes all rows at once
        paged = by_shape[shape]["paged"]
        assert paged["decode_steps"] == new - 1 and paged["floor_bytes"] == floor - weight_bytes
    assert all(r["lengths"]["max"] <= 96 for r in by_shape["16x96p8"].values())  # unpinned: rows end at an EOS
    hf = by_shape["16x96p8"]["hf"]  # every row decodes until the longest ends
    assert hf["decode_steps"] == hf["lengths"]["max"]
    assert 0 < hf["finished_row_share"] == 1 - hf["useful_tokens"] / (16 * hf["decode_steps"])
    assert all(r["bandwidth_use"] > 0 for runs in by_shape.values() for r in runs.values())


def test_bench_peers_tiny_gives_every_engine_the_same_lengths_and_a_rerun_skips_them(tmp_path):
    """`bench_peers.py` on the CPU: the paged engine and continuous batching (through TRL's own generation path), each
    in its own process, on the same saved tiny model and prompt ids, 3 measured calls each; then each engine's logprob
    gap to the training forward in a fresh process, and (`--smoke`) the paged engine's kernel profile.

    Shared lengths (the default): one list drawn from the random model's end-token distribution (probability 1/366
    a step, capped at 96: about a fifth of the rows end earlier), kept in the JSON, and every engine generates exactly
    those lengths in every call. `-fixed`: every row 6 tokens. `-free`: each engine to its own end tokens. In float32
    the paged engine's logprobs are the training forward's up to summation order; with the end token blocked (shared
    and fixed lengths) each is the renormalised distribution's, log p - log(1 - p_end): a gap of -log(1 - p_end) > 0
    per token (about 1/366 on the random tiny model)."""
    shapes = ["tiny@16x96p8", "tiny@4x6-fixed-math", "tiny@8x16p8-free"]
    arguments = ["--smoke", "--shapes", *shapes, "--checkpoints", str(tmp_path / "ck"),
                 "--samples", str(tmp_path / "samples")]  # fmt: skip
    stdout, results = run_tiny("peers.bench_peers", tmp_path, *arguments)
    records = {(r["shape"], r["engine"], r["kind"]): r for r in results["results"]}
    assert set(records) == {(shape, engine, "generate") for shape in shapes for engine in ("paged", "cb")} | {
        ("tiny@16x96p8", "paged", "profile")
    }
    shared = results["lengths"]["tiny@16x96p8"]
    assert shared["source"] == "geometric" and shared["end_probability"] == pytest.approx(1 / 366)
    assert shared["lengths"] == geometric_lengths(16, 96, 1 / 366, seed=0) and min(shared["lengths"]) < 96
    assert set(results["lengths"]) == {"tiny@16x96p8"}  # fixed and free lengths are not drawn
    expected = {"tiny@16x96p8": shared["lengths"], "tiny@4x6-fixed-math": [6] * 4}
    for (shape, engine, kind), r in records.items():
        assert r["status"] == "ok", r
        if kind == "profile":  # 64 tokens every row: the first from the prefill, then 63 decode steps
            assert r["profiled_tokens"] == 64 and r["profile"]["us_per_step"] > 0 and 0 < r["prefill_share"] < 1
            continue
        samples = torch.load(r["samples"])
        lengths = samples["lengths"].tolist()
        assert r["useful_tokens"] == sum(lengths) == len(samples["tokens"]) and max(lengths) <= r["new_tokens"]
        assert len(r["calls"]) == 3 and r["tokens_per_s"] == pytest.approx(r["useful_tokens"] / r["seconds"])
        speeds = sorted(call["tokens_per_s"] for call in r["calls"])
        assert r["tokens_per_s_spread"] == {"median": speeds[1], "min": speeds[0], "max": speeds[2]}
        assert r["tokens_per_s"] == speeds[1]  # the median call's samples are kept
        assert r["ms_per_step"] == pytest.approx(1e3 * r["seconds"] / max(lengths))
        longest = sorted(lengths, reverse=True)  # steps with under a quarter of the rows running
        assert r["tail_steps"] == longest[0] - longest[math.ceil(len(lengths) / 4) - 1]
        if shape in expected:  # every engine, every call: exactly the shape's lengths
            assert lengths == expected[shape] and r["lengths_match"] is True
        else:
            assert r["lengths_match"] is None
        gap = r["logprob_gap"]
        assert gap["status"] == "ok" and gap["returned"] == (engine == "paged")
        if engine == "paged" and shape in expected:
            assert gap["tokens"] == sum(lengths) and 1e-4 < gap["mean"] <= gap["max"] < 0.05
        elif engine == "paged":
            assert gap["tokens"] == sum(lengths) and gap["max"] < 1e-4
    for shape in shapes:
        paged, cb = (torch.load(records[(shape, e, "generate")]["samples"])["prompts"] for e in ("paged", "cb"))
        assert paged == cb and len(paged) == records[(shape, "paged", "generate")]["rows"]
    math_prompts = torch.load(records[("tiny@4x6-fixed-math", "paged", "generate")]["samples"])["prompts"]
    assert math_prompts[0][0] == 1 and len(set(map(tuple, math_prompts))) == 1  # <|im_start|>: chat template; a group
    assert "| tiny@16x96p8 | paged | shared |" in stdout and "none returned" in stdout
    assert "- tiny@16x96p8: shared lengths (geometric" in stdout
    _, again = run_tiny("peers.bench_peers", tmp_path, *arguments, "--skip-done")
    assert again["results"] == results["results"] and again["lengths"] == results["lengths"]


def test_bench_peers_measures_no_logprob_gap_with_gap_rows_0(tmp_path):
    """`--gap-rows 0`: the engines are measured and no gap process runs (its padded batch of no rows had no width)."""
    arguments = ["--shapes", "tiny@4x6p8", "--engines", "paged", "--repeats", "1", "--gap-rows", "0",
                 "--checkpoints", str(tmp_path / "ck"), "--samples", str(tmp_path / "samples")]  # fmt: skip
    _, results = run_tiny("peers.bench_peers", tmp_path, *arguments)
    (record,) = results["results"]
    assert record["status"] == "ok" and "logprob_gap" not in record
    assert not list((tmp_path / "samples").glob("*gaps*"))


def test_continuous_batching_gives_each_row_its_length_and_reports_rows_as_they_finish(tmp_path):
    """Transformers' continuous batching through TRL's `_generate_single_turn`, each request given its row's exact
    length as its manager receives it (rows of one prompt in row order), and every finished row reported, the last
    report holding every row and token: what a call cut off by a time limit reports instead of nothing."""
    from benchmarks.core.workload import CPU_CB_CONFIG
    from benchmarks.peers.peer_engines import ContinuousBatchingPeer
    from trl_dapo.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    engine = ContinuousBatchingPeer(
        tmp_path / "tiny", rows=8, exact_lengths=True, device="cpu", max_new_tokens=12, memory_fraction=0.5,
        cb_config=CPU_CB_CONFIG,
    )  # fmt: skip
    reports = []
    engine.report = lambda rows, tokens: reports.append((rows, tokens))
    prompts = [[5, 6, 7]] * 4 + [[8, 9]] * 4  # two groups of identical prompts
    lengths = [3, 12, 1, 7, 12, 2, 9, 5]
    generated = engine.generate(prompts, 12, lengths)
    assert [len(c) for c in generated.completions] == lengths and generated.logprobs is None
    assert reports[-1] == (8, sum(lengths)) and [rows for rows, _ in reports] == list(range(1, 9))


def test_a_real_models_shared_lengths_come_from_one_unconstrained_call_of_the_paged_engine(tmp_path):
    """The lengths a pretrained model's completions take (SmolLM2's shape): the paged engine once, seeded, to the end
    token or the shape's maximum; the same seed gives the same lengths."""
    from benchmarks.peers.peer_worker import measured_lengths
    from trl_dapo.tiny_model import build_tiny_model

    build_tiny_model(tmp_path / "tiny")
    spec = {"model": "tiny", "folder": str(tmp_path / "tiny"), "device": "cpu", "rows": 16, "new_tokens": 200,
            "prompt_tokens": 8, "math": False, "memory_fraction": 0.9, "seed": 0, "lengths": None}  # fmt: skip
    lengths = measured_lengths(spec)["lengths"]
    assert len(lengths) == 16 and max(lengths) <= 200 and min(lengths) < 200  # some rows sampled their end token
    assert measured_lengths(spec)["lengths"] == lengths


def test_profile_decode_fp8_cache_option_builds_an_fp8_engine_and_skips_the_bf16_microbenchmarks(tmp_path):
    stdout, results = run_tiny(
        "rollout.profile_decode", tmp_path, "--models", "tiny@4x3", "tiny:fp8kv@4x3", "--calls", "1", "--context", "8"
    )
    plain, fp8 = results["models"]["tiny"], results["models"]["tiny+fp8kv"]
    assert "error" not in fp8, fp8
    assert "| tiny+fp8kv | 4x3 |" in stdout
    # k and v in 2 layers of 2 KV heads of 16 values: float32 on the CPU, or e4m3 bytes plus a float32 scale per head
    assert plain["cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert fp8["cache_bytes_per_token"] == 2 * 2 * 2 * (16 + 4)
    assert (fp8["kv_cache_dtype"], fp8["weights_dtype"]) == ("fp8", "bf16")
    assert "matrix_products" in plain and "matrix_products" not in fp8 and "attention" not in fp8
    assert [call["decode_steps"] for call in fp8["calls"]] == [2]


@pytest.mark.parametrize("text", ["tiny:fp8:fp8kv@4x3", "tiny:int8@4x3", "tiny@4"])
def test_profile_decode_refuses_a_malformed_model(text):
    from benchmarks.rollout.profile_decode import parse_model

    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(text)):
        parse_model(text)


def test_profile_decode_tiny_counts_steps_and_the_products_bytes(tmp_path):
    stdout, results = run_tiny(
        "rollout.profile_decode", tmp_path, "--models", "tiny@16x12", "--calls", "2", "--context", "32"
    )
    run = results["models"]["tiny"]
    assert "error" not in run, run
    assert "| tiny | 16x12 |" in stdout
    # pinned lengths: the engine samples each row's first token from its prefill, then decodes 11 steps
    assert [call["decode_steps"] for call in run["calls"]] == [11, 11]
    assert all(call["ms_per_decode_step"] == 1e3 * call["decode_s"] / 11 for call in run["calls"])
    # per layer q/k/v (64 + 2 * 32 rows) x 64, o 64 x 64, gate/up 256 x 64, down 64 x 128; the tied head 366 x 64;
    # float32; the parameters less biases and norms (2 x 128 + 2 x 128 + 64)
    products = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 366 * 64
    assert products == TINY_PARAMETERS - 2 * 128 - 2 * 128 - 64
    assert run["matrix_products"]["all"]["weight_bytes"] == products * 4
    assert "graph_profile" not in run and run["attention"]["splits"] == 0  # no CUDA graph, no Triton on the CPU
    profile = run["eager_profile"]
    times = [row["us_per_step"] for row in profile["top"]]
    assert (
        profile["calls_per_step"] > 0 and times == sorted(times, reverse=True) and sum(times) <= profile["us_per_step"]
    )


def test_multi_gpu_bench_on_cpu_processes_matches_one_rank(tmp_path):
    output = tmp_path / "multi.json"
    command = [
        sys.executable, "-m", "benchmarks.multi_gpu.bench_multi_gpu", "--tiny", "--configs", "cpu_ddp", "--steps", "2",
        "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    (row,) = json.loads(output.read_text())["rows"]
    assert row["processes"] == 2
    assert row["update_relative_difference"] < 1e-5  # 2 ranks make the 1-rank update, two steps running
    assert math.isfinite(row["speedup"]) and row["speedup"] > 0


def test_multi_gpu_rollout_bench_on_cpu_processes(tmp_path):
    """The `--rollout` runs report every rank's generated tokens, with the engine where asked and TRL's path
    otherwise."""
    output = tmp_path / "rollout.json"
    command = [
        sys.executable, "-m", "benchmarks.multi_gpu.bench_multi_gpu", "--tiny", "--rollout", "--rollout-runs",
        "cpu_ddp:engine", "cpu_ddp:trl", "--processes", "2", "--rows-per-step", "16", "--ga", "2", "--new-tokens", "4",
        "--steps", "2", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    engine, trl = json.loads(output.read_text())["rows"]
    assert (engine["generation"], engine["rollout_engine"], trl["generation"], trl["rollout_engine"]) == (
        "engine", True, "trl", False,
    )  # fmt: skip
    for row in (engine, trl):
        assert row["processes"] == 2 and math.isfinite(row["generation_tokens_per_s"])
        assert row["generation_tokens_per_s"] == 16 * 4 / row["generation_s"]  # both ranks' tokens
        assert row["logprob_gap_max"] < 0.05
    assert "| cpu_ddp | engine | 2 |" in result.stdout


def test_multi_gpu_bench_runs_each_launch_config_at_variable_lengths(tmp_path):
    """`--variable-lengths` through the recipes' one-GPU, DeepSpeed and FSDP2 configs (on one CPU process): the same
    weights and seed generate the same tokens in each, and each step is set against `single_gpu`'s."""
    pytest.importorskip("deepspeed")
    output = tmp_path / "configs.json"
    command = [
        sys.executable, "-m", "benchmarks.multi_gpu.bench_multi_gpu", "--tiny", "--rollout", "--variable-lengths",
        "--rollout-runs", "single_gpu:engine", "zero2:engine", "fsdp2:engine", "--processes", "1",
        "--rows-per-step", "16", "--ga", "2", "--new-tokens", "8", "--steps", "2", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(output.read_text())["rows"]
    assert [row["config"] for row in rows] == ["single_gpu", "zero2", "fsdp2"]
    assert len({row["generated_tokens_per_step"] for row in rows}) == 1  # the same generations in every config
    assert 16 <= rows[0]["generated_tokens_per_step"] <= 16 * 8  # nothing pins the lengths
    for row in rows:
        assert row["rollout_engine"] and 0 < row["training_s"] < row["step_s"]
    assert "| zero2 | engine | 1 |" in result.stdout and "step / single_gpu" in result.stdout


def test_check_logprob_gap_tiny_scores_every_sampled_token_and_agrees_in_float32(tmp_path):
    stdout, results = run_tiny("rollout.check_logprob_gap", tmp_path, "--rows", "16", "--new-tokens", "40")
    assert "| tiny | bf16_logits | bf16_head |" in stdout
    assert "- tiny rollout precision, gap mean / p99 / max against bf16_head: bf16_logits " in stdout
    for spec in ("tiny", "tiny:lora4"):
        out = results["models"][spec]
        assert "errors" not in out and "error" not in out, out
        lora = {"lora_merged_twice"} if spec == "tiny:lora4" else set()
        # no Triton kernel to compare on the CPU, no FP8 weights; the FP8 cache is read by the reference attention
        assert set(out["gaps"]) == {"bf16_logits", "fp32_logits", "fp8_kv"} | lora
        for engine, by_training in out["gaps"].items():
            reference = set() if engine in lora | {"fp8_kv"} else {"fp32_model"}
            assert set(by_training) == {"bf16_head", "fp32_head", "eager_attention"} | reference
            for r in by_training.values():
                assert r["tokens"] == out["sampled_tokens"][engine]  # every sampled token, no padding
                assert r["gap_mean"] <= r["gap_p99"] <= r["gap_max"]
                if engine == "fp8_kv":  # the cache's e4m3 rounding: the gap FP8 rollouts correct for
                    assert 1e-4 < r["gap_max"] < 0.5
                    continue
                # float32 on the CPU: the engine's logprobs are the training forward's, up to summation order
                assert r["gap_max"] < 1e-5 and r["outside_clip_share"] == 0
        # the model is float32 already, so TRL's default forward is the float32 reference itself
        assert out["reference_gaps"]["bf16_logits"]["bf16_head"]["gap_max"] == 0
        assert all(seconds > 0 for seconds in out["score_s"].values()) and out["recompute_over_generation"] > 0
        assert set(out["before_after"]) == {"gap_mean", "gap_max", "kl_k3", "outside_clip_share"}
    merge = results["models"]["tiny:lora4"]["lora_merge"]
    assert merge["differing_share"] == 0 and merge["rounded_once_error"] == merge["rounded_twice_error"]  # float32


def test_check_real_model_tiny_engine_in_float32_matches_hf_float32(tmp_path):
    """With the engine in float32 its rollout logprobs are HF float32's up to summation order, its greedy completions
    are HF float32's, while HF bf16 differs: the samples, prompts and tokens line up across the sides."""
    stdout, results = run_tiny(
        "rollout.check_real_model", tmp_path, "--engine-dtype", "float32", "--prompts", "4", "--speed-rows", "8"
    )
    assert "errors" not in results, results["errors"]
    gaps = results["logprob_gaps"]
    assert set(gaps) == {"engine", "hf_bf16", "hf_bf16_fp32_head", "hf_bf16_decode", "engine_fp32_logits"}
    # 4 prompts x up to 12 tokens, every sampled token once
    assert (
        all(0 < r["tokens"] <= 4 * 12 for r in gaps.values()) and gaps["engine"]["tokens"] == gaps["hf_bf16"]["tokens"]
    )
    assert gaps["engine"]["max"] < 1e-4 and gaps["engine_fp32_logits"]["max"] < 1e-4
    assert gaps["hf_bf16"]["mean"] > 1e-4 and gaps["hf_bf16_decode"]["mean"] > 1e-4  # bf16 rounding
    assert results["engine_within_hf_bf16"] == {"mean": True, "p99": True}
    paired = results["engine_minus_hf_bf16"]  # the engine's gap is about 0, so the difference is minus HF's
    assert paired["mean"] == pytest.approx(gaps["engine"]["mean"] - gaps["hf_bf16"]["mean"], abs=1e-6)
    assert paired["mean_interval_95"][0] <= paired["mean"] <= paired["mean_interval_95"][1] < 0
    assert paired["p99"] == pytest.approx(gaps["engine"]["p99"] - gaps["hf_bf16"]["p99"], abs=1e-6)
    engine, hf = results["greedy"]["engine"], results["greedy"]["hf_bf16"]
    assert (
        engine["full_match_share"] == 1
        and engine["mean_prefix"] == engine["mean_length"] == engine["reference_mean_length"]
    )
    assert 0 <= hf["full_match_share"] <= 1 and hf["mean_prefix"] <= min(
        hf["mean_length"], hf["reference_mean_length"]
    )
    speed = {(r["rows"], r["engine"]): r for r in results["speed"]}
    assert set(speed) == {(8, "paged"), (8, "hf")}
    for (rows, _), r in speed.items():
        assert "error" not in r and r["tokens_per_s"] > 0 and rows <= r["tokens"] <= rows * 8
        assert r["mean_length"] == r["tokens"] / rows and r["max_length"] <= 8
    assert "| engine | bf16_logits |" in stdout and "| 8x8 | hf |" in stdout


def test_check_real_model_agreement_counts_the_prefix_each_completion_shares():
    from benchmarks.rollout.check_real_model import agreement, paired_difference

    # row 0 differs by 0.1 on its first token, row 1 by 0.2 on its only one: 0.3 over 3 tokens; resampled rows give
    # 0.1 / 2 (row 0 alone) up to 0.2 / 1 (row 1 alone)
    ours, theirs = torch.tensor([[0.2, 0.1], [0.3, 9.0]]), torch.tensor([[0.1, 0.1], [0.1, 0.0]])
    paired = paired_difference(ours, theirs, torch.tensor([[True, True], [True, False]]))
    assert paired["mean"] == pytest.approx(0.1) and paired["ours_larger_share"] == pytest.approx(2 / 3)
    assert 0.05 - 1e-6 <= paired["mean_interval_95"][0] < paired["mean_interval_95"][1] <= 0.2 + 1e-6  # float32 inputs
    # p99 of ours {0.2, 0.1, 0.3} by linear interpolation 0.298, of theirs {0.1, 0.1, 0.1} 0.1
    assert paired["p99"] == pytest.approx(0.198, abs=1e-6)

    # prefixes 2 (third token differs), 2 (equal in full), 0, 1 (ours stops early)
    ours, reference = [[1, 2, 3], [1, 2], [5], [7]], [[1, 2, 4], [1, 2], [6, 7], [7, 8]]
    assert agreement(ours, reference) == {
        "mean_prefix": 5 / 4, "full_match_share": 1 / 4, "mean_length": 7 / 4, "reference_mean_length": 9 / 4,
    }  # fmt: skip


def test_check_launch_config_rollout_finds_zero3_first_rollout_equal_to_single_gpu_on_cpu(tmp_path):
    """The recipe's real loading path (transformers' zero.Init under DeepSpeed's ZeRO-3 plugin, the trainer's own
    `deepspeed.initialize`) with the engine in bf16 as on CUDA: the engine's snapshot, rotary tables, noise generator,
    prompts, sampled tokens and logprobs are bitwise `single_gpu`'s. With the CPU engine's own float32 the snapshot
    keeps `single_gpu`'s float32 weights but ZeRO-3's bf16 ones, and the comparison reports it."""
    pytest.importorskip("deepspeed")
    output = tmp_path / "configs.json"
    for engine_dtype, zero3_differs in (("bfloat16", set()), ("default", {"snapshot", "logprobs"})):
        command = [
            sys.executable, "-m", "benchmarks.multi_gpu.check_launch_config_rollout",
            "--configs", "single_gpu", "zero3", "--engine-dtype", engine_dtype, "--output", str(output),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        runs = json.loads(output.read_text())["runs"]
        compared = ("snapshot", "rotary", "rng_state", "prompts", "tokens", "logprobs")
        assert {c for c in compared if runs["zero3#1"][c] is not None} == zero3_differs, runs["zero3#1"]
        assert all(runs["single_gpu#0"][c] is None for c in compared)
        assert runs["zero3#1"]["generated_tokens"] == runs["single_gpu#0"]["generated_tokens"] > 0


def test_the_tiny_multi_gpu_bench_writes_outside_the_repository_unless_told():
    """`--tiny` is a smoke run: its JSON left an untracked file in benchmarks/results, among the measured ones."""
    from benchmarks.multi_gpu.bench_multi_gpu import output_path

    scratch = Path("scratch")
    assert (
        output_path(None, tiny=True, rollout=False, device="cpu", scratch=scratch)
        == scratch / "bench_multi_gpu_cpu.json"
    )
    measured = output_path(None, tiny=False, rollout=True, device="cuda", scratch=scratch)
    assert measured == ROOT / "benchmarks" / "results" / "bench_multi_gpu_rollout_cuda.json"
    assert output_path("here.json", tiny=True, rollout=False, device="cpu", scratch=scratch) == Path("here.json")


def test_bench_checkpoint_save_tiny_extrapolates_to_a_7b_save(tmp_path):
    """Qwen2.5-7B (configs/qwen2.5-7b.json: untied 152,064 x 3,584 embeddings, 28 layers) has 7,615,616,512
    parameters: its save at 6 bytes a parameter is 45,693,699,072 bytes; each measure's 7B time is its file time
    scaled by that size."""
    stdout, results = run_tiny("trainer.bench_checkpoint_save", tmp_path)
    assert results["saved_7b_bytes"] == 7_615_616_512 * 6
    assert results["bytes"] >= 8 * 2**20  # the tensor, plus torch.save's few hundred bytes
    assert set(results["seconds"]) == {"save_and_fsync", "sha256", "crc32"}
    assert all(math.isfinite(s) and s >= 0 for s in results["seconds"].values())
    seconds = results["seconds"]["sha256"]
    assert f"| sha256 | {seconds:.3f} | " in stdout
    assert f"| {results['saved_7b_bytes'] / results['bytes'] * seconds:.1f} |" in stdout
