"""Measurements in processes of their own (`benchmarks/core/isolated.py`): how a child's end becomes an outcome, what a
rerun skips, the micro-batch ladder of `bench_step.py`'s isolated kinds, and the pieces of `bench_peers.py` that need
no engine (shapes, the tail, what a timed-out measurement keeps, the shared lengths' draw, vLLM's arguments built
without vLLM); `bench_step.py` running TRL's continuous batching beside DAPO, each in its own process, on the CPU."""

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.core.isolated import ERROR, OK, OUT_OF_MEMORY, TIMEOUT, Outcome, already_done, run_isolated
from benchmarks.core.workload import geometric_lengths
from benchmarks.peers.bench_peers import cut_off, parse_shape
from benchmarks.peers.peer_engines import (
    tail_seconds,
    tail_steps,
    vllm_capture_sizes,
    vllm_engine_kwargs,
    vllm_logprobs,
    vllm_sampling_kwargs,
)
from benchmarks.trainer.step_isolation import climb, micro_batch_ladder, rungs

ROOT = Path(__file__).parent.parent


def child(tmp_path, body: str, timeout: float = 60) -> Outcome:
    """Run `body` as a child that may report progress and write its result to `result.json`."""
    script = (
        "import sys, time\nfrom benchmarks.core.isolated import report_progress, write_result\nresult = sys.argv[1]\n"
    )
    command = [sys.executable, "-c", script + textwrap.dedent(body), str(tmp_path / "result.json")]
    return run_isolated(command, tmp_path / "result.json", timeout)


def test_a_child_that_finishes_gives_its_result_and_its_progress(tmp_path):
    outcome = child(tmp_path, 'report_progress(result, phase="measuring")\nwrite_result(result, {"tokens": 12})')
    assert (outcome.status, outcome.result, outcome.progress["phase"]) == (OK, {"tokens": 12}, "measuring")


def test_a_child_past_its_time_is_stopped_with_its_children_and_keeps_its_progress(tmp_path):
    """The child starts a grandchild (as vLLM starts its engine core) and hangs: both are ended at the limit, and the
    record says how far the child got."""
    body = """
        import subprocess
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        report_progress(result, phase="measuring", measuring_since=time.time(), grandchild=grandchild.pid)
        time.sleep(600)
    """
    outcome = child(tmp_path, body, timeout=8)
    assert outcome.status == TIMEOUT and 8 <= outcome.seconds < 60
    assert outcome.progress["phase"] == "measuring" and outcome.finished_at > outcome.progress["measuring_since"]
    record = outcome.record(timeout=8)
    assert (record["status"], record["timeout_s"], "error" in record) == (TIMEOUT, 8, False)
    assert ended(outcome.progress["grandchild"])  # the grandchild was ended too


def test_a_parent_ended_by_sigterm_stops_its_child_and_grandchild_first(tmp_path):
    """`timeout` ends a benchmark with SIGTERM while its child measures: the child's session (the child, its
    grandchild) is stopped before the parent exits, and does not go on holding the device."""
    parent = f"""
        import sys
        from pathlib import Path
        from benchmarks.core.isolated import run_isolated
        body = (
            "import subprocess, sys, time\\n"
            "from benchmarks.core.isolated import report_progress\\n"
            "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\\n"
            "report_progress(sys.argv[1], grandchild=grandchild.pid)\\n"
            "time.sleep(600)\\n"
        )
        run_isolated([sys.executable, "-c", body, "{tmp_path / "result.json"}"], Path("{tmp_path / "result.json"}"), 600)
    """
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(parent)], cwd=ROOT)
    progress = tmp_path / "result.progress.json"
    deadline = time.time() + 60
    while not progress.exists() and time.time() < deadline:
        time.sleep(0.2)
    grandchild = json.loads(progress.read_text())["grandchild"]
    process.terminate()
    assert process.wait(timeout=60) == 128 + 15
    assert ended(grandchild)


