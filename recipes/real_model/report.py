"""What the study reports, from its output folder alone (so results fetched from the GPU are reported anywhere), cell
by cell (the pick's cell and the second cell picked with it).

Every comparison is paired by seed (each arm's run of a seed shares its data order, its sampling seed and its
evaluation noise with the other arms' runs of that seed), over the runs of both arms that finished, with the 95% t
interval of the mean difference (`ablation.report.spread`) and the number of seeds at which an interval of the same
spread would clear the target's margin (`seeds_to_decide`):

- the area under the held-out avg@k curve over the run's optimizer steps (at a ceiling every method ties at the last
  step, the area counts how soon it was reached), as a mean accuracy over the run;
- avg@k at the fixed early step (the pick's `early_step`), and at the last step;
- the same area over training wall-clock (evaluations excluded), up to the shorter run of the pair: dynamic sampling
  generates more per step, so per second is a comparison of its own. Wall-clock is only comparable between runs that
  shared the device alike: a pair whose mean numbers of runs on the device differ by more than `SHARING_TOLERANCE`
  is left out of the wall-clock measures (and counted);
- the area under the accuracy among completions that have an `Answer:` line (the answer-line lesson measured apart);
- held-out entropy at the last step (Clip-Higher's claim) and the held-out truncated share after the start (the
  overlong shaping's).

Beside the pairs, per arm and held-out level (`LEVELS`): each seed's training wall-clock and step to the level, the
share of seeds that reach it (the runs either take off or stay low: reaching 0.5 is taking off) and the median over
those that do. TRL's `GRPOTrainer` is compared on its faster path: of `generate` and vLLM colocated, the one with the
lower median training seconds per step.

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
    CELLS,
    DAPO,
    GRPO,
    NO_DYNAMIC_SAMPLING,
    NO_OVERLONG,
    PARTIAL,
    RUN_KINDS,
    SYMMETRIC_CLIP,
    TRL_GRPO,
    TRL_VLLM,
    RealModelConfig,
)
from .pilot import picked
from .runs import run_file, run_name

PARTIAL_MARGIN = -0.02  # partial rollouts cost no learning when their AUC interval's lower end is above this
LEVELS = (0.5, 0.9)  # held-out avg@k levels whose time each run is read at: taking off, and near the ceiling
SHARING_TOLERANCE = 0.5  # runs on the device, on average: more apart than this, a pair's wall-clocks do not compare
TARGET_SEEDS = 12  # pairs the wall-clock target against TRL needs
MAX_SEEDS = 10_000
WALL_CLOCK_MEASURES = frozenset({"auc_wall_clock", "train_s"})

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


TRL = "trl"  # in a comparison: TRL's GRPOTrainer on its faster path (`faster_trl`)
# (name, arm, against it, the margin the lower end must clear)
COMPARISONS = (
    ("dapo_minus_grpo", DAPO, GRPO, 0.0),
    ("dapo_minus_trl", DAPO, TRL, 0.0),
    ("grpo_minus_trl", GRPO, TRL, 0.0),  # the trainer and its engine without DAPO's pieces, against TRL
    ("dapo_minus_trl_generate", DAPO, TRL_GRPO, 0.0),
    ("dapo_minus_trl_vllm", DAPO, TRL_VLLM, 0.0),
    ("partial_minus_dapo", PARTIAL, DAPO, PARTIAL_MARGIN),
    ("dapo_minus_no_dynamic_sampling", DAPO, NO_DYNAMIC_SAMPLING, 0.0),
    ("dapo_minus_symmetric_clip", DAPO, SYMMETRIC_CLIP, 0.0),
    ("dapo_minus_no_overlong", DAPO, NO_OVERLONG, 0.0),
)


def compare(runs: dict[str, dict[int, dict]], arm: str, other: str, metric: str, early: int, margin: float) -> dict:
    """Every measure of `arm` minus `other`, paired by seed over the seeds both finished; the wall-clock measures over
    the pairs that shared the device alike."""
    first, second = runs.get(arm, {}), runs.get(other, {})
    seeds = sorted(set(first) & set(second))
    result: dict = {"seeds": seeds}
    for name, measure in measures(metric, early).items():
        pairs, unlike = [], 0
        for seed in seeds:
            a, b = first[seed], second[seed]
            if name in WALL_CLOCK_MEASURES and not shared_alike(a, b):
                unlike += 1
                continue
            horizon = {"step": min(a["steps"], b["steps"]), "wall_clock_s": min(a["train_s"], b["train_s"])}
            values = measure(a, horizon), measure(b, horizon)
            if None not in values:
                pairs.append((seed, values[0] - values[1]))
        differences = [d for _, d in pairs]
        stats = spread(differences)
        result[name] = stats and stats | {
            "by_seed": dict(pairs),
            "seeds_to_decide": seeds_to_decide(differences, margin if name != "train_s" else 0.0),
            "left_out_for_sharing": unlike,
        }
    return result


def shared_alike(a: dict, b: dict) -> bool:
    """Whether two runs shared the device alike (unknown sharing counts as alike: a study of one process)."""
    if a.get("sharing") is None or b.get("sharing") is None:
        return True
    return abs(a["sharing"] - b["sharing"]) <= SHARING_TOLERANCE


def load_runs(
    config: RealModelConfig, output: Path, cell: str, shared: dict[str, float]
) -> dict[str, dict[int, dict]]:
    """Every recorded run of the cell's arms by kind and seed (failed, stopped and skipped ones included), each with
    the mean number of runs on the device while it ran (`sharing`)."""
    runs: dict[str, dict[int, dict]] = {}
    for kind in RUN_KINDS:
        for seed in config.seeds_of(kind, cell):
            record = read_json(run_file(output, kind, seed, cell))
            if record is not None:
                runs.setdefault(kind, {})[seed] = record | {"sharing": shared.get(run_name(cell, kind, seed))}
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


def faster_trl(runs: dict[str, dict[int, dict]]) -> str | None:
    """TRL's path with the lower median training seconds per optimizer step over its finished runs, or None."""
    paces = {kind: statistics.median(r["train_s"] / r["steps"] for r in runs[kind].values())
             for kind in (TRL_GRPO, TRL_VLLM) if runs.get(kind)}  # fmt: skip
    return min(paces, key=paces.get) if paces else None


