"""What the study reports: final held-out accuracy per variant over seeds (mean, spread), its gain over naive GRPO
from the same start point (paired by seed: the seeds' start points differ far more than the variants do), the
training wall-clock at which each variant first reaches the same seed's GRPO final accuracy, a table, and a PNG of
the curves."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from trl_dapo.data.addition import bucket_label

from .config import StudyConfig
from .evaluation import OVERALL
from .variants import VARIANTS, variants_of

BASELINE = VARIANTS[0].name


def spread(values: list[float]) -> dict[str, float] | None:
    """Mean, sample standard deviation (0 for one value), min and max, or None without values."""
    if not values:
        return None
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values), "n": len(values)}


def crossing(curve: list[dict], metric: str, target: float, axis: str) -> float | None:
    """`axis` (step or wall_clock_s) at which the overall `metric` first reaches `target`, interpolated linearly
    between the two evaluations around the crossing; None when it never does."""
    previous = None
    for point in curve:
        value = point[metric][OVERALL]
        if value >= target:
            if previous is None or previous[metric][OVERALL] == value:
                return float(point[axis])
            before = previous[metric][OVERALL]
            fraction = (target - before) / (value - before)
            return previous[axis] + fraction * (point[axis] - previous[axis])
        previous = point
    return None


def completed_runs(records: list[dict], name: str) -> list[dict]:
    return [r["runs"][name] for r in records if _ok(r, name)]


def summarize(config: StudyConfig, records: list[dict]) -> dict:
    metric = f"avg@{config.eval_k}"
    targets = {r["seed"]: r["runs"][BASELINE]["curve"][-1][metric][OVERALL] for r in records if _ok(r, BASELINE)}
    summary = {"metric": metric, "targets": targets, "target_from": BASELINE, "variants": {}}
    for variant in variants_of(config):
        paired = [(r["seed"], r["runs"][variant.name]) for r in records if _ok(r, variant.name)]
        runs = [run for _, run in paired]
        finals = [run["curve"][-1] for run in runs]
        entry = {
            "adds": variant.adds,
            "seeds_ok": len(runs),
            "seeds_failed": sum(r.get("runs", {}).get(variant.name, {}).get("status") == "failed" for r in records),
            "final": {
                name: spread([f[name][OVERALL] for f in finals])
                for name in (metric, "greedy", f"pass@{config.eval_k}")
            },
            "gain_over_baseline": spread(
                [run["curve"][-1][metric][OVERALL] - targets[seed] for seed, run in paired if seed in targets]
            ),
            "final_by_bucket": {
                bucket: spread([f[metric][bucket] for f in finals])
                for bucket in (finals[0][metric] if finals else {})
                if bucket != OVERALL
            },
            "train_s": spread([run["train_s"] for run in runs]),
            "generated_completions": spread([f["generated_completions"] for f in finals]),
            "generated_tokens": spread([f["generated_tokens"] for f in finals]),
            "final_eval_entropy": spread([f["entropy"] for f in finals]),
            "final_eval_mean_length": spread([f["mean_length"] for f in finals]),
        }
        with_target = [(seed, run) for seed, run in paired if seed in targets]
        for axis, key in (("wall_clock_s", "wall_clock_to_target_s"), ("step", "steps_to_target")):
            reached = [crossing(run["curve"], metric, targets[seed], axis) for seed, run in with_target]
            entry[key] = spread([x for x in reached if x is not None])
        entry["reached_target"] = sum(x is not None for x in reached)
        entry["seeds_with_target"] = len(with_target)
        summary["variants"][variant.name] = entry
    return summary


def _ok(record: dict, name: str) -> bool:
    return record.get("runs", {}).get(name, {}).get("status") == "ok"


def _cell(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if value["n"] == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['std']:.{digits}f}"


def _signed(value: dict | None) -> str:
    """A paired difference: mean ± standard deviation, and the range over seeds (all of one sign or not)."""
    if value is None:
        return "n/a"
    return f"{value['mean']:+.3f} ± {value['std']:.3f} [{value['min']:+.3f}, {value['max']:+.3f}]"


def format_table(summary: dict) -> str:
    """Markdown: one row per variant; ± is the standard deviation over seeds."""
    metric = summary["metric"]
    buckets = next((list(v["final_by_bucket"]) for v in summary["variants"].values() if v["final_by_bucket"]), [])
    header = [
        "variant",
        "seeds",
        f"final {metric}",
        f"gain over {BASELINE}, same seed",
        "final greedy",
        *(f"{metric} {b} digits" for b in buckets),
        "RL wall-clock s",
        f"wall-clock s to the seed's {BASELINE} final",
        "completions generated",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, v in summary["variants"].items():
        reached = f"{_cell(v['wall_clock_to_target_s'], 1)} ({v['reached_target']}/{v['seeds_with_target']} reached)"
        row = [
            name,
            f"{v['seeds_ok']}" + (f" ({v['seeds_failed']} failed)" if v["seeds_failed"] else ""),
            _cell(v["final"][metric]),
            _signed(v["gain_over_baseline"]),
            _cell(v["final"]["greedy"]),
            *(_cell(v["final_by_bucket"].get(b)) for b in buckets),
            _cell(v["train_s"], 1),
            reached,
            _cell(v["generated_completions"], 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _mean_curve(runs: list[dict], x: str, y) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation index over the seeds: mean x, mean y, min y, max y (every run evaluates at the same steps)."""
    points = min(len(run["curve"]) for run in runs)
    xs, means, lows, highs = [], [], [], []
    for index in range(points):
        values = [y(run["curve"][index]) for run in runs]
        xs.append(statistics.fmean(run["curve"][index][x] for run in runs))
        means.append(statistics.fmean(values))
        lows.append(min(values))
        highs.append(max(values))
    return xs, means, lows, highs


