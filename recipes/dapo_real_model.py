"""DAPO against GRPO on a small pretrained model (SmolLM2-135M-Instruct), in one command on one GPU.

    python3 recipes/dapo_real_model.py --model SmolLM2-135M-Instruct.Q4_1.gguf --time-budget 780
    python3 recipes/dapo_real_model.py --report --output outputs/real-model   # the tables and the PNG, anywhere
    python3 recipes/dapo_real_model.py --smoke                                # the pipeline on the CPU, a tiny model

1. The model is loaded once (a GGUF file, dequantised, or a model folder) and saved as a float32 safetensors copy
   in OUTPUT/model, which every process loads.
2. The grid (`real_model/grid.py`): the base model's avg@16 and pass@16 on every task family x prompt style x
   temperature, sampled by the paged engine; the pick by the issue's rule goes to OUTPUT/pick.json with its reason.
3. The runs (`real_model/runs.py`): DAPO and DAPOTrainer with GRPO's settings for each seed, and TRL's GRPOTrainer
   with its defaults for one, all at once as separate processes sharing the device, each evaluated every few steps.
4. The report (`real_model/report.py`): the tables, OUTPUT/study.png and OUTPUT/study.json (settings, environment,
   grid, pick, every run's record and the summary: the file to keep).

Rerunning the same command on the same OUTPUT keeps the model copy, the grid cells and the finished runs, and restarts
the runs a time budget stopped (or that failed) from the model copy. `docs/real-model.md` explains the method.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_dapo
from ablation.store import write_json
from dapo_ablation import environment
from real_model.config import RUN_KINDS, STUDY, RealModelConfig, smoke
from real_model.grid import measure_grid, pick
from real_model.report import format_report, plot, seeds_of, summarize
from real_model.runs import is_done, model_copy
from real_model.scoring import EngineScorer
from trl_dapo.gguf import gguf_location, load_gguf_causal_lm, load_gguf_tokenizer
from trl_dapo.tiny_model import build_tiny_model

RECIPES = Path(__file__).resolve().parent
DEVICE_USABLE = 0.9  # of the device's memory, for the run processes together
CUDA_CONTEXT_BYTES = 0.75 * 2**30  # per process, outside its allocator's cap
GRID_MEMORY_FRACTION = 0.8
REPORT_MARGIN_S = 20.0  # of a time budget, kept for the report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        type=Path,
        help="a GGUF file or a model folder (needed until OUTPUT/model exists; --smoke: a tiny model by default)",
    )
    parser.add_argument("--output", type=Path, help="default: outputs/real-model (-smoke with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="the pipeline on the CPU, tiny (the test suite runs it)")
    parser.add_argument("--report", action="store_true", help="only the report, from what OUTPUT holds")
    parser.add_argument("--time-budget", type=float, help="seconds this call may take; rerun for the rest")
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--device", choices=("cuda", "cpu"))
    return parser.parse_args(argv)


def study_config(args: argparse.Namespace) -> RealModelConfig:
    return (smoke(STUDY) if args.smoke else STUDY).with_overrides(
        learning_rate=args.learning_rate,
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        seeds=tuple(args.seeds) if args.seeds else None,
        device=args.device,
    )


def save_model_copy(source: Path | None, target: Path) -> None:
    """The model as float32 safetensors with its tokenizer, once: every later process loads this copy."""
    if (target / "config.json").exists():
        return
    if source is None:
        raise SystemExit(f"--model: give the GGUF file or model folder to start from ({target} does not exist yet).")
    location = gguf_location(str(source))
    if location is not None:
        model = load_gguf_causal_lm(*location, dtype=torch.float32)
        tokenizer = load_gguf_tokenizer(*location)
    elif source.is_dir():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        raise SystemExit(f"--model {source}: neither a .gguf file nor a model folder.")
    if tokenizer.pad_token_id is None:  # the engine and TRL pad with it; the end token serves (SmolLM2's is both)
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def run_grid(config: RealModelConfig, output: Path) -> dict:
    """Every grid cell (measured or kept), and the pick, written to OUTPUT/pick.json."""
    device = torch.device(config.device)
    model = AutoModelForCausalLM.from_pretrained(model_copy(output), dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_copy(output))
    scorer = EngineScorer(
        model, tokenizer, config.k, config.max_completion_length, config.engine_max_rows, GRID_MEMORY_FRACTION,
        config.device,
    )  # fmt: skip
    cells = measure_grid(config, output, model, tokenizer, scorer)
    chosen = pick(config, cells)
    write_json(output / "pick.json", chosen)
    print(f"picked {chosen['cell']}: {chosen['reason']}", flush=True)
    if not chosen["in_band"]:
        print(f"WARNING: no grid cell met the rule; {chosen['cell']} is the nearest.", file=sys.stderr)
    del model, scorer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return chosen


def memory_share(config: RealModelConfig, processes: int) -> float:
    """Each run process's share of the device (its allocator's cap and its engines' budget); 1 on the CPU."""
    if config.device != "cuda":
        return 1.0
    total = torch.cuda.get_device_properties(0).total_memory
    return (DEVICE_USABLE * total / processes - CUDA_CONTEXT_BYTES) / total