def level_times(runs: dict[str, dict[int, dict]], metric: str, level: float) -> dict:
    """Per arm: each seed's training wall-clock and step to `level` (None: not reached), the share of seeds that
    reached it and the medians over those that did."""
    table = {}
    for kind, by_seed in runs.items():
        rows = {seed: {"wall_clock_s": time_to(run, metric, level, "wall_clock_s"),
                       "step": time_to(run, metric, level, "step"), "sharing": run.get("sharing")}
                for seed, run in sorted(by_seed.items())}  # fmt: skip
        reached = [row for row in rows.values() if row["wall_clock_s"] is not None]
        table[kind] = {
            "by_seed": rows,
            "reached": len(reached),
            "seeds": len(rows),
            "share": len(reached) / len(rows) if rows else None,
            "median_wall_clock_s": statistics.median(r["wall_clock_s"] for r in reached) if reached else None,
            "median_step": statistics.median(r["step"] for r in reached) if reached else None,
        }
    return {"level": level, "arms": table}


def partial_proposal(comparison: dict) -> dict:
    """The partial-rollout verdict: propose partial rollouts with kept KV as the default where their AUC interval
    against full DAPO has its lower end above PARTIAL_MARGIN and they took less training wall-clock (paired);
    otherwise say what they cost."""
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


def time_target(levels: list[dict], trl: str | None) -> bool | None:
    """DAPO's median training wall-clock to held-out 0.9 at most half TRL's, with at least TRL's share of seeds
    reaching it. Where only one of them reaches it, the one that does is the faster; where neither, not measured."""
    table = next((entry["arms"] for entry in levels if entry["level"] == LEVELS[-1]), {})
    dapo, other = table.get(DAPO), table.get(trl)
    if not dapo or not other:
        return None
    mine, theirs = dapo["median_wall_clock_s"], other["median_wall_clock_s"]
    if mine is None or theirs is None:
        return None if mine is None and theirs is None else theirs is None
    return mine <= 0.5 * theirs and dapo["share"] >= other["share"]


