"""The DAPO paper's ablation (Table 1) in small, with held-out accuracy, mechanism metrics and seeds, in one command.

    .venv/bin/python recipes/dapo_ablation.py --check            # the paper regime's preconditions (run first)
    .venv/bin/python recipes/dapo_ablation.py                    # the study: 8 variants x 5 seeds on one GPU, 6 workers
    .venv/bin/python recipes/dapo_ablation.py --regime miniature # the first study's settings
    .venv/bin/python recipes/dapo_ablation.py --smoke            # the same pipeline on the CPU, tiny, in well under a minute

A Qwen2 of 17.7M parameters with a character tokenizer is built from scratch per seed, warm-started on worked
scratchpad additions, then trained with RL by each variant of the ladder (`ablation/variants.py`): TRL's GRPOTrainer
as naive GRPO, DAPO's pieces added one at a time, full DAPO, full DAPO on the paged rollout engine, and that with
partial rollouts. The regimes (`ablation/config.py`): `paper` (default), where each piece has something to act on,
and `miniature`. Rerunning the same command on the same OUTPUT does only what is still missing (`ablation/study.py`);
`--time-budget` ends a call by itself with what finished written. Writes OUTPUT/ablation.json (settings, the time and
memory plans, versions, every run's curves and the summary), OUTPUT/ablation.png, and prints the tables;
`docs/ablation.md` explains the method.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import torch

from ablation.check import check_config, format_check, summarize_check
from ablation.config import REGIMES, StudyConfig, smoke
from ablation.plan import MemoryPlanError, compare, estimate, format_plan, memory_plan, shared
from ablation.report import format_mechanisms, format_table, format_targets, plot, summarize
from ablation.study import (
    REPORT_MARGIN_S,
    Launcher,
    device_memory_bytes,
    launch_workers,
    load_seed_records,
    prepare_start_points,
)
from ablation.variants import VARIANT_NAMES, run_order

PACKAGES = ("torch", "transformers", "trl", "accelerate", "trl-dapo")


def environment(device: str) -> dict:
    """When, where and with what the study ran."""
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=40"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
    ).stdout.strip()
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device,
        "python": sys.version.split()[0],
        "versions": versions,
        "commit": commit or None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=sorted(REGIMES), default="paper", help="named settings (default: paper)")
    parser.add_argument("--smoke", action="store_true", help="the regime, tiny, on the CPU (the test suite runs it)")
    parser.add_argument("--check", action="store_true", help="measure the regime's preconditions at GRPO's start")
    parser.add_argument(
        "--check-learning-rates",
        type=float,
        nargs="+",
        help="with --check: learning rates to measure (default: the regime's, a third of it and three times it)",
    )
    parser.add_argument("--output", type=Path, help="default: outputs/ablation-REGIME (-smoke with --smoke)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, help="default: all, in ladder order")
    parser.add_argument("--workers", type=int, help="processes sharing the device (default 6; 1: one at a time)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, help="optimizer steps between held-out evaluations")
    parser.add_argument("--learning-rate", type=float, help="the RL learning rate, for every variant")
    parser.add_argument(
        "--warm-start-target",
        type=float,
        help="probe greedy accuracy at which the warm start stops (new start points)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds this call may take: no job starts that would end past it (less a margin for the report); "
        "rerun the same command for the rest",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="summarise the runs already in --output, with their settings"
    )
    return parser.parse_args(argv)


def study_config(args: argparse.Namespace) -> StudyConfig:
    regime = REGIMES[args.regime]
    return (smoke(regime) if args.smoke else regime).with_overrides(
        seeds=tuple(args.seeds) if args.seeds else None,
        variants=tuple(args.variants) if args.variants else None,
        workers=args.workers,
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        learning_rate=args.learning_rate,
        sft_target_accuracy=args.warm_start_target,
        device=args.device,
    )


def plan_memory(config: StudyConfig) -> dict | None:
    """The memory plan for the configured workers on this device (None on the CPU); exits when it cannot fit."""
    device_bytes = device_memory_bytes(config)
    if device_bytes is None:
        return None
    try:
        return memory_plan(config, device_bytes, config.workers)
    except MemoryPlanError as error:
        raise SystemExit(str(error)) from error


def run_check(
    config: StudyConfig, args: argparse.Namespace, output: Path, deadline: float | None, began: float
) -> int:
    """The regime check: start points, one generation batch of GRPO per seed and learning rate, the table."""
    rates = args.check_learning_rates or [config.learning_rate / 3, config.learning_rate, 3 * config.learning_rate]
    rates = sorted({float(f"{rate:.3g}") for rate in rates})
    plan = estimate(config)
    print(
        f"regime check: {len(config.seeds)} seeds x learning rates {rates}; about {plan['check_s']:.0f} s per job alone"
    )
    launcher = Launcher(config, output, deadline)
    # the first seed's start point is made twice: would a fresh machine reproduce it?
    codes = prepare_start_points(launcher, list(config.seeds), second_warm_start=config.seeds[0])
    jobs = [f"{seed}:{rate!r}" for rate in rates for seed in config.seeds]
    processes = min(config.workers, len(jobs))
    codes += launcher.phase("check", [jobs[i::processes] for i in range(processes)])
    summary = summarize_check(config, output, rates)
    summary |= {
        **environment(config.device),
        "settings": {f"{rate:.3g}": asdict(check_config(config, rate)) for rate in rates},
        "worker_exit_codes": codes,
        "check_s": time.perf_counter() - began,
    }
    (output / "regime_check.json").write_text(json.dumps(summary, indent=2))
    print(format_check(summary))
    print(
        f"wrote {output / 'regime_check.json'}; job time planned alone {plan['check_s']:.0f} s x {shared(processes):.2f} shared"
    )
    return 0 if summary["passed"] else 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    deadline = time.time() + args.time_budget - REPORT_MARGIN_S if args.time_budget else None
    suffix = "-smoke" if args.smoke else ""
    output = args.output or Path("outputs") / f"ablation-{args.regime}{suffix}"
    if args.report_only:  # the settings the runs were made with
        config = StudyConfig.load(output / "study_config.json")
    else:
        config = study_config(args)
        if config.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke (CPU) or --device cpu.")
    memory = plan_memory(config)
    if args.check:
        return run_check(config, args, output, deadline, began)
    plan = estimate(config)
    print(format_plan(plan, memory), flush=True)
    cost = {variant.name: plan["runs"][variant.name]["total_s"] for variant in run_order(config)}
    exit_codes = [] if args.report_only else launch_workers(config, output, cost, deadline)
    records = load_seed_records(config, output)
    summary = summarize(config, records)
    previous = output / "ablation.json"
    if args.report_only and previous.exists():  # when, where and how long the study ran stay as recorded
        result = {**json.loads(previous.read_text()), "summary": summary, "seeds": records}
    else:
        result = {
            **environment(config.device),
            "settings": asdict(config),
            "plan": plan,
            "memory_plan": memory,
            "study_s": time.perf_counter() - began,
            "worker_exit_codes": exit_codes,
            "summary": summary,
            "seeds": records,
        }
    (output / "ablation.json").write_text(json.dumps(result, indent=2))
    print(format_table(summary))
    print(format_mechanisms(summary))
    print(format_targets(summary))
    print(compare(plan, records))
    print(f"this call: {(time.perf_counter() - began) / 60:.1f} min; wrote {output / 'ablation.json'}")
    try:
        print(f"wrote {plot(config, records, output / 'ablation.png')}")
    except ImportError as error:  # a GPU image without matplotlib: the JSON has everything, plot it afterwards
        print(
            f"no plot ({error}): install matplotlib, then rerun with --report-only --output {output}", file=sys.stderr
        )
        return 1
    for failure in summary["failures"]:
        print(f"FAILED seed {failure['seed']} {failure['variant']} ({failure['attempts']} attempts):\n{failure['error']}",
              file=sys.stderr)  # fmt: skip
    if not summary["complete"]:
        left = len(summary["left"])
        print(
            f"study incomplete: {len(summary['failures'])} runs failed, {left} not run yet"
            + (" (rerun the same command for the rest)" if left else ""),
            file=sys.stderr,
        )
    return 0 if summary["complete"] and not any(exit_codes) else 1


if __name__ == "__main__":
    sys.exit(main())