def ended(pid: int) -> bool:
    """Whether process `pid` is gone or dead (a zombie its new parent has not reaped yet)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_child_that_runs_out_of_memory_is_told_from_one_that_fails(tmp_path):
    oom = child(
        tmp_path, 'print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")\nsys.exit(1)'
    )
    assert oom.status == OUT_OF_MEMORY and "Tried to allocate" in oom.error
    failed = child(tmp_path, 'raise ValueError("no such field")')
    assert failed.status == ERROR and "ValueError: no such field" in failed.error
    silent = child(tmp_path, "pass")  # exit status 0 but no result written: a failure, not a measurement
    assert silent.status == ERROR


def test_the_device_peak_is_the_largest_reading_of_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in `nvidia-smi` (no GPU here): the one-shot query reads 3 GiB used of 80, the loop 1, 6 then 2 GiB."""
    from benchmarks.core.timing import DeviceMemoryPeak

    script = tmp_path / "nvidia-smi"
    script.write_text('#!/bin/sh\ncase "$*" in *loop-ms*) printf "1024\\n6144\\n2048\\n"; exec sleep 30;; '
                      '*) echo "3072, 81920";; esac\n')  # fmt: skip
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with DeviceMemoryPeak() as device:
        for _ in range(100):  # the loop's readings arrive on a thread
            if device.peak == 6.0:
                break
            time.sleep(0.05)
        assert device.total == 80.0
        assert device.mark() == 6.0  # since it opened: 3 (opening), 1, 6, 2
        assert device.mark() == 3.0  # since the last mark: the mark's own reading
    assert device.peak == 6.0


def test_a_rerun_skips_measured_and_out_of_memory_records_and_a_timeout_under_as_long_a_limit():
    assert already_done({"tokens_per_s": 1.0}, timeout=60)  # a measured record (no status) counts as done
    assert already_done({"status": OK}, 60) and already_done({"status": OUT_OF_MEMORY}, 60)
    assert already_done({"status": TIMEOUT, "timeout_s": 60}, 60)
    assert not already_done({"status": TIMEOUT, "timeout_s": 60}, 120)  # a longer limit may measure it
    assert not already_done({"status": ERROR}, 60) and not already_done(None, 60)


def test_the_ladder_goes_down_until_a_micro_batch_fits_and_records_each_attempt():
    ends = {32: OUT_OF_MEMORY, 16: OUT_OF_MEMORY, 8: OK, 4: OK}
    tried = []

    def attempt(rung: dict) -> Outcome:
        tried.append(rung["micro_batch"])
        result = {"step_s": 2.0} if ends[rung["micro_batch"]] == OK else None
        return Outcome(ends[rung["micro_batch"]], seconds=rung["micro_batch"], result=result)

    record = climb(attempt, rungs([32, 16, 8, 4], vllm_sleep=None), timeout=60)
    assert tried == [32, 16, 8]
    assert (record["step_s"], record["micro_batch"]) == (2.0, 8)
    assert [(rung["micro_batch"], rung["status"]) for rung in record["ladder"]] == [
        (32, OUT_OF_MEMORY), (16, OUT_OF_MEMORY), (8, OK),
    ]  # fmt: skip
    ends[8] = ends[4] = OUT_OF_MEMORY  # out of memory all the way down: the record is the last attempt's outcome
    record = climb(attempt, rungs([32, 16, 8, 4], vllm_sleep=None), timeout=60)
    assert (record["status"], record["micro_batch"], len(record["ladder"])) == (OUT_OF_MEMORY, 4, 4)


def test_a_vllm_kind_sleeps_only_where_the_awake_run_runs_out_of_memory():
    """`--vllm-sleep auto`: at each micro-batch vLLM awake first, then asleep between rollouts, before a smaller
    micro-batch; here the awake run does not fit at 16, the sleeping one does: the kind is measured asleep at 16."""
    assert rungs([16, 8], "auto") == [
        {"micro_batch": 16, "vllm_sleep": False}, {"micro_batch": 16, "vllm_sleep": True},
        {"micro_batch": 8, "vllm_sleep": False}, {"micro_batch": 8, "vllm_sleep": True},
    ]  # fmt: skip
    assert rungs([16], "on") == [{"micro_batch": 16, "vllm_sleep": True}]
    assert rungs([16], "off") == [{"micro_batch": 16, "vllm_sleep": False}]

    def attempt(rung: dict) -> Outcome:
        fits = rung["vllm_sleep"]
        return Outcome(OK if fits else OUT_OF_MEMORY, 1.0, result={"step_s": 3.0} if fits else None)

    record = climb(attempt, rungs([16, 8], "auto"), timeout=60)
    assert (record["micro_batch"], record["vllm_sleep"], record["step_s"]) == (16, True, 3.0)
    assert [(rung["vllm_sleep"], rung["status"]) for rung in record["ladder"]] == [(False, OUT_OF_MEMORY), (True, OK)]


