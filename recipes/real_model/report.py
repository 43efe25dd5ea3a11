"""What the study reports, from its output folder alone (so results fetched from the GPU are reported anywhere).

Every comparison is paired by seed (each arm's run of a seed shares its data order, its sampling seed and its
evaluation noise with the other arms' runs of that seed), over the runs of both arms that finished, with the 95% t
interval of the mean difference (`ablation.report.spread`) and the number of seeds at which an interval of the same
spread would clear the target's margin (`seeds_to_decide`):

- the area under the held-out avg@k curve over the run's optimizer steps (the primary measure: at a ceiling every
  method ties at the last step, the area counts how soon it was reached), as a mean accuracy over the run;
- avg@k at the fixed early step (the pick's `early_step`), and at the last step;
- the same area over training wall-clock (evaluations excluded), up to the shorter run of the pair: dynamic sampling
  generates more per step, so per second is a comparison of its own;
- the area under the accuracy among completions that have an `Answer:` line (the answer-line lesson measured apart);
- held-out entropy at the last step (Clip-Higher's claim) and the held-out truncated share after the start (the
  overlong shaping's).

A target is True or False only where it was measured; it is None ("not measured") where too few pairs finished or its
reference level was never reached (a time to a level a run starts at is 0 and says nothing).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from ablation.report import crossing, spread, t_quantile
from ablation.store import read_json

from .config import (
    DAPO,
    GRPO,
    NO_DYNAMIC_SAMPLING,
    NO_OVERLONG,
    PARTIAL,
    RUN_KINDS,
    SYMMETRIC_CLIP,
    TRL_KINDS,
    RealModelConfig,
)
from .runs import run_file

PARTIAL_MARGIN = -0.02  # the issue's: partial rollouts cost no learning when the AUC interval's lower end is above
WALL_CLOCK_LEVEL = 0.9  # issue 50's: the held-out avg@k whose training wall-clock the TRL arms are compared at
MAX_SEEDS = 10_000

Value = Callable[[dict], float | None]


def accuracy(metric: str) -> Value:
    return lambda point: point[metric]["all"]


def field(name: str) -> Value:
    return lambda point: point.get(name)


def area(curve: list[dict], x: str, y: Value, end: float) -> float | None:
    """The mean of `y` over `x` in [0, end]: the trapezoid rule over the evaluation points, the last segment cut at
    `end` by linear interpolation; None where a value is missing or `end` is 0."""
    points = [(point[x], y(point)) for point in curve]
    if end <= 0 or any(value is None for _, value in points) or points[-1][0] < end:
        return None
    total = 0.0
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 >= end:
            break
        if x1 > end:
            y1, x1 = y0 + (y1 - y0) * (end - x0) / (x1 - x0), end
        total += (x1 - x0) * (y0 + y1) / 2
    return total / end


def at_step(curve: list[dict], y: Value, step: float) -> float | None:
    return next((y(point) for point in curve if point["step"] == step), None)


def seeds_to_decide(differences: list[float], margin: float) -> int | None:
    """The fewest seeds at which a paired 95% interval with these differences' mean and spread has its lower end above
    `margin`; None where the mean is not above it (no number of seeds would do) or fewer than 2 were measured."""
    if len(differences) < 2:
        return None
    mean, std = statistics.fmean(differences), statistics.stdev(differences)
    if mean <= margin:
        return None
    for n in range(2, MAX_SEEDS):
        if t_quantile(0.95, n - 1) * std / math.sqrt(n) < mean - margin:
            return n
    return None


def measures(metric: str, early: int) -> dict[str, Callable[[dict, dict], float | None]]:
    """Each paired measure of a run over the pair's horizon (`step`, `wall_clock_s`)."""
    acc = accuracy(metric)

    def later_truncated(run: dict, horizon: dict) -> float | None:
        values = [p.get("truncated") for p in run["curve"] if 0 < p["step"] <= horizon["step"]]
        return statistics.fmean(values) if values and None not in values else None

    return {
        "auc_steps": lambda run, h: area(run["curve"], "step", acc, h["step"]),
        "early": lambda run, h: at_step(run["curve"], acc, early),
        "final": lambda run, h: at_step(run["curve"], acc, h["step"]),
        "auc_wall_clock": lambda run, h: area(run["curve"], "wall_clock_s", acc, h["wall_clock_s"]),
        "line_accuracy_auc": lambda run, h: area(run["curve"], "step", field("line_accuracy"), h["step"]),
        "entropy_last": lambda run, h: at_step(run["curve"], field("entropy"), h["step"]),
        "truncated_after_start": later_truncated,
        "train_s": lambda run, h: run.get("train_s"),
    }


# (name, arm, against it, the margin the lower end must clear)
COMPARISONS = (
    ("dapo_minus_grpo", DAPO, GRPO, 0.0),
    ("partial_minus_dapo", PARTIAL, DAPO, PARTIAL_MARGIN),
    ("dapo_minus_no_dynamic_sampling", DAPO, NO_DYNAMIC_SAMPLING, 0.0),
    ("dapo_minus_symmetric_clip", DAPO, SYMMETRIC_CLIP, 0.0),
    ("dapo_minus_no_overlong", DAPO, NO_OVERLONG, 0.0),
)


