"""The regime check: before any comparison, whether DAPO's pieces have something to act on at GRPO's start.

For each seed, from the study's own start point, naive GRPO (the ladder's first rung: the same trainer, sampling seed
and prompt order as its run in the study) trains on one generation batch at the regime's learning rate and at
neighbours of it. Its logs give the preconditions:

| precondition | measured on the first generation batch | what it is for |
|---|---|---|
| truncated share >= 10% | completions without an end token | overlong filtering, soft overlong punishment |
| clipped on one side >= 0.5% per update | tokens whose ratio left the range on the side that clips them, the larger side's mean over the updates | Clip-Higher (the clip must bind for a wider one to matter) |
| entropy >= 0.1 nats per token | the policy's entropy on its own rollouts at the first update (temperature 1) | the entropy collapse Clip-Higher is against |
| longest / shortest >= 4 | completion lengths within the batch | the token-level loss (per-sequence means weight tokens unevenly) |

Beside the start points, the first seed's is warm-started a second time in a process of its own, as a later call on
a fresh machine would, and the two weights' digests compared: a study split over several device calls depends on it
(a start point that does not reproduce sets its seed's earlier runs aside).

The entropy bound is five times where the first study's most trained seed sat (0.018 at its start, 0.012 after GRPO).
The upper side of the clip is reported apart: Clip-Higher moves only that bound, which binds only tokens with a
positive advantage whose probability can still rise by a fifth, so it is the smaller side where most samples are
wrong. Each precondition must hold on the mean over seeds; the table also says on how many seeds it holds alone. The
start points are the study's (same settings, same files), so the check's warm starts are not paid twice.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from trl_dapo.evaluation import OVERALL

from .config import StudyConfig
from .model import build_model, load_tokenizer, warm_start
from .store import model_dir, read_json, read_start, study_data, weights_digest, write_json
from .variants import VARIANTS, build_trainer


@dataclass(frozen=True)
class Precondition:
    key: str
    label: str
    threshold: float


PRECONDITIONS = (
    Precondition("truncated", "completions truncated (share)", 0.10),
    Precondition("clip_one_side", "tokens clipped on one side per update (share, the larger side's mean)", 0.005),
    Precondition("entropy", "rollout entropy at the first update (nats per token)", 0.1),
    Precondition("length_spread", "longest / shortest completion in the batch", 4.0),
)
# Also reported, not required: each side of the clip, how entropy moved over the batch, the rechecks.
REPORTED = (
    ("clip_high_mean", "tokens clipped above per update (share, mean over the batch): what Clip-Higher moves"),
    ("clip_low_mean", "tokens clipped below per update (share, mean over the batch)"),
    ("entropy_last", "rollout entropy at the batch's last update"),
    ("rechecked", "completions with a recheck (share)"),
    ("mean_length", "mean completion length"),
    ("informative_groups", "groups with some but not all samples right (share)"),
    ("solve_rate", "samples right (share)"),
)


def check_config(config: StudyConfig, learning_rate: float) -> StudyConfig:
    """The regime with one generation batch of training at `learning_rate` (no evaluation after it)."""
    batch = config.steps_per_generation
    return config.with_overrides(learning_rate=learning_rate, max_steps=batch, eval_every=batch)


def check_file(output: Path, seed: int, learning_rate: float) -> Path:
    return output / "check" / f"seed{seed}" / f"lr{learning_rate:.3g}.json"


def reproduce_file(output: Path, seed: int) -> Path:
    return output / "check" / f"seed{seed}" / "reproduce.json"


def measure(log_history: list[dict]) -> dict:
    """The preconditions' values from a one-batch GRPO run's logs: per update (clip fractions, entropy) and for the
    batch (its generation round's metrics are logged with the first update)."""
    updates = [
        {
            "step": entry["step"],
            "clip_low": entry["clip_ratio/low_mean"],
            "clip_high": entry["clip_ratio/high_mean"],
            "entropy": entry["entropy"],
        }
        for entry in log_history
        if "clip_ratio/high_mean" in entry
    ]
    first = next(entry for entry in log_history if "study/truncated" in entry)
    low, high = statistics.fmean(u["clip_low"] for u in updates), statistics.fmean(u["clip_high"] for u in updates)
    return {
        "updates": updates,
        "truncated": first["study/truncated"],
        "length_spread": first["study/length_spread"],
        "rechecked": first["study/rechecked"],
        "informative_groups": first["study/informative_groups"],
        "solve_rate": first["study/solve_rate"],
        "mean_length": first["completions/mean_length"],
        "clip_low_mean": low,
        "clip_high_mean": high,
        "clip_one_side": max(low, high),
        "entropy": updates[0]["entropy"],
        "entropy_last": updates[-1]["entropy"],
    }


def check_job(config: StudyConfig, output: Path, seed: int, learning_rate: float, memory_share: float) -> None:
    """One seed's generation batch of GRPO at `learning_rate`, recorded (kept when already recorded from this start
    point under these settings)."""
    settings = check_config(config, learning_rate)
    start, path = read_start(config, output, seed), check_file(output, seed, learning_rate)
    recorded = read_json(path)
    same = recorded and recorded["start_digest"] == start["digest"] and recorded["settings"] == settings.fingerprint()
    if same and recorded["status"] == "ok":
        print(f"[seed {seed}] check at lr {learning_rate:.3g} kept", flush=True)
        return
    began, trainer = time.perf_counter(), None
    record = {"seed": seed, "learning_rate": learning_rate, "start_digest": start["digest"]}
    record["settings"] = settings.fingerprint()
    try:
        data, tokenizer = study_data(settings), load_tokenizer(model_dir(output, seed))
        output_dir = output / "trainer" / f"seed{seed}" / f"check-lr{learning_rate:.3g}"
        trainer, _ = build_trainer(
            VARIANTS[0], settings, seed, model_dir(output, seed), tokenizer, data["train"], output_dir, memory_share
        )
        trainer.train()
        record |= {"status": "ok", **measure(trainer.state.log_history)}
    except Exception:
        record |= {"status": "failed", "error": traceback.format_exc()}
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    record["seconds"] = time.perf_counter() - began
    write_json(path, record)
    print(
        f"[seed {seed}] check at lr {learning_rate:.3g}: {record['status']} in {record['seconds']:.1f} s", flush=True
    )


def reproduce_job(config: StudyConfig, output: Path, seed: int) -> None:
    """The seed's start point warm-started a second time, in a process of its own beside the prepare phase's (with its
    deterministic kernels), and its weights' digest recorded: `summarize_check` compares it with the start point's,
    which says whether a fresh machine would resume this study. Kept when already recorded under these settings."""
    path, recorded = reproduce_file(output, seed), read_json(reproduce_file(output, seed))
    if recorded and recorded["settings"] == config.start_fingerprint():
        print(f"[seed {seed}] second warm start kept", flush=True)
        return
    model, began = output / "models" / f"reproduce-seed{seed}", time.perf_counter()
    build_model(model, config, seed)
    warm_start(model, config, set(study_data(config)["test"]["prompt"]), seed)
    record = {"seed": seed, "settings": config.start_fingerprint(), "digest": weights_digest(model)}
    shutil.rmtree(model)
    record["seconds"] = time.perf_counter() - began
    write_json(path, record)
    print(f"[seed {seed}] second warm start in {record['seconds']:.1f} s", flush=True)


def summarize_check(config: StudyConfig, output: Path, learning_rates: list[float]) -> dict:
    """Per learning rate: each precondition's mean over seeds, its per-seed values and whether it holds; the start
    points' held-out measurements beside them. `passed`: every precondition holds at the regime's learning rate."""
    starts = {seed: read_start(config, output, seed) for seed in config.seeds}
    result: dict = {"regime": config.name, "learning_rate": config.learning_rate, "by_learning_rate": {}}
    result["start_points"] = {
        seed: {key: start["start_point"][key] for key in ("entropy", "truncated", "rechecked", "mean_length")}
        | {"avg": start["start_point"][f"avg@{config.eval_k}"], "warm_start_steps": start["warm_start"]["steps"]}
        for seed, start in starts.items()
        if start is not None
    }
    for learning_rate in learning_rates:
        records = []
        for seed, start in starts.items():
            record = read_json(check_file(output, seed, learning_rate)) if start else None
            if record and record["status"] == "ok" and record["start_digest"] == start["digest"]:
                records.append(record)
        entry: dict = {"seeds": [r["seed"] for r in records], "missing": len(config.seeds) - len(records)}
        for key, _ in (*((p.key, p.label) for p in PRECONDITIONS), *REPORTED):
            values = [r[key] for r in records]
            entry[key] = {"mean": statistics.fmean(values) if values else None, "by_seed": values}
        entry["holds"] = {
            p.key: entry[p.key]["mean"] is not None and entry[p.key]["mean"] >= p.threshold for p in PRECONDITIONS
        }
        entry["seeds_holding"] = {
            p.key: sum(value >= p.threshold for value in entry[p.key]["by_seed"]) for p in PRECONDITIONS
        }
        result["by_learning_rate"][f"{learning_rate:.3g}"] = entry
    result["start_points_reproduce"] = {}
    for seed, start in starts.items():
        second = read_json(reproduce_file(output, seed))
        if start and second and second["settings"] == config.start_fingerprint():
            result["start_points_reproduce"][seed] = second["digest"] == start["digest"]
    chosen = result["by_learning_rate"].get(f"{config.learning_rate:.3g}")
    result["passed"] = bool(chosen and not chosen["missing"] and all(chosen["holds"].values()))
    return result


def format_check(summary: dict) -> str:
    """Markdown: one table per learning rate (the regime's marked), then the start points."""
    lines = [f"regime check ({summary['regime']}): at GRPO's start, first generation batch, mean over seeds"]
    for rate, entry in summary["by_learning_rate"].items():
        mark = " (the regime's)" if rate == f"{summary['learning_rate']:.3g}" else ""
        lines += ["", f"learning rate {rate}{mark}: seeds {entry['seeds']}, {entry['missing']} missing", ""]
        lines += ["| measure | mean | by seed | needs | holds (seeds) |", "|---|---|---|---|---|"]
        for p in PRECONDITIONS:
            value = entry[p.key]
            holds = "yes" if entry["holds"][p.key] else "NO"
            lines.append(
                f"| {p.label} | {_number(value['mean'])} | {', '.join(map(_number, value['by_seed']))} | "
                f">= {p.threshold:g} | {holds} ({entry['seeds_holding'][p.key]}/{len(value['by_seed'])}) |"
            )
        for key, label in REPORTED:
            value = entry[key]
            lines.append(f"| {label} | {_number(value['mean'])} | {', '.join(map(_number, value['by_seed']))} | | |")
    lines += ["", "| seed | warm-start steps | held-out avg | entropy | truncated | rechecked | mean length |"]
    lines.append("|---|---|---|---|---|---|---|")
    for seed, point in summary["start_points"].items():
        lines.append(
            f"| {seed} | {point['warm_start_steps']} | {point['avg'][OVERALL]:.3f} | {point['entropy']:.3f} | "
            f"{point['truncated']:.3f} | {point['rechecked']:.3f} | {point['mean_length']:.1f} |"
        )
    for seed, same in summary["start_points_reproduce"].items():
        outcome = "same weights" if same else "OTHER weights (run each seed's whole ladder in one call)"
        lines.append(f"start point of seed {seed} warm-started a second time in another process: {outcome}")
    verdict = "every precondition holds" if summary["passed"] else "NOT every precondition holds"
    lines += ["", f"at the regime's learning rate {summary['learning_rate']:g}: {verdict}"]
    return "\n".join(lines)


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