def test_the_ladder_takes_micro_batches_that_divide_the_batch():
    assert micro_batch_ladder(128, ga=4, asked=None) == [32]
    assert micro_batch_ladder(128, ga=4, asked=[32, 16, 8]) == [32, 16, 8]
    with pytest.raises(SystemExit, match=r"--micro-batches \[48\]"):
        micro_batch_ladder(128, ga=4, asked=[32, 48])


def test_the_tail_counts_the_steps_and_seconds_with_under_a_quarter_of_the_rows_running():
    # 8 rows: a quarter is 2, so the tail starts when the 2nd longest row ends (running drops to 1)
    assert tail_steps([5, 100, 40, 7, 60, 9, 8, 6]) == 100 - 60
    assert tail_steps([10] * 8) == 0
    assert tail_steps([3, 9]) == 0  # 2 rows: the longest alone is already a quarter or more
    # finish times: the 2nd latest of 8 at 6.0 s, the last at 9.5 s
    assert tail_seconds([1.0, 2.0, 9.5, 3.0, 6.0, 2.5, 4.0, 1.5]) == 3.5
    assert tail_seconds([]) is None


def test_a_shape_names_its_model_rows_lengths_and_prompts():
    shape = parse_shape("qwen2.5-1.5b-v2048@128x8192")
    assert (shape.model, shape.rows, shape.new_tokens, shape.prompt_tokens, shape.lengths, shape.math) == (
        "qwen2.5-1.5b-v2048", 128, 8192, 256, "shared", False,
    )  # fmt: skip
    fixed = parse_shape("qwen2.5-7b@64x512-fixed")
    assert (fixed.prompt_tokens, fixed.lengths) == (32, "fixed")
    assert parse_shape("qwen2.5-1.5b-v2048@128x8192p64-free").lengths == "free"
    assert parse_shape("smollm2@512x256-math").math and parse_shape("tiny@4x6p8-fixed").prompt_tokens == 8


def test_a_measurement_cut_off_keeps_its_finished_calls_and_bounds_the_call_it_was_in():
    """A child ended by its time limit: 2 measured calls finished (1,000 and 1,100 tok/s); the third started at t=100
    and was cut at t=140, its engine having reported 30 rows and 12,000 tokens finished. Of that call's 20,000 tokens
    (the shared lengths' sum), at most 20,000 / 40 s = 500 tok/s were done and at least 12,000 / 40 s = 300."""
    calls = [{"tokens_per_s": 1000.0}, {"tokens_per_s": 1100.0}]
    progress = {"calls": calls, "repeat": 2, "measuring_since": 100.0, "rows_done": 30, "tokens_done": 12000,
                "time": 130.0}  # fmt: skip
    found = cut_off(Outcome(TIMEOUT, 200.0, progress=progress, finished_at=140.0), most_tokens=20000)
    assert found == {
        "completed_calls": calls, "cut_call_s": 40.0, "tokens_per_s_below": 500.0,
        "tokens_done_by_deadline": 12000, "rows_done_by_deadline": 30, "tokens_per_s_at_least": 300.0,
    }  # fmt: skip
    # an engine that reports no rows (the paged engine, vLLM): the upper bound alone
    quiet = {key: progress[key] for key in ("calls", "repeat", "measuring_since", "time")}
    assert "tokens_per_s_at_least" not in cut_off(Outcome(TIMEOUT, 200.0, progress=quiet, finished_at=140.0), 20000)
    # cut between two calls (the third not begun): the finished calls alone
    between = {**quiet, "repeat": 1}
    assert cut_off(Outcome(TIMEOUT, 200.0, progress=between, finished_at=140.0), 20000) == {"completed_calls": calls}
    assert cut_off(Outcome(TIMEOUT, 60.0, progress={"phase": "building"}, finished_at=60.0), 20000) == {}