def compare(runs: dict[str, dict[int, dict]], arm: str, other: str, metric: str, early: int, margin: float) -> dict:
    """Every measure of `arm` minus `other`, paired by seed over the seeds both finished."""
    first, second = runs.get(arm, {}), runs.get(other, {})
    seeds = sorted(set(first) & set(second))
    result: dict = {"seeds": seeds}
    for name, measure in measures(metric, early).items():
        pairs = []
        for seed in seeds:
            a, b = first[seed], second[seed]
            horizon = {"step": min(a["steps"], b["steps"]), "wall_clock_s": min(a["train_s"], b["train_s"])}
            values = measure(a, horizon), measure(b, horizon)
            if None not in values:
                pairs.append((seed, values[0] - values[1]))
        differences = [d for _, d in pairs]
        stats = spread(differences)
        result[name] = stats and stats | {
            "by_seed": dict(pairs),
            "seeds_to_decide": seeds_to_decide(differences, margin if name != "train_s" else 0.0),
        }
    return result


def load_runs(config: RealModelConfig, output: Path) -> dict[str, dict[int, dict]]:
    """Every recorded run of the arms by kind and seed (failed, stopped and skipped ones included)."""
    runs: dict[str, dict[int, dict]] = {}
    for kind in RUN_KINDS:
        for seed in config.seeds_of(kind):
            record = read_json(run_file(output, kind, seed))
            if record is not None:
                runs.setdefault(kind, {})[seed] = record
    return runs


def sharing(output: Path) -> dict[str, float]:
    """Per run, the mean number of run processes on the device while its process ran (itself included), from
    OUTPUT/schedule.json (runs of one call only share with runs of that call)."""
    schedule = read_json(output / "schedule.json") or {}
    intervals = {name: (entry["start"], entry["end"]) for name, entry in schedule.items()}
    processes = sorted(set(intervals.values()))
    result = {}
    for name, (start, end) in intervals.items():
        overlap = sum(max(0.0, min(end, e) - max(start, s)) for s, e in processes)
        result[name] = overlap / (end - start) if end > start else 1.0
    return result


def time_to(run: dict, metric: str, level: float, axis: str) -> float | None:
    """`axis` at which the run's held-out `metric` first reaches `level`; None where it never does or starts there
    (a level the base model already has is no reference)."""
    curve = run["curve"]
    if not curve or curve[0][metric]["all"] >= level:
        return None
    return crossing(curve, metric, level, axis)


def wall_clock_levels(runs: dict[str, dict[int, dict]], metric: str) -> list[float]:
    """Issue 50's level, and where some compared run never reached it, the highest level every one reached (when it
    is above every one's start: else it measures nothing)."""
    compared = [run for kind in (DAPO, *TRL_KINDS) for run in runs.get(kind, {}).values()]
    if not compared:
        return [WALL_CLOCK_LEVEL]
    common = min(max(p[metric]["all"] for p in run["curve"]) for run in compared)
    above_starts = all(run["curve"][0][metric]["all"] < common for run in compared)
    return [WALL_CLOCK_LEVEL] if common >= WALL_CLOCK_LEVEL or not above_starts else [WALL_CLOCK_LEVEL, common]


def wall_clock_arms(runs: dict[str, dict[int, dict]], metric: str, level: float, shared: dict[str, float]) -> dict:
    """Training wall-clock to `level` of every DAPO run and each TRL arm's run, and TRL's over DAPO's mean where both
    reached it (None: not measured)."""

    def row(kind: str, seed: int, run: dict) -> dict:
        return {"kind": kind, "seed": seed, "wall_clock_s": time_to(run, metric, level, "wall_clock_s"),
                "step": time_to(run, metric, level, "step"), "sharing": shared.get(f"{kind}-seed{seed}")}  # fmt: skip

    dapo = [row(DAPO, seed, run) for seed, run in sorted(runs.get(DAPO, {}).items())]
    reached = [r["wall_clock_s"] for r in dapo if r["wall_clock_s"] is not None]
    dapo_mean = statistics.fmean(reached) if reached else None
    arms = {}
    for kind in TRL_KINDS:
        for seed, run in sorted(runs.get(kind, {}).items()):
            entry = row(kind, seed, run)
            seconds = entry["wall_clock_s"]
            entry["dapo_over_this"] = None if seconds is None or dapo_mean is None else dapo_mean / seconds
            arms[f"{kind}-seed{seed}"] = entry
    return {"level": level, "dapo": dapo, "dapo_mean_s": dapo_mean, "trl": arms}


