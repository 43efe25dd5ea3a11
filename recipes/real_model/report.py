"""What the study reports, from its output folder alone (so results fetched from the GPU are reported anywhere): the
grid and the pick, each run's held-out avg@k curve and wall-clock, the paired final difference DAPO minus GRPO's
settings by seed with its 95% t interval, DAPO's gain over the base model and where it plateaus, and DAPO's
training wall-clock to TRL GRPOTrainer's final accuracy over TRL's own; a PNG of the curves."""

from __future__ import annotations

import statistics
from pathlib import Path

from ablation.report import crossing, spread
from ablation.store import read_json

from .config import DAPO, GRPO, RUN_KINDS, TRL_GRPO, RealModelConfig
from .runs import run_file

PLATEAU_TOLERANCE = 0.02  # a curve has plateaued from the first evaluation within this of its best
NO_LOSS_MARGIN = -0.02  # the target: the paired interval's lower end above this


def load_runs(config: RealModelConfig, output: Path) -> dict[str, dict[int, dict]]:
    """Every recorded run by kind and seed (failed and stopped ones included: the summary says which)."""
    runs: dict[str, dict[int, dict]] = {}
    for kind in RUN_KINDS:
        for seed in seeds_of(config, kind):
            record = read_json(run_file(output, kind, seed))
            if record is not None:
                runs.setdefault(kind, {})[seed] = record
    return runs


def final(run: dict, metric: str) -> float:
    return run["curve"][-1][metric]["all"]


def plateau(curve: list[dict], metric: str) -> dict | None:
    """The step and value from which the curve stays within PLATEAU_TOLERANCE of its best."""
    if not curve:
        return None
    best = max(point[metric]["all"] for point in curve)
    point = next(p for p in curve if p[metric]["all"] >= best - PLATEAU_TOLERANCE)
    return {"step": point["step"], "value": point[metric]["all"], "best": best}


def mean_curve(runs: list[dict], metric: str) -> list[dict]:
    """The mean over seeds at the evaluation steps every run reached, in the runs' layout."""
    steps = set.intersection(*({p["step"] for p in run["curve"]} for run in runs)) if runs else set()
    points = []
    for step in sorted(steps):
        at = [next(p for p in run["curve"] if p["step"] == step) for run in runs]
        points.append({"step": step, "wall_clock_s": statistics.fmean(p["wall_clock_s"] for p in at),
                       metric: {"all": statistics.fmean(p[metric]["all"] for p in at)}})  # fmt: skip
    return points


def seeds_of(config: RealModelConfig, kind: str) -> tuple[int, ...]:
    return config.trl_seeds if kind == TRL_GRPO else config.seeds


def run_row(run: dict, metric: str) -> dict:
    """A run's line in the summary."""
    return {
        "status": run["status"],
        "steps": run.get("steps"),
        "train_s": run.get("train_s"),
        "final": final(run, metric) if run["curve"] else None,
        "generated_completions": run.get("generated_completions"),
    }


def at_step(run: dict, step: int, metric: str) -> float:
    return next(point[metric]["all"] for point in run["curve"] if point["step"] == step)


def paired_difference(dapo: dict[int, dict], grpo: dict[int, dict], metric: str) -> dict | None:
    """DAPO minus GRPO's settings by seed, each pair at the last step both evaluated (the final step unless a time
    budget stopped one), with the 95% t interval of the mean."""
    pairs = []
    for seed in sorted(set(dapo) & set(grpo)):
        step = max({p["step"] for p in dapo[seed]["curve"]} & {p["step"] for p in grpo[seed]["curve"]})
        pairs.append((seed, step, at_step(dapo[seed], step, metric) - at_step(grpo[seed], step, metric)))
    if not pairs:
        return None
    differences = [difference for _, _, difference in pairs]
    return spread(differences) | {"by_seed": differences, "seeds": [s for s, _, _ in pairs],
                                  "steps": [step for _, step, _ in pairs]}  # fmt: skip