def test_shared_lengths_are_geometric_in_the_end_tokens_probability_and_capped():
    """A random-init model over 2,048 tokens ends a row with probability p = 1/2,048 per step: a length is geometric
    (P(L > k) = (1 - p)^k), cut at 8,192. Its mean is sum_{k<8192} (1-p)^k = (1 - (1-p)^8192) / p = 2,010.5, and a
    share (1-p)^8191 = 0.0183 of rows reach the cap; 100,000 draws are within 1.5% and 0.002 of those."""
    p = 1 / 2048
    lengths = torch.tensor(geometric_lengths(100_000, 8192, p, seed=0), dtype=torch.float64)
    assert lengths.min() >= 1 and lengths.max() == 8192
    assert lengths.mean().item() == pytest.approx((1 - (1 - p) ** 8192) / p, rel=0.015)
    assert (lengths == 8192).double().mean().item() == pytest.approx((1 - p) ** 8191, abs=0.002)
    assert geometric_lengths(64, 512, p, seed=3) == geometric_lengths(64, 512, p, seed=3)  # drawn once, the same
    assert geometric_lengths(64, 512, p, seed=3) != geometric_lengths(64, 512, p, seed=4)
    assert geometric_lengths(4, 10, 0.999999, seed=0) == [1, 1, 1, 1]  # the end token at once


def test_vllm_is_built_for_offline_throughput_at_the_shapes_rows():
    """`vllm.LLM`'s arguments at 1,024 rows: every row in one batch, graphs captured up to 1,024 sequences (vLLM's
    default pattern 1, 2, 4, 8..248 by 8, 256..1,024 by 16: 3 + 31 + 49 sizes), async scheduling, 16,384 batched
    tokens, no tokenizer with exact lengths; at 100 rows the pattern stops at 96 and 100 is added."""
    kwargs = vllm_engine_kwargs(Path("/models/m"), rows=1024, memory_fraction=0.9, exact_lengths=True)
    sizes = kwargs.pop("compilation_config")
    assert kwargs == {
        "model": "/models/m", "dtype": "bfloat16", "seed": 0, "gpu_memory_utilization": 0.9,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True, "max_num_seqs": 1024,
        "max_num_batched_tokens": 16384, "async_scheduling": True, "skip_tokenizer_init": True,
    }  # fmt: skip
    assert sizes["max_cudagraph_capture_size"] == 1024 == max(sizes["cudagraph_capture_sizes"])
    assert len(sizes["cudagraph_capture_sizes"]) == 3 + 31 + 49 and sizes["cudagraph_capture_sizes"][:5] == [
        1,
        2,
        4,
        8,
        16,
    ]
    assert vllm_capture_sizes(100)[-3:] == [88, 96, 100] and vllm_capture_sizes(1) == [1]
    free = vllm_engine_kwargs(Path("m"), rows=32768, memory_fraction=0.5, exact_lengths=False)
    assert free["max_num_batched_tokens"] == 32768 and free["skip_tokenizer_init"] is False  # its end token needed


def test_vllm_samples_each_row_to_its_length_without_detokenizing():
    exact = vllm_sampling_kwargs(3, 8192, [5, 8192, 1], logprobs=True)
    common = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "detokenize": False, "logprobs": 0,
              "flat_logprobs": True, "ignore_eos": True}  # fmt: skip
    assert exact == [{**common, "max_tokens": 5}, {**common, "max_tokens": 8192}, {**common, "max_tokens": 1}]
    free = vllm_sampling_kwargs(2, 512, None, logprobs=False)
    assert free == [{"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "detokenize": False, "max_tokens": 512}] * 2


def test_vllms_logprobs_are_read_from_its_flat_form_or_per_position():
    """The sampled tokens' logprobs, every completion after the other: a flat output's column, or (an older vLLM)
    the sampled token's entry of each position's dictionary."""

    def output(token_ids, logprobs):
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids, logprobs=logprobs)])

    flat = output([7, 9], SimpleNamespace(logprobs=[-0.5, -1.25], start_indices=[0, 1]))
    nested = output([3], [{3: SimpleNamespace(logprob=-2.0)}])
    assert vllm_logprobs([flat, nested]).tolist() == [-0.5, -1.25, -2.0]