def partial_proposal(comparison: dict) -> dict:
    """Must-have 6: propose partial rollouts with kept KV as the default where their AUC interval against full DAPO has
    its lower end above PARTIAL_MARGIN and they took less training wall-clock (paired); otherwise what they cost."""
    auc, seconds = comparison.get("auc_steps"), comparison.get("train_s")
    if not auc or not auc["ci95"] or not seconds:
        return {"verdict": "not measured (fewer than 2 seeds of both)", "propose_default": None}
    no_loss = auc["ci95"][0] > PARTIAL_MARGIN
    faster = seconds["ci95"] is not None and seconds["ci95"][1] < 0
    verdict = (
        f"AUC difference {auc['mean']:+.3f} (95% interval {auc['ci95'][0]:+.3f} to {auc['ci95'][1]:+.3f}, "
        f"n={auc['n']}); training wall-clock difference {seconds['mean']:+.1f} s (interval "
        f"{seconds['ci95'][0]:+.1f} to {seconds['ci95'][1]:+.1f})"
    )
    return {"verdict": verdict, "no_loss": no_loss, "faster": faster, "propose_default": no_loss and faster}


def _lower_above(stats: dict | None, margin: float, min_seeds: int = 2) -> bool | None:
    if not stats or not stats["ci95"] or stats["n"] < min_seeds:
        return None
    return stats["ci95"][0] > margin


def targets(summary: dict) -> dict:
    """The issue's targets, each True, False or None (not measured)."""
    comparisons, arms = summary["comparisons"], summary["wall_clock"][0]
    main, partial = comparisons["dapo_minus_grpo"], comparisons["partial_minus_dapo"]
    overlong = comparisons["dapo_minus_no_overlong"].get("truncated_after_start")
    trl_ratios = [entry["dapo_over_this"] for entry in arms["trl"].values()]
    return {
        "dapo_auc_above_grpo_6_seeds": _lower_above(main.get("auc_steps"), 0.0, min_seeds=6),
        "dapo_early_above_grpo_6_seeds": _lower_above(main.get("early"), 0.0, min_seeds=6),
        "dapo_entropy_above_grpo": _lower_above(main.get("entropy_last"), 0.0),
        "overlong_lowers_truncation": None if not overlong or not overlong["ci95"] else overlong["ci95"][1] < 0,
        "partial_no_loss": _lower_above(partial.get("auc_steps"), PARTIAL_MARGIN),
        "partial_faster": summary["partial_rollouts"].get("faster"),
        "dapo_faster_than_trl_to_level": None if None in trl_ratios or not trl_ratios
        else all(ratio < 1 for ratio in trl_ratios),
    }  # fmt: skip


def run_row(run: dict, metric: str, shared: dict[str, float], name: str) -> dict:
    """A run's line in the summary."""
    curve, steps = run.get("curve") or [], run.get("steps")
    return {
        "status": run["status"],
        "steps": steps,
        "train_s": run.get("train_s"),
        "s_per_step": run["train_s"] / steps if run.get("train_s") and steps else None,
        "final": curve[-1][metric]["all"] if curve else None,
        "auc_steps": area(curve, "step", accuracy(metric), steps) if curve and steps else None,
        "generated_completions": run.get("generated_completions"),
        "generated_tokens": run.get("generated_tokens"),
        "sharing": shared.get(name),
        "peak_reserved_gib": run["peak_reserved_bytes"] / 2**30 if run.get("peak_reserved_bytes") else None,
        "note": run.get("reason") or (run.get("error") or "").strip().splitlines()[-1:],
    }


def summarize(config: RealModelConfig, output: Path) -> dict:
    """The study's numbers from what OUTPUT holds."""
    pick = read_json(output / "pick.json") or {}
    metric, early = f"avg@{config.k}", pick.get("early_step", 0)
    runs, shared = load_runs(config, output), sharing(output)
    usable = {kind: {s: r for s, r in by_seed.items() if r["status"] == "ok" and r["curve"]}
              for kind, by_seed in runs.items()}  # fmt: skip
    expected = config.run_order()

    def status(kind: str, seed: int) -> str | None:
        return runs.get(kind, {}).get(seed, {}).get("status")

    summary = {
        "metric": metric,
        "early_step": early,
        "runs": {
            kind: {str(s): run_row(r, metric, shared, f"{kind}-seed{s}") for s, r in by_seed.items()}
            for kind, by_seed in runs.items()
        },
        "comparisons": {
            name: compare(usable, arm, other, metric, early, margin) for name, arm, other, margin in COMPARISONS
        },
        "wall_clock": [wall_clock_arms(usable, metric, level, shared) for level in wall_clock_levels(usable, metric)],
        "skipped": [f"{kind}-seed{seed}" for kind, seed in expected if status(kind, seed) == "skipped"],
    }
    summary["left"] = [f"{kind}-seed{seed}" for kind, seed in expected
                       if seed not in usable.get(kind, {}) and f"{kind}-seed{seed}" not in summary["skipped"]]  # fmt: skip
    summary["partial_rollouts"] = partial_proposal(summary["comparisons"]["partial_minus_dapo"])
    summary["targets"] = targets(summary)
    summary["complete"] = not summary["left"]
    return summary