def _mean_series(runs: list[dict], name: str) -> tuple[list[float], list[float]]:
    """A training metric averaged over the seeds at the steps every seed logged it."""
    by_step: dict[float, list[float]] = {}
    for run in runs:
        for step, value in run["train"].get(name, []):
            by_step.setdefault(step, []).append(value)
    steps = sorted(s for s, values in by_step.items() if len(values) == len(runs) and all(map(math.isfinite, values)))
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def _gain_curve(records: list[dict], name: str, metric: str) -> tuple[list, list, list, list]:
    """Per evaluation: step, and mean, min and max over seeds of the overall `metric` minus the same seed's GRPO's."""
    pairs = [
        (r["runs"][name]["curve"], r["runs"][BASELINE]["curve"]) for r in records if _ok(r, name) and _ok(r, BASELINE)
    ]
    if not pairs:
        return [], [], [], []
    points = min(min(len(run), len(base)) for run, base in pairs)
    gains = [[run[i][metric][OVERALL] - base[i][metric][OVERALL] for run, base in pairs] for i in range(points)]
    steps = [pairs[0][0][i]["step"] for i in range(points)]
    return steps, [statistics.fmean(g) for g in gains], [min(g) for g in gains], [max(g) for g in gains]


def plot(config: StudyConfig, records: list[dict], path: str | Path) -> Path:
    """A 3x3 PNG of every variant's mean over seeds (bands: min to max over seeds on the held-out panels; the gain
    panel pairs each seed's run with its GRPO run, the others show the seeds' spread of start points too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = f"avg@{config.eval_k}"
    hardest = bucket_label(config.buckets[-1])
    held_out = [
        (f"held-out {metric} vs step", "step", lambda p: p[metric][OVERALL]),
        (f"held-out {metric} vs training wall-clock (s)", "wall_clock_s", lambda p: p[metric][OVERALL]),
        (f"held-out {metric}, {hardest} digits, vs step", "step", lambda p: p[metric][hardest]),
        ("policy entropy on held-out samples vs step", "step", lambda p: p["entropy"]),
        ("completions generated vs step", "step", lambda p: p["generated_completions"]),
    ]
    training = [
        ("training entropy (TRL's, on trained tokens)", "entropy"),
        ("training response length", "completions/mean_length"),
        ("informative groups per generation round", "study/informative_groups"),
    ]
    figure, axes = plt.subplots(3, 3, figsize=(16, 12))
    for variant in variants_of(config):
        runs = completed_runs(records, variant.name)
        if not runs:
            continue
        panels = [axes.flat[0], axes.flat[1], *axes.flat[3:6]]
        for axis, (title, x, y) in zip(panels, held_out, strict=True):
            xs, means, lows, highs = _mean_curve(runs, x, y)
            (line,) = axis.plot(xs, means, marker=".", label=variant.name)
            axis.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.12)
            axis.set_title(title, fontsize=10)
        steps, means, lows, highs = _gain_curve(records, variant.name, metric)
        (line,) = axes.flat[2].plot(steps, means, marker=".", label=variant.name)
        axes.flat[2].fill_between(steps, lows, highs, color=line.get_color(), alpha=0.12)
        axes.flat[2].set_title(f"held-out {metric} gain over {BASELINE}, same seed, vs step", fontsize=10)
        for axis, (title, name) in zip(axes.flat[6:], training, strict=True):
            steps, values = _mean_series(runs, name)
            axis.plot(steps, values, marker="." if len(steps) < 50 else None, label=variant.name)
            axis.set_title(title, fontsize=10)
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(f"DAPO ablation: {len(config.seeds)} seeds, mean (bands: min-max over seeds)")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