def summarize(config: RealModelConfig, output: Path) -> dict:
    """The study's numbers. Runs a time budget stopped count with what they evaluated (their status says so)."""
    metric = f"avg@{config.k}"
    runs = load_runs(config, output)
    usable = {kind: {s: r for s, r in by_seed.items() if r["status"] in ("ok", "stopped") and r["curve"]}
              for kind, by_seed in runs.items()}  # fmt: skip
    dapo, grpo, trl = usable.get(DAPO, {}), usable.get(GRPO, {}), usable.get(TRL_GRPO, {})
    base = [run["curve"][0][metric]["all"] for by_seed in usable.values() for run in by_seed.values()]
    dapo_curve = mean_curve(list(dapo.values()), metric)
    ok = [r for by_seed in runs.values() for r in by_seed.values() if r["status"] == "ok"]
    summary = {
        "metric": metric,
        "runs": {kind: {str(s): run_row(r, metric) for s, r in by_seed.items()} for kind, by_seed in runs.items()},
        "base": spread(base),
        "final": {kind: spread([final(r, metric) for r in by_seed.values()]) for kind, by_seed in usable.items()},
        "dapo_minus_grpo": paired_difference(dapo, grpo, metric),
        "dapo_mean_curve": dapo_curve,
        "dapo_gain_over_base": (dapo_curve[-1][metric]["all"] - dapo_curve[0][metric]["all"]) if dapo_curve else None,
        "dapo_plateau": plateau(dapo_curve, metric),
        "complete": len(ok) == sum(len(seeds_of(config, kind)) for kind in RUN_KINDS),
    }
    if trl and dapo:
        last = next(iter(trl.values()))["curve"][-1]
        reached = [crossing(r["curve"], metric, last[metric]["all"], "wall_clock_s") for r in dapo.values()]
        summary["dapo_to_trl_final"] = {
            "trl_final": last[metric]["all"],
            "trl_train_s": last["wall_clock_s"],
            "dapo_s": reached,
            "ratio": [None if s is None else s / last["wall_clock_s"] for s in reached],
        }
    summary["targets"] = targets(summary)
    return summary


def targets(summary: dict) -> dict:
    """The issue's three targets, each True, False or None (not measurable from what finished)."""
    gain = summary["dapo_gain_over_base"]
    paired = summary["dapo_minus_grpo"]
    speed = summary.get("dapo_to_trl_final")
    ratios = speed["ratio"] if speed else []
    return {
        "gain_at_least_0.20": None if gain is None else gain >= 0.20,
        "no_loss_against_grpo": None if not paired or not paired["ci95"] else paired["ci95"][0] > NO_LOSS_MARGIN,
        "half_of_trl_wall_clock": None if not ratios else all(r is not None and r <= 0.5 for r in ratios),
    }


def format_report(config: RealModelConfig, output: Path, summary: dict) -> str:
    pick = read_json(output / "pick.json") or {}
    metric = summary["metric"]
    lines = [f"task: {pick.get('cell')} ({pick.get('reason')})", f"| run | seed | status | steps | train s | "
             f"completions | final {metric} |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, by_seed in summary["runs"].items():
        for seed, run in by_seed.items():
            value = "-" if run["final"] is None else f"{run['final']:.3f}"
            train_s = "-" if run["train_s"] is None else f"{run['train_s']:.0f}"
            lines.append(f"| {kind} | {seed} | {run['status']} | {run['steps']} | {train_s} | "
                         f"{run['generated_completions']} | {value} |")  # fmt: skip
    base, paired = summary["base"], summary["dapo_minus_grpo"]
    if base:
        lines.append(f"base model {metric}: {base['mean']:.3f} (over {base['n']} step-0 evaluations)")
    if paired:
        interval = paired["ci95"] and [round(v, 3) for v in paired["ci95"]]
        lines.append(f"DAPO - GRPO settings, final {metric} by seed {paired['seeds']} (at steps {paired['steps']}): "
                     f"{[round(v, 3) for v in paired['by_seed']]}, "
                     f"mean {paired['mean']:+.3f}, 95% t interval {interval}")  # fmt: skip
    if summary["dapo_gain_over_base"] is not None:
        lines.append(f"DAPO gain over the base model: {summary['dapo_gain_over_base']:+.3f}; plateau "
                     f"{summary['dapo_plateau']}")  # fmt: skip
    if "dapo_to_trl_final" in summary:
        speed = summary["dapo_to_trl_final"]
        lines.append(f"DAPO's wall-clock to TRL GRPOTrainer's final {metric} ({speed['trl_final']:.3f}) over TRL's "
                     f"{speed['trl_train_s']:.0f} s: {speed['ratio']}")  # fmt: skip
    lines.append(f"targets: {summary['targets']}; complete: {summary['complete']}")
    return "\n".join(lines)


def plot(config: RealModelConfig, output: Path, path: Path) -> Path:
    """Held-out avg@k per run against optimizer steps and against training wall-clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = f"avg@{config.k}"
    colours = {DAPO: "tab:blue", GRPO: "tab:orange", TRL_GRPO: "tab:green"}
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, by_seed in load_runs(config, output).items():
        for index, run in enumerate(by_seed.values()):
            values = [p[metric]["all"] for p in run["curve"]]
            label = kind if index == 0 else None
            axes[0].plot([p["step"] for p in run["curve"]], values, marker=".", color=colours[kind], label=label)
            axes[1].plot([p["wall_clock_s"] for p in run["curve"]], values, marker=".", color=colours[kind])
    axes[0].set(xlabel="optimizer step", ylabel=f"held-out {metric}")
    axes[1].set(xlabel="training wall-clock (s, evaluation excluded)", ylabel=f"held-out {metric}")
    pick = read_json(output / "pick.json") or {}
    figure.suptitle(f"SmolLM2-135M-Instruct, {pick.get('cell')}: one line per run and seed")
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
