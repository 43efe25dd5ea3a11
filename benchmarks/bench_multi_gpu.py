"""Data parallelism for DAPO: N ranks against 1 on the same generation batch, under DDP, ZeRO-2 and ZeRO-3.

    python benchmarks/bench_multi_gpu.py --processes 2                    # GPUs: ddp, zero2, zero3, Qwen2.5-1.5B arch
    python benchmarks/bench_multi_gpu.py --tiny --configs cpu_ddp         # CPU processes over gloo, tiny model

For each accelerate config it launches `multi_gpu_worker.py` once with 1 process and once with N, then reports the
relative difference of the parameter updates (‖Δ_N − Δ_1‖ / ‖Δ_1‖), the step-time speed-up and the peak memory per
rank. Prints a table last and writes `benchmarks/results/bench_multi_gpu_<device>.json`.
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


def launch(config: str, processes: int, model: str, output: Path, steps: int) -> dict:
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        "--num_processes", str(processes), "--main_process_port", str(free_port()),
        str(HERE / "multi_gpu_worker.py"), "--model", model, "--output", str(output), "--steps", str(steps),
    ]  # fmt: skip
    environment = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    result = subprocess.run(command, cwd=HERE, env=environment, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{config} with {processes} processes failed:\n{result.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{output}.rank{r}.json").read_text()) for r in range(processes)]
    return {"ranks": ranks, "update": torch.load(f"{output}.update.pt")}


def relative_difference(update: dict, reference: dict) -> float:
    difference = sum(((update[k] - reference[k]) ** 2).sum() for k in reference)
    return float((difference / sum((v**2).sum() for v in reference.values())).sqrt())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--configs", nargs="*", default=["ddp", "zero2", "zero3"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is the warm-up for timing)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = "tiny" if args.tiny else "qwen2.5-1.5b"
    folder = Path(tempfile.mkdtemp())
    rows = []
    for config in args.configs:
        one = launch(config, 1, model, folder / f"{config}-1", args.steps)
        many = launch(config, args.processes, model, folder / f"{config}-{args.processes}", args.steps)
        time_one = statistics.median(one["ranks"][0]["step_times_s"][1:] or one["ranks"][0]["step_times_s"])
        time_many = statistics.median(many["ranks"][0]["step_times_s"][1:] or many["ranks"][0]["step_times_s"])
        rows.append(
            {
                "config": config,
                "processes": args.processes,
                "update_relative_difference": relative_difference(many["update"], one["update"]),
                "step_s_1": time_one,
                "step_s_n": time_many,
                "speedup": time_one / time_many,
                "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in many["ranks"]],
                "peak_memory_gib_1": one["ranks"][0]["peak_memory_gib"],
            }
        )
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    output = Path(args.output or HERE / "results" / f"bench_multi_gpu_{device}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    print("| config | ranks | ‖ΔN−Δ1‖/‖Δ1‖ | step s (1) | step s (N) | speed-up | peak GiB per rank |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        memory = ", ".join(f"{m:.1f}" for m in r["peak_memory_gib_per_rank"] if m is not None) or "-"
        print(
            f"| {r['config']} | {r['processes']} | {r['update_relative_difference']:.2e} | {r['step_s_1']:.3f} | "
            f"{r['step_s_n']:.3f} | {r['speedup']:.2f} | {memory} |"
        )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
