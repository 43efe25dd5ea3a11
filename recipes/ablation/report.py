"""What the study reports: final held-out accuracy per variant over seeds, its gain over naive GRPO from the same
start point (paired by seed, with a 95% t interval: the seeds' start points differ far more than the variants do),
the mechanism metrics at every evaluation point, the study's targets read off them, the training wall-clock at which
each variant first reaches the same seed's GRPO final accuracy, tables, and a PNG of the curves.

A run that failed (after its retry) or was not run yet is never left out silently: the summary lists it, counts it
per variant, and marks the study incomplete.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from trl_dapo.evaluation import OVERALL

from .config import StudyConfig
from .task import bucket_label
from .variants import VARIANTS, variants_of

BASELINE = VARIANTS[0].name
FULL_DAPO = ("dynamic_sampling", "dapo_paged_engine")
PAGED = "dapo_paged_engine"
PARTIAL = "dapo_partial"
# Partial rollouts cost no learning when the paired difference of final held-out accuracy against the paged engine
# without them has its 95% interval's lower end above this (the study's target for partial rollouts).
PARTIAL_MARGIN = -0.03
# Held-out measures at each evaluation point (the policy's own samples on the same prompts for every variant).
HELD_OUT_MECHANISMS = ("entropy", "truncated", "rechecked", "mean_length", "max_length")
# Training measures, averaged over the optimizer steps since the evaluation before (`window_means`).
TRAINING_MECHANISMS = {
    "clip_low": "clip_ratio/low_mean",
    "clip_high": "clip_ratio/high_mean",
    "train_entropy": "entropy",
    "rollout_truncated": "study/truncated",
    "rollout_rechecked": "study/rechecked",
    "rollout_length_spread": "study/length_spread",
}


def t_within(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with `df` degrees of freedom (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    sine, cosine2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin(theta) (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... up to cos^(df-2))
        term = total = 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * cosine2
            total += term
        return sine * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)  # 2/pi (theta + sin(theta) (cos + 2/3 cos^3 + ... up to cos^(df-2)))
    for k in range(1, (df - 1) // 2):
        term *= (2 * k) / (2 * k + 1) * cosine2
        total += term
    return 2 / math.pi * (theta + sine * total)


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided critical value: P(|T| < t) = `confidence` (4.303 for 95% and 2 degrees of freedom)."""
    low, high = 0.0, 1e6
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_within(middle, df) < confidence else (low, middle)
    return (low + high) / 2


def spread(values: list[float]) -> dict[str, float | list[float] | None] | None:
    """Mean, sample standard deviation (0 for one value), min, max, n and the 95% t interval of the mean (None for
    fewer than two values), or None without values."""
    if not values:
        return None
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    interval = None
    if len(values) > 1:
        half = t_quantile(0.95, len(values) - 1) * std / math.sqrt(len(values))
        interval = [mean - half, mean + half]
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values), "ci95": interval}


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


def window_means(series: list[list[float]], eval_steps: list[int]) -> list[float | None]:
    """Per evaluation step, the mean of a training metric over the steps since the evaluation before (None at step
    0 and for a window without a logged value): what the updates did between two evaluation points."""
    means: list[float | None] = []
    for before, step in zip([None, *eval_steps], eval_steps, strict=False):
        values = [v for s, v in series if before is not None and before < s <= step and math.isfinite(v)]
        means.append(statistics.fmean(values) if values else None)
    return means


def mechanisms(run: dict, eval_steps: list[int]) -> dict[str, list[float | None]]:
    """A run's mechanism metrics per evaluation point: held-out (entropy, truncated and rechecked shares, mean and
    longest length) and, between evaluations, the training ones (clip fractions, entropy, rollout truncation)."""
    points = {point["step"]: point for point in run["curve"]}
    result = {name: [points[s].get(name) if s in points else None for s in eval_steps] for name in HELD_OUT_MECHANISMS}
    for name, metric in TRAINING_MECHANISMS.items():
        result[name] = window_means(run["train"].get(metric, []), eval_steps)
    return result


def completed_runs(records: list[dict], name: str) -> list[dict]:
    return [r["runs"][name] for r in records if _ok(r, name)]


def _paired(records: list[dict], name: str, value, baseline: str = BASELINE) -> list[float]:
    """`value(run) - value(baseline run)` per seed where both finished."""
    return [value(r["runs"][name]) - value(r["runs"][baseline]) for r in records if _ok(r, name) and _ok(r, baseline)]


