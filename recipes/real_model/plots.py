"""The study's PNGs: `study.png`, held-out accuracy per arm against optimizer steps and training wall-clock, and the
accuracy among completions with an `Answer:` line; `mechanisms.png`, the curves beyond accuracy (held-out entropy,
length, truncated and answer-line shares at each evaluation; per optimizer step the training entropy, the truncated
share and mean length of every generated completion, the clip fractions, the groups kept over drawn, the share of
informative groups drawn and the train/rollout logprob gap). Each arm: the mean over its finished seeds, thick, and
each run thin."""

from __future__ import annotations

from pathlib import Path

from ablation.report import _mean_curve, _mean_series

from .config import RUN_KINDS
from .report import accuracy

HELD_OUT = (
    ("entropy", "held-out entropy (nats per sampled token)"),
    ("mean_length", "held-out mean length (tokens)"),
    ("truncated", "held-out share cut at the cap"),
    ("answer_line", "held-out share with an Answer: line"),
)
TRAINING = (
    ("entropy", "training entropy (trained tokens)"),
    ("study/truncated", "share cut at the cap, every generated completion"),
    ("study/mean_length", "mean length, every generated completion"),
    ("clip_ratio/low_mean", "tokens clipped below (ratio < 1 - eps, A < 0)"),
    ("clip_ratio/high_mean", "tokens clipped above (ratio > 1 + eps_high, A > 0)"),
    ("kept_over_drawn", "groups kept / drawn (dynamic sampling)"),
    ("study/informative_groups", "informative groups among those drawn"),
    ("logprob_gap_mean", "train / rollout logprob gap (mean |diff|)"),
)


def with_kept_over_drawn(run: dict) -> dict:
    """The run with the per-step ratio of groups kept to groups drawn among its training series."""
    kept = dict(map(tuple, run["train"].get("dapo/qualified_groups", [])))
    drawn = dict(map(tuple, run["train"].get("dapo/generated_groups", [])))
    ratio = [[step, kept[step] / drawn[step]] for step in sorted(set(kept) & set(drawn)) if drawn[step]]
    return {**run, "train": {**run["train"], "kept_over_drawn": ratio}}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(runs: dict) -> dict[str, str]:
    return {kind: f"C{index}" for index, kind in enumerate(k for k in RUN_KINDS if k in runs)}


def _curve_panel(axis, runs: dict, x: str, y, title: str, colours: dict) -> None:
    for kind, by_seed in runs.items():
        finished = [run for run in by_seed.values() if all(y(p) is not None for p in run["curve"])]
        for run in finished:
            axis.plot([p[x] for p in run["curve"]], [y(p) for p in run["curve"]], color=colours[kind], lw=0.6,
                      alpha=0.35)  # fmt: skip
        if finished:
            xs, means, _, _ = _mean_curve(finished, x, y)
            axis.plot(xs, means, color=colours[kind], lw=2, marker=".", label=kind)
    axis.set_title(title, fontsize=9)
    axis.grid(alpha=0.3)


def _legend(axes) -> None:
    """On the first panel with labelled lines (a panel of a metric no run recorded has none)."""
    for axis in axes:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
            return


def plot_accuracy(runs: dict, metric: str, title: str, path: Path) -> Path:
    plt = _pyplot()
    colours = _colours(runs)
    figure, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _curve_panel(axes[0], runs, "step", accuracy(metric), f"held-out {metric} by optimizer step", colours)
    _curve_panel(axes[1], runs, "wall_clock_s", accuracy(metric), f"held-out {metric} by training wall-clock (s)",
                 colours)  # fmt: skip
    _curve_panel(axes[2], runs, "step", lambda p: p.get("line_accuracy"),
                 "held-out accuracy among completions with an Answer: line", colours)  # fmt: skip
    _legend(axes)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def plot_mechanisms(runs: dict, title: str, path: Path) -> Path:
    plt = _pyplot()
    colours = _colours(runs)
    figure, axes = plt.subplots(3, 4, figsize=(20, 12))
    for axis, (name, label) in zip(axes.flat, HELD_OUT, strict=False):
        _curve_panel(axis, runs, "step", lambda p, n=name: p.get(n), label, colours)
    for axis, (name, label) in zip(axes.flat[len(HELD_OUT) :], TRAINING, strict=True):
        for kind, by_seed in runs.items():
            finished = [with_kept_over_drawn(run) for run in by_seed.values()]
            steps, values = _mean_series(finished, name)
            if steps:
                axis.plot(steps, values, color=colours[kind], marker="." if len(steps) < 50 else None, label=kind)
        axis.set_title(label, fontsize=9)
        axis.grid(alpha=0.3)
    _legend(axes.flat)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
