"""The step benchmark runs end to end on the CPU (a smoke run, not a timing)."""

import json
import math
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_bench_step_tiny_writes_finite_ratios(tmp_path):
    output = tmp_path / "bench.json"
    command = [
        sys.executable, str(BENCHMARKS / "bench_step.py"), "--tiny", "--prompts", "4", "--generations", "4",
        "--new-tokens", "6", "--ga", "2", "--steps", "1", "--warmup", "1", "--output", str(output),
        "--sampling-fractions", "0.5", "--sampling-modes", "1.0:True", "auto:False", "--profile",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "| tiny | DAPO/TRL |" in result.stdout
    results = json.loads(output.read_text())
    ratios = results["models"]["tiny"]["ratio"]
    assert {"step_s", "generation_s", "train_s", "generation_tokens_per_s"} <= set(ratios)
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())
    for kind in ("trl", "dapo"):  # the parts of the rest of the step add up to it
        run = results["models"]["tiny"][kind]
        assert math.isclose(sum(run["rest_split_s"].values()), run["train_s"], rel_tol=1e-6, abs_tol=1e-9)
    for kind in ("trl", "dapo"):  # a profile of the first measured step of each trainer
        report = (tmp_path / f"profile_tiny_{kind}.txt").read_text()
        assert "aten::mm" in report and "(_generate_and_score_completions)" in report
    assert set(results["variants"]) == {"gradient_checkpointing", "lora_r16_all_linear"}
    sampling = results["sampling"]
    assert [(r["uninformative"], r["oversample"], r["keep_surplus"]) for r in sampling] == [
        (0.5, "1.0", True),
        (0.5, "auto", False),
    ]
    assert all(r["generated_groups_per_step"] > 0 and r["rounds_per_step"] >= 1 for r in sampling)


def test_multi_gpu_bench_on_cpu_processes_matches_one_rank(tmp_path):
    output = tmp_path / "multi.json"
    command = [
        sys.executable, str(BENCHMARKS / "bench_multi_gpu.py"), "--tiny", "--configs", "cpu_ddp", "--steps", "2",
        "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
    assert result.returncode == 0, result.stderr[-4000:]
    (row,) = json.loads(output.read_text())["rows"]
    assert row["processes"] == 2
    assert row["update_relative_difference"] < 1e-5  # 2 ranks make the 1-rank update, two steps running
    assert math.isfinite(row["speedup"]) and row["speedup"] > 0


def test_multi_gpu_rollout_bench_on_cpu_processes(tmp_path):
    """The `--rollout` runs (here without sharding: the CPU cannot run ZeRO or accelerate's FSDP) report every rank's
    generated tokens, with the engine where asked and TRL's path otherwise."""
    output = tmp_path / "rollout.json"
    command = [
        sys.executable, str(BENCHMARKS / "bench_multi_gpu.py"), "--tiny", "--rollout", "--rollout-runs",
        "cpu_ddp:engine", "cpu_ddp:trl", "--processes", "2", "--rows-per-step", "16", "--ga", "2", "--new-tokens", "4",
        "--steps", "2", "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=BENCHMARKS)
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