def summarize(config: StudyConfig, records: list[dict]) -> dict:
    metric = f"avg@{config.eval_k}"
    eval_steps = config.eval_steps()
    targets = {r["seed"]: r["runs"][BASELINE]["curve"][-1][metric][OVERALL] for r in records if _ok(r, BASELINE)}
    summary: dict = {"metric": metric, "eval_steps": eval_steps, "targets": targets, "target_from": BASELINE}
    summary["variants"] = {}
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
                _paired(records, variant.name, lambda run: run["curve"][-1][metric][OVERALL])
            ),
            "final_by_bucket": {
                bucket: spread([f[metric][bucket] for f in finals])
                for bucket in (finals[0][metric] if finals else {})
                if bucket != OVERALL
            },
            "gain_by_bucket": {
                bucket: spread(_paired(records, variant.name, lambda run, b=bucket: run["curve"][-1][metric][b]))
                for bucket in (finals[0][metric] if finals else {})
                if bucket != OVERALL
            },
            "train_s": spread([run["train_s"] for run in runs]),
            "generated_completions": spread([f["generated_completions"] for f in finals]),
            "generated_tokens": spread([f["generated_tokens"] for f in finals]),
        }
        per_run = [mechanisms(run, eval_steps) for run in runs]
        entry["mechanisms"] = {
            name: [spread([m[name][i] for m in per_run if m[name][i] is not None]) for i in range(len(eval_steps))]
            for name in (*HELD_OUT_MECHANISMS, *TRAINING_MECHANISMS)
        }
        with_target = [(seed, run) for seed, run in paired if seed in targets]
        for axis, key in (("wall_clock_s", "wall_clock_to_target_s"), ("step", "steps_to_target")):
            reached = [crossing(run["curve"], metric, targets[seed], axis) for seed, run in with_target]
            entry[key] = spread([x for x in reached if x is not None])
        entry["reached_target"] = sum(x is not None for x in reached)
        entry["seeds_with_target"] = len(with_target)
        summary["variants"][variant.name] = entry
    summary["failures"], summary["left"] = _unfinished(config, records)
    summary["complete"] = not summary["failures"] and not summary["left"]
    summary["targets_read"] = read_targets(config, records, metric)
    return summary


def _unfinished(config: StudyConfig, records: list[dict]) -> tuple[list[dict], list[list]]:
    """The runs that failed (with their last error line) and the (seed, variant) pairs not run yet."""
    by_seed = {r["seed"]: r for r in records}
    failures, left = [], []
    for seed in config.seeds:
        for variant in variants_of(config):
            run = by_seed.get(seed, {}).get("runs", {}).get(variant.name)
            if run is None:
                left.append([seed, variant.name])
            elif run["status"] != "ok":
                error = run["error"].strip().splitlines()
                failures.append(
                    {"seed": seed, "variant": variant.name, "attempts": run.get("attempts", 1), "error": error[-1]}
                )
    return failures, left


