"""`bench_step.py`'s trainers each in a process of its own (`isolated.py`): vLLM colocated in a trainer cannot be torn
down inside its process, and a trainer that ran out of memory leaves its allocator behind. The parent runs
`bench_step` again for each kind, with its own arguments and that kind and model alone, and merges the child's result
into its own. A kind that runs out of memory runs again at the next micro-batch of `--micro-batches` (gradient
accumulation raised so the batch stays the same); a vLLM kind under `--vllm-sleep auto` first runs again at the same
micro-batch with vLLM asleep between rollouts. Every attempt is recorded: where TRL runs out of memory, at which
micro-batch and vLLM setting, and the ones it runs at. The parent itself never touches the device."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.core.isolated import OK, OUT_OF_MEMORY, Outcome, already_done, run_isolated


def micro_batch_ladder(rows_per_step: int, ga: int, asked: list[int] | None) -> list[int]:
    """The micro-batches to try in order: `asked` (each must divide the rows of a step), else the one `--ga` gives."""
    ladder = asked or [rows_per_step // ga]
    wrong = [size for size in ladder if size < 1 or rows_per_step % size]
    if wrong:
        raise SystemExit(
            f"--micro-batches {wrong}: each must divide the {rows_per_step} completions of a step (--prompts x "
            "--generations), e.g. 32 16 8 for 128."
        )
    return ladder


def rungs(ladder: list[int], vllm_sleep: str | None) -> list[dict]:
    """The settings to try in order: each micro-batch of `ladder`, for a vLLM kind (`vllm_sleep` not None) with vLLM
    awake or asleep as `--vllm-sleep` says; "auto": awake first, then asleep at the same micro-batch (sleep mode
    frees vLLM's memory for the training passes at a cost per rollout, so it is used only where memory needs it)."""
    if vllm_sleep is None:
        return [{"micro_batch": size} for size in ladder]
    sleeps = {"auto": [False, True], "on": [True], "off": [False]}[vllm_sleep]
    return [{"micro_batch": size, "vllm_sleep": sleep} for size in ladder for sleep in sleeps]


def climb(attempt: Callable[[dict], Outcome], ladder: list[dict], timeout: float) -> dict:
    """`attempt(rung)` down `ladder` (`rungs`) until one does not run out of memory. The record: that attempt's result
    (measured) or outcome, its settings, and every attempt's outcome."""
    tried = []
    for rung in ladder:
        outcome = attempt(rung)
        tried.append({**rung, "status": outcome.status, "seconds": outcome.seconds})
        if outcome.status != OUT_OF_MEMORY:
            break
    record = outcome.result if outcome.status == OK else outcome.record(timeout)
    return {**record, **rung, "ladder": tried}


def save_checkpoint(name: str, folder: Path, device: str, timeout: float) -> None:
    """The random-init model `name` saved to `folder` (bf16 on CUDA) unless one is there, in a process of its own
    (written beside it, then renamed: a save cut short leaves no folder that looks whole)."""
    if (folder / "config.json").exists():
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    dtype = "bfloat16" if device == "cuda" else "float32"
    command = [
        sys.executable, "-m", "benchmarks.core.save_random_model", "--model", name, "--output", str(partial),
        "--dtype", dtype, "--device", device,
    ]  # fmt: skip
    outcome = run_isolated(command, partial.with_suffix(".result.json"), timeout)
    if not (partial / "config.json").exists():
        raise SystemExit(f"saving {name} to {folder} failed: {outcome.status} {outcome.error or ''}")
    partial.rename(folder)


def isolated_comparison(
    name: str, kinds: list[str], args, rows_per_step: int, out: dict, save, output: Path, vllm_kinds: tuple[str, ...]
) -> None:
    """Each kind of `kinds` for model `name` in a child `bench_step`, down the ladder of micro-batches (and, for
    `vllm_kinds`, vLLM awake or asleep); `out` gets each kind's record (kinds `--skip-done` finds in `out` are left as
    they are) and is saved after each."""
    ladder = micro_batch_ladder(rows_per_step, args.ga, args.micro_batches)
    for kind in kinds:
        if args.skip_done and already_done(out.get(kind), args.timeout):
            continue

        def attempt(rung: dict, kind: str = kind) -> Outcome:
            micro_batch = rung["micro_batch"]
            child = output.parent / f".{output.stem}.{name}.{kind}.mb{micro_batch}.json"
            command = [
                sys.executable, "-m", "benchmarks.trainer.bench_step", *sys.argv[1:], "--child", "--models", name,
                "--kinds", kind, "--sections", "comparison", "--ga", str(rows_per_step // micro_batch),
                "--output", str(child),
            ]  # fmt: skip
            if "vllm_sleep" in rung:
                command += ["--vllm-sleep", "on" if rung["vllm_sleep"] else "off"]
            if args.checkpoints:
                command += ["--checkpoints", args.checkpoints]
            outcome = run_isolated(command, child, args.timeout)
            if outcome.status == OK:
                outcome.result = outcome.result["models"][name][kind]
            child.unlink(missing_ok=True)
            return outcome

        out[kind] = climb(attempt, rungs(ladder, args.vllm_sleep if kind in vllm_kinds else None), args.timeout)
        save()


def previous_models(path: Path) -> dict:
    """The per-model results a run before this one left in `path` (`--skip-done`), or none."""
    return json.loads(path.read_text()).get("models", {}) if path.exists() else {}