def targets(cell: dict) -> dict:
    """The targets of one cell, each True, False or None (not measured)."""
    comparisons = cell["comparisons"]
    overlong = comparisons["dapo_minus_no_overlong"].get("truncated_after_start")
    return {
        "dapo_wall_clock_auc_above_trl": _lower_above(comparisons["dapo_minus_trl"].get("auc_wall_clock"), 0.0,
                                                      min_seeds=TARGET_SEEDS),
        "dapo_step_auc_above_grpo": _lower_above(comparisons["dapo_minus_grpo"].get("auc_steps"), 0.0),
        "dapo_half_trl_time_to_0.9": time_target(cell["levels"], cell["trl_path"]),
        "dapo_entropy_above_grpo": _lower_above(comparisons["dapo_minus_grpo"].get("entropy_last"), 0.0),
        "overlong_lowers_truncation": None if not overlong or not overlong["ci95"] else overlong["ci95"][1] < 0,
        "partial_no_loss": _lower_above(comparisons["partial_minus_dapo"].get("auc_steps"), PARTIAL_MARGIN),
        "partial_faster": cell["partial_rollouts"].get("faster"),
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


def summarize_cell(config: RealModelConfig, output: Path, cell: str, pick: dict, shared: dict[str, float]) -> dict:
    """One cell's numbers: its runs, the paired comparisons, the times to each level and the targets."""
    metric, early = f"avg@{config.k}", pick.get("early_step", 0)
    runs = load_runs(config, output, cell, shared)
    usable = {kind: {s: r for s, r in by_seed.items() if r["status"] == "ok" and r["curve"]}
              for kind, by_seed in runs.items()}  # fmt: skip
    usable = {kind: by_seed for kind, by_seed in usable.items() if by_seed}
    trl = faster_trl(usable)
    usable_with_trl = usable | ({TRL: usable[trl]} if trl else {})
    summary = {
        "task": pick.get("cell"),
        "metric": metric,
        "early_step": early,
        "trl_path": trl,
        "runs": {
            kind: {str(s): run_row(r, metric, shared, run_name(cell, kind, s)) for s, r in by_seed.items()}
            for kind, by_seed in runs.items()
        },
        "comparisons": {
            name: compare(usable_with_trl, arm, other, metric, early, margin)
            for name, arm, other, margin in COMPARISONS
        },
        "levels": [level_times(usable, metric, level) for level in LEVELS],
    }
    summary["partial_rollouts"] = partial_proposal(summary["comparisons"]["partial_minus_dapo"])
    summary["targets"] = targets(summary)
    return summary


def summarize(config: RealModelConfig, output: Path) -> dict:
    """The study's numbers from what OUTPUT holds: per cell (`cells`), and which runs were skipped or are left."""
    pick, shared = read_json(output / "pick.json") or {}, sharing(output)
    chosen = {cell: picked(pick, cell) for cell in CELLS}
    cells = {cell: summarize_cell(config, output, cell, chosen[cell], shared) for cell in CELLS if chosen[cell]}
    if not cells:  # no pick yet: the first cell's runs, if any, are reported without their task
        cells = {CELLS[0]: summarize_cell(config, output, CELLS[0], {}, shared)}
    expected = [(cell, kind, seed) for cell, kind, seed in config.run_order() if cell in cells]

    def status(cell: str, kind: str, seed: int) -> str | None:  # from the records the cells' summaries read
        return cells[cell]["runs"].get(kind, {}).get(str(seed), {}).get("status")

    summary = {"cells": cells, "skipped": [run_name(*key) for key in expected if status(*key) == "skipped"]}
    summary["left"] = [run_name(*key) for key in expected if status(*key) not in ("ok", "skipped")]
    summary["complete"] = not summary["left"]
    return summary
