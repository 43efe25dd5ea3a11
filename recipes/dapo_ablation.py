"""The DAPO paper's ablation (Table 1) in miniature, with held-out accuracy and seeds, in one command.

    .venv/bin/python recipes/dapo_ablation.py            # the study on one GPU (7 variants x 3 seeds, 6 workers)
    .venv/bin/python recipes/dapo_ablation.py --smoke    # the same pipeline on the CPU, tiny, in well under a minute

A Qwen2 of 17.7M parameters with a character tokenizer is built from scratch per seed, warm-started on worked
scratchpad additions to a moderate accuracy, then trained with RL by each variant of the ladder (`ablation/variants.py`):
TRL's GRPOTrainer as naive GRPO, DAPO's pieces added one at a time, full DAPO, and full DAPO on the paged rollout
engine. Rerunning the same command on the same OUTPUT does only the runs still missing (`ablation/study.py`). Writes
OUTPUT/ablation.json (settings, the time plan, versions, every run's curves and the summary),
OUTPUT/ablation.png, and prints the table; `docs/ablation.md` explains the method.
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
from ablation.config import SMOKE, StudyConfig
from ablation.plan import compare, estimate, format_plan
from ablation.report import format_table, plot, summarize
from ablation.study import launch_workers, load_seed_records
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
    parser.add_argument("--smoke", action="store_true", help="tiny CPU configuration (the test suite runs it)")
    parser.add_argument("--output", type=Path, help="default: outputs/ablation (outputs/ablation-smoke with --smoke)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--variants", nargs="+", choices=VARIANT_NAMES, help="default: all, in ladder order")
    parser.add_argument("--workers", type=int, help="processes sharing the device (default 6; 1: one at a time)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps per run (default 80)")
    parser.add_argument("--eval-every", type=int, help="optimizer steps between held-out evaluations (default 20)")
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument(
        "--report-only", action="store_true", help="summarise the runs already in --output, with their settings"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    output = args.output or Path("outputs") / ("ablation-smoke" if args.smoke else "ablation")
    if args.report_only:  # the settings the runs were made with
        config = StudyConfig.load(output / "study_config.json")
    else:
        config = (SMOKE if args.smoke else StudyConfig()).with_overrides(
            seeds=tuple(args.seeds) if args.seeds else None,
            variants=tuple(args.variants) if args.variants else None,
            workers=args.workers,
            max_steps=args.max_steps,
            eval_every=args.eval_every,
            device=args.device,
        )
        if config.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --smoke (CPU) or --device cpu.")
    plan = estimate(config)
    print(format_plan(plan), flush=True)
    began = time.perf_counter()
    cost = {variant.name: plan["runs"][variant.name]["total_s"] for variant in run_order(config)}
    exit_codes = [] if args.report_only else launch_workers(config, output, cost)
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
            "study_s": time.perf_counter() - began,
            "worker_exit_codes": exit_codes,
            "summary": summary,
            "seeds": records,
        }
    (output / "ablation.json").write_text(json.dumps(result, indent=2))
    print(format_table(summary))
    print(compare(plan, records))
    print(f"study: {result['study_s'] / 60:.1f} min; wrote {output / 'ablation.json'}")
    try:
        print(f"wrote {plot(config, records, output / 'ablation.png')}")
    except ImportError as error:  # a GPU image without matplotlib: the JSON has everything, plot it afterwards
        print(
            f"no plot ({error}): install matplotlib, then rerun with --report-only --output {output}", file=sys.stderr
        )
        return 1
    failures = [
        f"seed {r['seed']} {name}:\n{run['error']}"
        for r in records
        for name, run in r["runs"].items()
        if run["status"] != "ok"
    ]
    missing = sorted(set(config.seeds) - {r["seed"] for r in records})
    for failure in failures:
        print(failure, file=sys.stderr)
    if missing:
        print(f"no results for seeds {missing}: see {output / 'logs'}", file=sys.stderr)
    return 1 if failures or missing or any(exit_codes) else 0


if __name__ == "__main__":
    sys.exit(main())