def read_targets(config: StudyConfig, records: list[dict], metric: str) -> dict:
    """The study's targets, per seed and over seeds (95% t intervals), from the runs that finished:

    - GRPO's held-out entropy at the last evaluation over its start (below 1/2: it collapsed);
    - Clip-Higher's and GRPO's final held-out entropy, each with its interval (non-overlapping, Clip-Higher's
      higher: it kept entropy), and their paired difference;
    - per variant, the held-out truncated share averaged over the evaluations after the start, minus GRPO's
      (negative: truncation fell faster than under GRPO);
    - full DAPO's final gain over GRPO (interval above zero: it beat GRPO);
    - the paged engine's training wall-clock to the seed's GRPO final over GRPO's whole training wall-clock (at most
      1/2: half the time; a seed that never reaches it counts as not reaching it), judged on the seeds whose two runs
      shared the device alike: runs of a phase with fewer workers run faster, and their memory share says how many
      shared it."""
    grpo = completed_runs(records, BASELINE)
    ratios = [run["curve"][-1]["entropy"] / run["curve"][0]["entropy"] for run in grpo if run["curve"][0]["entropy"]]
    result: dict = {"grpo_entropy_over_start": spread(ratios)}
    result["grpo_entropy_halved"] = bool(ratios) and statistics.fmean(ratios) < 0.5
    final_entropy = {
        name: spread([run["curve"][-1]["entropy"] for run in completed_runs(records, name)])
        for name in (BASELINE, "clip_higher")
    }
    result["final_entropy"] = final_entropy
    result["clip_higher_minus_grpo_entropy"] = spread(
        _paired(records, "clip_higher", lambda run: run["curve"][-1]["entropy"])
    )
    high, low = final_entropy["clip_higher"], final_entropy[BASELINE]
    result["clip_higher_entropy_separated"] = bool(
        high and low and high["ci95"] and low["ci95"] and high["ci95"][0] > low["ci95"][1]
    )

    def later_truncation(run: dict) -> float:
        return statistics.fmean(point["truncated"] for point in run["curve"][1:])

    result["truncation_after_start_minus_grpo"] = {
        variant.name: spread(_paired(records, variant.name, later_truncation))
        for variant in variants_of(config)
        if variant.name != BASELINE
    }
    result["full_dapo_gain"] = {
        name: spread(_paired(records, name, lambda run: run["curve"][-1][metric][OVERALL]))
        for name in FULL_DAPO
        if name in (v.name for v in variants_of(config))
    }
    result["full_dapo_beats_grpo"] = {
        name: bool(gain and gain["ci95"] and gain["ci95"][0] > 0) for name, gain in result["full_dapo_gain"].items()
    }
    fractions, equal_sharing, reached = [], [], 0
    for record in records:
        if _ok(record, PAGED) and _ok(record, BASELINE):
            paged, grpo = record["runs"][PAGED], record["runs"][BASELINE]
            at = crossing(paged["curve"], metric, grpo["curve"][-1][metric][OVERALL], "wall_clock_s")
            reached += at is not None
            fractions.append(math.inf if at is None else at / grpo["train_s"])
            equal_sharing.append(paged.get("memory_share") == grpo.get("memory_share"))
    compared = [f for f, equal in zip(fractions, equal_sharing, strict=True) if equal]
    result["paged_wall_clock_to_grpo_final_over_grpo"] = {
        "by_seed": fractions,
        "equal_sharing": equal_sharing,
        "reached": reached,
        "median_where_alike": statistics.median(compared) if compared else None,
    }
    result["paged_within_half_grpo_wall_clock"] = bool(compared) and all(f <= 0.5 for f in compared)
    result["partial_rollouts"] = read_partial_rollouts(records, metric)
    return result


def read_partial_rollouts(records: list[dict], metric: str) -> dict:
    """Partial rollouts against the paged engine without them, per seed and over seeds: the paired
    difference of final held-out `metric` with its 95% t interval (no loss in learning: the lower end above
    `PARTIAL_MARGIN`), and, on the seeds whose two runs shared the device alike, each one's training wall-clock to the
    seed's `dapo_paged_engine` final accuracy (partial over paged below 1: the same accuracy sooner; a seed where
    partial rollouts never reach it counts as infinite)."""
    difference = spread(_paired(records, PARTIAL, lambda run: run["curve"][-1][metric][OVERALL], baseline=PAGED))
    ratios, equal_sharing = [], []
    for record in records:
        if _ok(record, PARTIAL) and _ok(record, PAGED):
            partial, paged = record["runs"][PARTIAL], record["runs"][PAGED]
            target = paged["curve"][-1][metric][OVERALL]
            at, own = (crossing(run["curve"], metric, target, "wall_clock_s") for run in (partial, paged))
            ratios.append(math.inf if at is None else at / own if own else math.nan)
            equal_sharing.append(partial.get("memory_share") == paged.get("memory_share"))
    compared = [ratio for ratio, equal in zip(ratios, equal_sharing, strict=True) if equal]
    return {
        "final_minus_paged": difference,
        "no_loss": bool(difference and difference["ci95"] and difference["ci95"][0] > PARTIAL_MARGIN),
        "wall_clock_to_paged_final_over_paged": ratios,
        "equal_sharing": equal_sharing,
        "median_where_alike": statistics.median(compared) if compared else None,
        "sooner_where_alike": bool(compared) and all(ratio < 1 for ratio in compared),
    }


def _ok(record: dict, name: str) -> bool:
    return record.get("runs", {}).get(name, {}).get("status") == "ok"


