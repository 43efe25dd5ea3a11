"""Data parallelism for DAPO: N ranks against 1 on the same generation batch, under DDP, ZeRO-2 and ZeRO-3; and
generation speed with sharded weights.

    python3 -m benchmarks.bench_multi_gpu --processes 2                    # GPUs: ddp, zero2, zero3, Qwen2.5-1.5B arch
    python3 -m benchmarks.bench_multi_gpu --tiny --configs cpu_ddp         # CPU processes over gloo, tiny model
    python3 -m benchmarks.bench_multi_gpu --rollout --processes 1          # GPUs: the engine under ZeRO-3 / ZeRO-2 /
                                                                          # FSDP2 vs TRL's path under ZeRO-3, 0.5B arch

For each accelerate config it launches `multi_gpu_worker.py` once with 1 process and once with N, then reports the
relative difference of the parameter updates (‖Δ_N − Δ_1‖ / ‖Δ_1‖), the step-time speed-up and the peak memory per
rank. With `--rollout` it launches each `config:generation` of `--rollout-runs` with N processes generating
`--new-tokens` tokens per completion (DAPO steps on the model's own completions) and reports generated tokens/s over
all ranks (the slowest rank's generation time), the step time, the largest engine-vs-training logprob gap (it stays
at rounding size only if the engine decodes with the training weights) and the peak memory per rank. Prints a table
last and writes `benchmarks/results/bench_multi_gpu[_rollout]_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
ACCELERATE_CONFIGS = HERE.parent / "recipes" / "accelerate"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(config: str, processes: int, model: str, output: Path, steps: int, *worker_args: str) -> list[dict]:
    """Run the worker under an accelerate config; return each rank's report. From the repository root, where the
    configs' DeepSpeed JSON paths start."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        "--num_processes", str(processes), "--main_process_port", str(free_port()),
        "-m", "benchmarks.multi_gpu_worker", "--model", model, "--output", str(output), "--steps", str(steps),
        *worker_args,
    ]  # fmt: skip
    environment = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    result = subprocess.run(command, cwd=HERE.parent, env=environment, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{config} with {processes} processes failed:\n{result.stderr[-4000:]}")
    return [json.loads(Path(f"{output}.rank{r}.json").read_text()) for r in range(processes)]


def relative_difference(update: dict, reference: dict) -> float:
    difference = sum(((update[k] - reference[k]) ** 2).sum() for k in reference)
    return float((difference / sum((v**2).sum() for v in reference.values())).sqrt())


def measured(values: list[float]) -> list[float]:
    """The steps after the first (warm-up: compilation, graph capture), or the only one."""
    return values[1:] or values


def memory_cell(row: dict) -> str:
    return ", ".join(f"{m:.1f}" for m in row["peak_memory_gib_per_rank"] if m is not None) or "-"


def update_equivalence(args, model: str, folder: Path) -> list[dict]:
    rows = []
    for config in args.configs:
        one = launch(config, 1, model, folder / f"{config}-1", args.steps)
        many = launch(config, args.processes, model, folder / f"{config}-{args.processes}", args.steps)
        time_one = statistics.median(measured(one[0]["step_times_s"]))
        time_many = statistics.median(measured(many[0]["step_times_s"]))
        update_one = torch.load(folder / f"{config}-1.update.pt")
        update_many = torch.load(folder / f"{config}-{args.processes}.update.pt")
        rows.append(
            {
                "config": config,
                "processes": args.processes,
                "update_relative_difference": relative_difference(update_many, update_one),
                "step_s_1": time_one,
                "step_s_n": time_many,
                "speedup": time_one / time_many,
                "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in many],
                "peak_memory_gib_1": one[0]["peak_memory_gib"],
            }
        )
    print("| config | ranks | ‖ΔN−Δ1‖/‖Δ1‖ | step s (1) | step s (N) | speed-up | peak GiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['processes']} | {r['update_relative_difference']:.2e} | {r['step_s_1']:.3f} | "
            f"{r['step_s_n']:.3f} | {r['speedup']:.2f} | {memory_cell(r)} |"
        )
    return rows


def rollout_speed(args, model: str, folder: Path) -> list[dict]:
    rows = []
    geometry = ["--rows-per-step", str(args.rows_per_step), "--ga", str(args.ga), "--new-tokens", str(args.new_tokens)]
    for run in args.rollout_runs:
        config, generation = run.split(":")
        output = folder / f"{config}-{generation}"
        ranks = launch(config, args.processes, model, output, args.steps, "--generation", generation, *geometry)
        generation_s = max(statistics.mean(measured(r["generation_s"])) for r in ranks)  # the slowest rank's
        gaps = [m["logprob_gap_max"] for r in ranks for m in r["metrics"] if "logprob_gap_max" in m]
        rows.append(
            {
                "config": config,
                "generation": generation,
                "processes": args.processes,
                "rollout_engine": all(r["rollout_engine"] for r in ranks),
                "generation_s": generation_s,
                "generation_tokens_per_s": sum(r["generated_tokens_per_step"] for r in ranks) / generation_s,
                "step_s": statistics.median(measured(ranks[0]["step_times_s"])),
                "logprob_gap_max": max(gaps) if gaps else None,
                "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in ranks],
            }
        )
    trl = next((r for r in rows if r["generation"] == "trl"), None)  # the baseline: the first run on TRL's path
    baseline = f"vs TRL's path ({trl['config']})" if trl else "vs TRL's path"
    print(f"| config | generation | ranks | generation s | generated tok/s | {baseline} | step s | logprob gap max | peak GiB per rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        speedup = f"{r['generation_tokens_per_s'] / trl['generation_tokens_per_s']:.1f}×" if trl else ""
        gap = f"{r['logprob_gap_max']:.3f}" if r["logprob_gap_max"] is not None else "-"
        print(
            f"| {r['config']} | {r['generation']} | {r['processes']} | {r['generation_s']:.3f} | "
            f"{r['generation_tokens_per_s']:,.0f} | {speedup} | {r['step_s']:.3f} | {gap} | {memory_cell(r)} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--configs", nargs="*", default=["ddp", "zero2", "zero3"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is the warm-up for timing)")
    parser.add_argument("--rollout", action="store_true", help="generation speed instead of update equivalence")
    parser.add_argument(
        "--rollout-runs", nargs="*", default=["zero3:engine", "zero2:engine", "fsdp2:engine", "zero3:trl"]
    )
    parser.add_argument("--rows-per-step", type=int, default=128, help="--rollout: completions per optimizer step")
    parser.add_argument("--ga", type=int, default=4, help="--rollout: gradient accumulation steps")
    parser.add_argument("--new-tokens", type=int, default=256, help="--rollout: tokens per completion")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = "tiny" if args.tiny else "qwen2.5-0.5b" if args.rollout else "qwen2.5-1.5b"
    folder = Path(tempfile.mkdtemp())
    rows = rollout_speed(args, model, folder) if args.rollout else update_equivalence(args, model, folder)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    name = f"bench_multi_gpu{'_rollout' if args.rollout else ''}_{device}.json"
    output = Path(args.output or HERE / "results" / name)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
