"""Data parallelism for DAPO: N ranks against 1 on the same generation batch, under DDP, ZeRO-2 and ZeRO-3; and
generation speed with sharded weights.

    # GPUs: ddp, zero2, zero3, Qwen2.5-1.5B arch
    python3 -m benchmarks.multi_gpu.bench_multi_gpu --processes 2
    # CPU processes over gloo, tiny model
    python3 -m benchmarks.multi_gpu.bench_multi_gpu --tiny --configs cpu_ddp
    # GPUs: the engine under ZeRO-3 / ZeRO-2 / FSDP2 vs TRL's path under ZeRO-3, 0.5B arch
    python3 -m benchmarks.multi_gpu.bench_multi_gpu --rollout --processes 1
    # every launch config at DAPO's lengths (1.5B arch, up to 4,096 tokens)
    python3 -m benchmarks.multi_gpu.bench_multi_gpu --rollout --variable-lengths --processes 1

For each accelerate config it launches `multi_gpu_worker.py` once with 1 process and once with N, then reports the
relative difference of the parameter updates (‖Δ_N − Δ_1‖ / ‖Δ_1‖), the step-time speed-up and the peak memory per
rank. With `--rollout` it launches each `config:generation` of `--rollout-runs` with N processes generating
`--new-tokens` tokens per completion (DAPO steps on the model's own completions) and reports generated tokens/s over
all ranks (the slowest rank's generation time) and per GPU, the step time (against `single_gpu`'s when it ran), the
training time (the step past generating and scoring its batch), the largest engine-vs-training logprob gap (it stays
at rounding size only if the engine decodes with the training weights) and the peak memory per rank. Prints a table
last and writes `benchmarks/results/bench_multi_gpu[_rollout]_<device>.json` (`--tiny`: in a temporary folder, printed;
`--output` chooses).
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

ROOT = Path(__file__).parents[2]  # the repository root: the ranks run from it
ACCELERATE_CONFIGS = ROOT / "recipes" / "accelerate"


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
        "-m", "benchmarks.multi_gpu.multi_gpu_worker",
        "--model", model, "--output", str(output), "--steps", str(steps), *worker_args,
    ]  # fmt: skip
    environment = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=1800)
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


def rollout_speed(args, model: str, folder: Path, save) -> list[dict]:
    """Each `config:generation` run, `save`d as soon as it is measured (a call cut short keeps what it measured)."""
    rows = []
    geometry = ["--rows-per-step", str(args.rows_per_step), "--ga", str(args.ga), "--new-tokens", str(args.new_tokens)]
    geometry += ["--variable-lengths"] * args.variable_lengths + [
        "--gradient-checkpointing"
    ] * args.gradient_checkpointing
    for run in args.rollout_runs:
        config, generation = run.split(":")
        output = folder / f"{config}-{generation}"
        ranks = launch(config, args.processes, model, output, args.steps, "--generation", generation, *geometry)
        generation_s = max(statistics.mean(measured(r["generation_s"])) for r in ranks)  # the slowest rank's
        step_s = statistics.median(measured(ranks[0]["step_times_s"]))
        batch_s = max(statistics.mean(measured(r["generate_and_score_s"])) for r in ranks)
        gaps = [m["logprob_gap_max"] for r in ranks for m in r["metrics"] if "logprob_gap_max" in m]
        tokens = sum(r["generated_tokens_per_step"] for r in ranks)
        rows.append(
            {
                "config": config,
                "generation": generation,
                "processes": args.processes,
                "rollout_engine": all(r["rollout_engine"] for r in ranks),
                "generated_tokens_per_step": tokens,
                "generation_s": generation_s,
                "generation_tokens_per_s": tokens / generation_s,
                "generation_tokens_per_s_per_gpu": tokens / generation_s / args.processes,
                "step_s": step_s,
                "training_s": step_s - batch_s,  # the step past generating, scoring and dealing its batch
                "logprob_gap_max": max(gaps) if gaps else None,
                "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in ranks],
            }
        )
        save(rows)
    # the baselines: the first run on TRL's path, and the one-GPU config
    trl = next((r for r in rows if r["generation"] == "trl"), None)
    single = next((r for r in rows if r["config"] == "single_gpu"), None)
    print(
        "| config | generation | ranks | generated tokens per step | generation s | generated tok/s per GPU | "
        f"{'vs TRL' if trl else ''} | step s | {'step / single_gpu' if single else ''} | training s | "
        "logprob gap max | peak GiB per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        versus_trl = f"{r['generation_tokens_per_s'] / trl['generation_tokens_per_s']:.1f}×" if trl else ""
        versus_single = f"{r['step_s'] / single['step_s']:.2f}×" if single else ""
        gap = f"{r['logprob_gap_max']:.3f}" if r["logprob_gap_max"] is not None else "-"
        print(
            f"| {r['config']} | {r['generation']} | {r['processes']} | {r['generated_tokens_per_step']:,.0f} | "
            f"{r['generation_s']:.2f} | {r['generation_tokens_per_s_per_gpu']:,.0f} | {versus_trl} | {r['step_s']:.2f} | "
            f"{versus_single} | {r['training_s']:.2f} | {gap} | {memory_cell(r)} |"
        )
    return rows


def output_path(output: str | None, tiny: bool, rollout: bool, device: str, scratch: Path) -> Path:
    """`--output`, else `benchmarks/results/` for a measurement and the run's scratch folder for a `--tiny` smoke run
    (which would otherwise leave an untracked file among the measured results)."""
    name = f"bench_multi_gpu{'_rollout' if rollout else ''}_{device}.json"
    return Path(output) if output else (scratch if tiny else ROOT / "benchmarks" / "results") / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--configs", nargs="*", default=["ddp", "zero2", "zero3"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is the warm-up for timing)")
    parser.add_argument("--rollout", action="store_true", help="generation speed instead of update equivalence")
    parser.add_argument(
        "--rollout-runs",
        nargs="*",
        default=None,
        help="config:generation runs (default: zero3:engine zero2:engine fsdp2:engine zero3:trl; with "
        "--variable-lengths every config on the engine, single_gpu first)",
    )
    parser.add_argument(
        "--variable-lengths",
        action="store_true",
        help="--rollout: lengths as the model samples them up to --new-tokens (default 4,096 there), on the "
        "Qwen2.5-1.5B architecture with the 2,048-token vocabulary, gradient checkpointing on",
    )
    parser.add_argument("--model", default=None, help="a config of benchmarks/configs (default: by mode)")
    parser.add_argument("--rows-per-step", type=int, default=128, help="--rollout: completions per optimizer step")
    parser.add_argument("--ga", type=int, default=4, help="--rollout: gradient accumulation steps")
    parser.add_argument("--new-tokens", type=int, default=None, help="--rollout: tokens per completion (256)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    args.gradient_checkpointing = args.variable_lengths
    if args.rollout_runs is None:
        configs = ["single_gpu", "zero2", "fsdp2", "zero3", "ddp"]  # the 1.3x target's first
        default_runs = [f"{c}:engine" for c in configs] if args.variable_lengths else None
        args.rollout_runs = default_runs or ["zero3:engine", "zero2:engine", "fsdp2:engine", "zero3:trl"]
    if args.new_tokens is None:
        args.new_tokens = 4096 if args.variable_lengths else 256
    model = "qwen2.5-1.5b-v2048" if args.variable_lengths else "qwen2.5-0.5b" if args.rollout else "qwen2.5-1.5b"
    model = "tiny" if args.tiny else args.model or model
    folder = Path(tempfile.mkdtemp())
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    output = output_path(args.output, args.tiny, args.rollout, device, folder)
    output.parent.mkdir(parents=True, exist_ok=True)
    setup = {"model": model, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}

    def save(rows: list[dict]) -> None:
        output.write_text(json.dumps({**setup, "command": sys.argv[1:], "rows": rows}, indent=2))

    rows = rollout_speed(args, model, folder, save) if args.rollout else update_equivalence(args, model, folder)
    save(rows)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