@pytest.mark.parametrize(
    ("text", "says"),
    [("qwen2.5-1.5b@128", "expected MODEL@ROWSxNEW"), ("llama-9@8x8", "MODEL is a config"),
     ("qwen2.5-0.5b@8x8-math", "-math"), ("smollm2@8x8p16-math", "-math takes no pPROMPT"),
     ("tiny@8x8-fixed-free", "expected MODEL@ROWSxNEW")],
)  # fmt: skip
def test_a_malformed_shape_is_refused_with_what_is_expected(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        parse_shape(text)


def test_bench_step_isolates_a_kind_and_a_rerun_keeps_it(tmp_path):
    """`--isolate` on the CPU: `trl_cb` (GRPOTrainer with `use_transformers_continuous_batching=True`) in a process of
    its own at micro-batch 8, the first of the ladder, merged into the comparison; a rerun with `--skip-done` keeps it
    and trains nothing (the child's trainer log, `train_runtime`, is not printed again)."""
    output = tmp_path / "step.json"
    command = [
        sys.executable, "-m", "benchmarks.trainer.bench_step", "--tiny", "--variable-lengths", "--kinds", "trl_cb",
        "--isolate", "--prompts", "2", "--generations", "4", "--ga", "1", "--new-tokens", "12", "--warmup", "0",
        "--steps", "1", "--micro-batches", "8", "4", "--output", str(output),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(output.read_text())["models"]["tiny"]["trl_cb"]
    assert run["micro_batch"] == 8 and [rung["status"] for rung in run["ladder"]] == [OK]
    assert 8 <= run["completion_tokens_per_step"] <= 8 * 12  # 8 rows, nothing pinned: up to 12 tokens each
    assert run["generation_s"] > 0 and run["rollout_engine"] is None  # TRL generated, not trl-dapo's engine
    assert "| tiny | trl_cb (micro-batch 8, warm-up 0, sdpa) |" in done.stdout and "train_runtime" in done.stdout
    again = subprocess.run([*command, "--skip-done"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert again.returncode == 0 and "train_runtime" not in again.stdout
    assert json.loads(output.read_text())["models"]["tiny"]["trl_cb"] == run


def test_dapo_steps_are_set_against_each_trl_peer_that_was_measured():
    """DAPO's step over each TRL peer measured (`trl_cb` timed out: none), per generated token too (`dapo` generated
    250,000 tokens a step, `trl_vllm` and `dapo_vllm` the same 320,000), and `dapo_vllm` over `trl_vllm`: the same
    completions, so the step's ratio is the training side's alone plus vLLM's run-to-run spread."""
    from benchmarks.trainer.bench_step import add_ratios

    def run(step: float, generation: float, tokens: int) -> dict:
        return {"step_s": step, "generation_s": generation, "train_s": step - generation, "train_median_s": 1.0,
                "generation_tokens_per_s": tokens / generation, "step_us_per_token": 1e6 * step / tokens}  # fmt: skip

    out = {"dapo": run(30.0, 20.0, 250_000), "trl_vllm": run(40.0, 25.0, 320_000), "dapo_vllm": run(32.0, 25.0, 320_000),
           "trl_cb": {"status": TIMEOUT, "timeout_s": 540}, "dapo_partial_kept": run(18.0, 8.0, 250_000)}  # fmt: skip
    add_ratios(out)
    assert out["ratio_dapo_over_trl_vllm"]["step_s"] == 0.75 and out["ratio_dapo_over_trl_vllm"]["train_s"] == 10 / 15
    assert out["ratio_dapo_over_trl_vllm"]["step_us_per_token"] == pytest.approx((30 / 250_000) / (40 / 320_000))
    assert out["ratio_dapo_partial_kept_over_trl_vllm"]["generation_s"] == 8 / 25
    assert (
        out["ratio_dapo_vllm_over_trl_vllm"]["step_s"] == 32 / 40
        and out["ratio_dapo_vllm_over_trl_vllm"]["train_s"] == 7 / 15
    )
    assert "ratio_dapo_vllm_over_trl_cb" not in out  # dapo_vllm is set against GRPOTrainer on the same vLLM alone
    assert out["ratio_dapo_partial_kept"]["step_s"] == 18 / 30  # against plain DAPO
    assert not [key for key in out if key.startswith("ratio_") and key.endswith("trl_cb")]  # timed out: no ratio


def test_what_flash_attention_could_save_trl_is_bounded_by_dapos_packed_over_padded_passes():
    """DAPO trained its rows packed in 2 s against 10 s padded (x 0.2): TRL's forward passes on SDPA (15 s training +
    5 s logprob pass of a 40 s step) would take at least 4 s on FlashAttention, so its step at least 24 s, 75 us per
    generated token over 320,000; DAPO's 120 us per token is then at most 1.6x it. A TRL kind that ran on
    FlashAttention gets no bound, nor does any kind of a run without `dapo_padded`."""
    from benchmarks.trainer.bench_step import add_ratios

    def run(step: float, train: float, logprob: float, tokens: int, attention: str = "sdpa") -> dict:
        return {"step_s": step, "generation_s": step - train - logprob, "train_s": train, "train_median_s": train,
                "logprob_pass_s": logprob, "generation_tokens_per_s": 1.0, "completion_tokens_per_step": tokens,
                "step_us_per_token": 1e6 * step / tokens, "attention": attention, "peak_memory_gib": 1.0}  # fmt: skip

    out = {"dapo": run(30.0, 2.0, 0.0, 250_000), "dapo_padded": run(38.0, 10.0, 0.0, 250_000),
           "trl_vllm": run(40.0, 15.0, 5.0, 320_000), "dapo_vllm": run(32.0, 7.0, 0.0, 320_000),
           "trl_cb": run(90.0, 15.0, 0.0, 320_000, attention="flash_attention_2")}  # fmt: skip
    add_ratios(out)
    bound = out["flash_bound_dapo_over_trl_vllm"]
    assert bound["packed_over_padded"] == pytest.approx(0.2) and bound["trl_step_s_at_least"] == pytest.approx(24.0)
    assert bound["trl_step_us_per_token_at_least"] == pytest.approx(75.0)
    assert bound["step_us_per_token"] == pytest.approx(1.6)
    assert out["flash_bound_dapo_vllm_over_trl_vllm"]["step_us_per_token"] == pytest.approx(100.0 / 75.0)
    assert not [key for key in out if key.startswith("flash_bound_") and key.endswith("trl_cb")]
    del out["dapo_padded"]
    out = {key: value for key, value in out.items() if not key.startswith(("ratio", "flash_bound_", "dapo_logprob"))}
    add_ratios(out)
    assert not [key for key in out if key.startswith("flash_bound_")]


def test_fair_step_settings_are_refused_where_kinds_would_differ():
    """`--fair`: per-kind step counts, unpinned lengths, a ladder of micro-batches or fewer than 1 warm-up and 2
    measured steps are refused before anything runs; without them every kind gets 1 warm-up and 2 measured steps."""
    from benchmarks.trainer.bench_step import fair_counts

    def args(**given) -> argparse.Namespace:
        return argparse.Namespace(**{"fair": True, "warmup": None, "steps": None, "pin_lengths": None,
                                     "micro_batches": [16], **given})  # fmt: skip

    warmup, steps = fair_counts(args(), variable=True)
    assert set(warmup.values()) == {1} and set(steps.values()) == {2}
    for given, says in [
        ({"warmup": ["1", "trl_vllm=0"]}, r"drop \['trl_vllm=0'\]"),
        ({"pin_lengths": False}, "drop --no-pin-lengths"),
        ({"micro_batches": [32, 16]}, "give --micro-batches one size"),
        ({"steps": ["1"]}, "2 measured steps"),
        ({"warmup": ["0"]}, "at least 1 warm-up step"),
    ]:
        with pytest.raises(SystemExit, match=says):
            fair_counts(args(**given), variable=True)
    warmup, steps = fair_counts(args(fair=False, warmup=["1", "trl=0"]), variable=True)  # not fair: as asked
    assert (warmup["trl"], warmup["dapo"], steps["dapo"]) == (0, 1, 1)