def _cell(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if value["n"] == 1:
        return f"{value['mean']:.{digits}f}"
    return f"{value['mean']:.{digits}f} ± {value['std']:.{digits}f}"


def _signed(value: dict | None) -> str:
    """A paired difference: mean and its 95% t interval (n), or the one value."""
    if value is None:
        return "n/a"
    if value["ci95"] is None:
        return f"{value['mean']:+.3f} (n=1)"
    low, high = value["ci95"]
    return f"{value['mean']:+.3f} [{low:+.3f}, {high:+.3f}] (n={value['n']})"


def format_table(summary: dict) -> str:
    """Markdown: one row per variant; ± is the standard deviation over seeds, [ ] the 95% interval of a paired
    mean."""
    metric = summary["metric"]
    buckets = next((list(v["final_by_bucket"]) for v in summary["variants"].values() if v["final_by_bucket"]), [])
    header = [
        "variant",
        "seeds",
        f"final {metric}",
        f"gain over {BASELINE}, same seed, 95% interval",
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
            f"{v['seeds_ok']}" + (f" ({v['seeds_failed']} FAILED)" if v["seeds_failed"] else ""),
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


def format_mechanisms(summary: dict) -> str:
    """Markdown: per variant and evaluation step, the mechanism metrics' means over seeds (training ones over the
    steps since the evaluation before)."""
    columns = (
        ("entropy", "held-out entropy", 3),
        ("truncated", "held-out truncated", 3),
        ("rechecked", "held-out rechecked", 3),
        ("mean_length", "mean length", 1),
        ("max_length", "max length", 0),
        ("clip_low", "clipped low", 4),
        ("clip_high", "clipped high", 4),
        ("train_entropy", "training entropy", 3),
        ("rollout_truncated", "rollout truncated", 3),
    )
    header = ["variant", "step", *(label for _, label, _ in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, v in summary["variants"].items():
        for index, step in enumerate(summary["eval_steps"]):
            cells = []
            for key, _, digits in columns:
                value = v["mechanisms"][key][index]
                cells.append("" if value is None else f"{value['mean']:.{digits}f}")
            lines.append("| " + " | ".join([name, str(step), *cells]) + " |")
    return "\n".join(lines)


def format_targets(summary: dict) -> str:
    """The study's targets as read from the runs (see `read_targets`)."""
    read = summary["targets_read"]

    def interval(value: dict | None) -> str:
        if value is None:
            return "n/a"
        if value["ci95"] is None:
            return f"{value['mean']:.3f} (n=1)"
        return f"{value['mean']:.3f} [{value['ci95'][0]:.3f}, {value['ci95'][1]:.3f}] (n={value['n']})"

    paged = read["paged_wall_clock_to_grpo_final_over_grpo"]
    lines = [
        "targets, read from the finished runs (95% t intervals over seeds):",
        f"- GRPO held-out entropy, last evaluation / start: {interval(read['grpo_entropy_over_start'])}; below 1/2: "
        f"{read['grpo_entropy_halved']}",
        f"- final held-out entropy: grpo {interval(read['final_entropy'][BASELINE])}, clip_higher "
        f"{interval(read['final_entropy']['clip_higher'])}; separated, Clip-Higher above: "
        f"{read['clip_higher_entropy_separated']} (paired difference {_signed(read['clip_higher_minus_grpo_entropy'])})",
        "- held-out truncated share after the start, minus GRPO's (negative: fell faster): "
        + ", ".join(f"{name} {_signed(v)}" for name, v in read["truncation_after_start_minus_grpo"].items()),
        "- full DAPO's final gain over GRPO: "
        + ", ".join(
            f"{name} {_signed(v)} (above zero: {read['full_dapo_beats_grpo'][name]})"
            for name, v in read["full_dapo_gain"].items()
        ),
        f"- {PAGED}: wall-clock to the seed's GRPO final / GRPO's wall-clock, by seed "
        f"{[round(f, 2) for f in paged['by_seed']]} ({paged['reached']} reached; shared the device alike with GRPO's "
        f"run: {paged.get('equal_sharing')}); all within 1/2 where alike: {read['paged_within_half_grpo_wall_clock']}",
    ]
    partial = read["partial_rollouts"]
    if partial["final_minus_paged"] is not None:
        lines.append(
            f"- {PARTIAL} minus {PAGED}, final {summary['metric']}: {_signed(partial['final_minus_paged'])}; lower "
            f"end above {PARTIAL_MARGIN}: {partial['no_loss']}; wall-clock to the seed's {PAGED} final over {PAGED}'s, "
            f"by seed {[round(r, 2) for r in partial['wall_clock_to_paged_final_over_paged']]} (shared the device "
            f"alike: {partial['equal_sharing']}); all below 1 where alike: {partial['sooner_where_alike']}"
        )
    return "\n".join(lines)


def _mean_band(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t interval (the mean itself for one value)."""
    stats = spread(values)
    low, high = stats["ci95"] or (stats["mean"], stats["mean"])
    return stats["mean"], low, high


def _mean_curve(runs: list[dict], x: str, y) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation index over the seeds: mean x, mean y and its 95% interval (every run evaluates at the same
    steps)."""
    points = min(len(run["curve"]) for run in runs)
    xs, means, lows, highs = [], [], [], []
    for index in range(points):
        mean, low, high = _mean_band([y(run["curve"][index]) for run in runs])
        xs.append(statistics.fmean(run["curve"][index][x] for run in runs))
        means.append(mean)
        lows.append(low)
        highs.append(high)
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
    """Per evaluation: step, and the mean over seeds of the overall `metric` minus the same seed's GRPO's, with its
    95% interval."""
    pairs = [
        (r["runs"][name]["curve"], r["runs"][BASELINE]["curve"]) for r in records if _ok(r, name) and _ok(r, BASELINE)
    ]
    if not pairs:
        return [], [], [], []
    points = min(min(len(run), len(base)) for run, base in pairs)
    bands = [
        _mean_band([run[i][metric][OVERALL] - base[i][metric][OVERALL] for run, base in pairs]) for i in range(points)
    ]
    steps = [pairs[0][0][i]["step"] for i in range(points)]
    return steps, [b[0] for b in bands], [b[1] for b in bands], [b[2] for b in bands]


def plot(config: StudyConfig, records: list[dict], path: str | Path) -> Path:
    """A 3x4 PNG of every variant's mean over seeds with its 95% interval: accuracy (against steps and wall-clock,
    the gain over GRPO of the same seed, the hardest bucket), the held-out mechanisms (entropy, the paper's Figure
    2b; truncated and rechecked shares; length) and the training ones (clip fractions, rollout truncation,
    informative groups)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = f"avg@{config.eval_k}"
    hardest = bucket_label(config.buckets[-1])
    share, positive = (0.0, 1.0), (0.0, math.inf)  # what a band may span: an interval over few seeds is wide
    held_out = {
        0: (f"held-out {metric} vs step", "step", lambda p: p[metric][OVERALL], share),
        1: (f"held-out {metric} vs training wall-clock (s)", "wall_clock_s", lambda p: p[metric][OVERALL], share),
        3: (f"held-out {metric}, {hardest} digits, vs step", "step", lambda p: p[metric][hardest], share),
        4: ("held-out policy entropy (nats/token) vs step", "step", lambda p: p["entropy"], positive),
        5: ("held-out truncated share vs step", "step", lambda p: p["truncated"], share),
        6: ("held-out share with a recheck vs step", "step", lambda p: p.get("rechecked", math.nan), share),
        7: ("held-out mean response length vs step", "step", lambda p: p["mean_length"], positive),
    }
    training = {
        8: ("tokens clipped above (ratio > 1 + eps_high, A > 0) per step", "clip_ratio/high_mean"),
        9: ("tokens clipped below (ratio < 1 - eps, A < 0) per step", "clip_ratio/low_mean"),
        10: ("rollout truncated share per generation round", "study/truncated"),
        11: ("informative groups per generation round", "study/informative_groups"),
    }
    figure, axes = plt.subplots(3, 4, figsize=(20, 12))
    for variant in variants_of(config):
        runs = completed_runs(records, variant.name)
        if not runs:
            continue
        for index, (title, x, y, (floor, ceiling)) in held_out.items():
            xs, means, lows, highs = _mean_curve(runs, x, y)
            (line,) = axes.flat[index].plot(xs, means, marker=".", label=variant.name)
            lows, highs = [max(v, floor) for v in lows], [min(v, ceiling) for v in highs]
            axes.flat[index].fill_between(xs, lows, highs, color=line.get_color(), alpha=0.12)
            axes.flat[index].set_title(title, fontsize=10)
        steps, means, lows, highs = _gain_curve(records, variant.name, metric)
        (line,) = axes.flat[2].plot(steps, means, marker=".", label=variant.name)
        axes.flat[2].fill_between(steps, lows, highs, color=line.get_color(), alpha=0.12)
        axes.flat[2].set_title(f"held-out {metric} gain over {BASELINE}, same seed, vs step", fontsize=10)
        for index, (title, name) in training.items():
            steps, values = _mean_series(runs, name)
            axes.flat[index].plot(steps, values, marker="." if len(steps) < 50 else None, label=variant.name)
            axes.flat[index].set_title(title, fontsize=10)
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(
        f"DAPO ablation, {config.name} regime: {len(config.seeds)} seeds, mean (bands: 95% t interval over seeds)"
    )
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