def launch_runs(config: RealModelConfig, output: Path, deadline: float | None) -> list[int]:
    """Every unfinished run at once, each its own process; their exit codes."""
    jobs = [(k, s) for k in RUN_KINDS for s in seeds_of(config, k) if not is_done(config, output, k, s)]
    if not jobs:
        return []
    if deadline is not None and time.time() > deadline:
        print(f"{len(jobs)} runs left for the next call: the grid used the time budget", flush=True)
        return []
    share = memory_share(config, len(jobs))
    package_root = str(Path(trl_dapo.__file__).resolve().parent.parent)  # the workers import the same trl_dapo
    paths = [str(RECIPES), package_root, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    env.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(config.torch_threads))  # six engines compile at once
    # HF generate's growing KV cache fragmented TRL's run until its share ran out (3 of 9.4 GiB reserved, unused)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    (output / "logs").mkdir(parents=True, exist_ok=True)
    processes = []
    for kind, seed in jobs:
        command = [sys.executable, "-m", "real_model.runs", str(output), kind, str(seed), "--memory-share", str(share),
                   *(["--deadline", str(deadline)] if deadline is not None else [])]  # fmt: skip
        with (output / "logs" / f"{kind}-seed{seed}.log").open("a") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    print(f"{len(jobs)} runs started, {share:.3f} of the device each", flush=True)
    return [process.wait() for process in processes]


def bundle(config: RealModelConfig, output: Path, summary: dict) -> dict:
    """Everything the study measured, in one file without the model (the one to keep under benchmarks/results/)."""
    cells = [json.loads(path.read_text()) for path in sorted((output / "grid").glob("*.json"))]
    runs = {path.stem: json.loads(path.read_text()) for path in sorted((output / "runs").glob("*.json"))}
    return {
        "environment": json.loads((output / "environment.json").read_text()),
        "settings": asdict(config),
        "grid": cells,
        "pick": json.loads((output / "pick.json").read_text()),
        "runs": runs,
        "summary": summary,
    }


def report(config: RealModelConfig, output: Path) -> int:
    summary = summarize(config, output)
    (output / "study.json").write_text(json.dumps(bundle(config, output, summary), indent=2))
    print(format_report(config, output, summary))
    try:
        print(f"wrote {plot(config, output, output / 'study.png')} and {output / 'study.json'}")
    except ImportError as error:  # a GPU image without matplotlib: the JSON has everything, plot it afterwards
        print(f"no plot ({error}): install matplotlib, then rerun with --report --output {output}", file=sys.stderr)
    return 0 if summary["complete"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.time() + args.time_budget - REPORT_MARGIN_S if args.time_budget else None
    output = args.output or Path("outputs") / ("real-model-smoke" if args.smoke else "real-model")
    if args.report:
        return report(RealModelConfig.load(output / "study_config.json"), output)
    config = study_config(args)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke (CPU) or --device cpu.")
    output.mkdir(parents=True, exist_ok=True)
    config.save(output / "study_config.json")
    began = time.perf_counter()
    (output / "environment.json").write_text(json.dumps(environment(config.device), indent=2))
    if args.smoke and args.model is None:  # the pipeline needs no download: a tiny random model stands in
        args.model = Path(build_tiny_model(output / "tiny-model"))
    save_model_copy(args.model, model_copy(output))
    run_grid(config, output)
    print(f"grid done in {time.perf_counter() - began:.0f} s", flush=True)
    codes = launch_runs(config, output, deadline)
    print(f"runs done in {time.perf_counter() - began:.0f} s (exit codes {codes})", flush=True)
    return report(config, output) or int(any(codes))


if __name__ == "__main__":
    sys.exit(main())
