"""The math recipe's end-of-run report: a per-step plot and a first-vs-last summary of the logged metrics.

It lives beside `dapo_math.py`, its only user: the trainer and the evaluator log the metrics, and which of them a run's
report shows (the recipe's accuracy, reward, sampling efficiency and length) is the recipe's choice, not the package's.
"""

from __future__ import annotations

import math
from pathlib import Path

PANELS = {
    "accuracy": ("math/accuracy", "eval/accuracy"),
    "reward": ("reward",),
    "sampling efficiency": ("dapo/sampling_efficiency",),
    "response length": ("completions/mean_length",),
}
SUMMARY_METRICS = (
    "math/accuracy",
    "eval/accuracy",
    "reward",
    "dapo/sampling_efficiency",
    "dapo/gen_batches",
    "completions/mean_length",
)


def series(log_history: list[dict], name: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[name]) for h in log_history if isinstance(h.get(name), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def plot_training(log_history: list[dict], path: str | Path) -> Path:
    """A 2x2 PNG: accuracy (train samples and held-out), reward, sampling efficiency, response length per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    for axis, (title, names) in zip(axes.flat, PANELS.items(), strict=True):
        for name in names:
            steps, values = series(log_history, name)
            if steps:
                axis.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def summarize(log_history: list[dict], window: int = 10) -> dict[str, dict[str, float]]:
    """Mean of each summary metric over its first and its last `window` logged steps (all of them where it was logged
    fewer times), with the number of logs each mean covers."""
    summary = {}
    for name in SUMMARY_METRICS:
        _, values = series(log_history, name)
        if values:
            first, last = values[:window], values[-window:]
            summary[name] = {"first": sum(first) / len(first), "last": sum(last) / len(last), "logs": len(first)}
    return summary


def _logs(count: int) -> str:
    return f"{count} log" if count == 1 else f"{count} logs"


def format_summary(summary: dict[str, dict[str, float]]) -> str:
    """A Markdown table of first and last means. The header counts the logs the means cover (fewer than the window
    where a run logged fewer), and a metric logged fewer times than the others (held-out accuracy) says its own
    count."""
    logs = max(int(values["logs"]) for values in summary.values()) if summary else 0
    lines = [f"| metric | first {_logs(logs)} | last {_logs(logs)} |", "|---|---|---|"]
    for name, values in summary.items():
        first, last = (f"{v:.3f}" if math.isfinite(v) else "n/a" for v in (values["first"], values["last"]))
        label = name if values["logs"] == logs else f"{name} ({_logs(int(values['logs']))})"
        lines.append(f"| {label} | {first} | {last} |")
    return "\n".join(lines)


def format_outputs(output_dir: str | Path, tensorboard_dirs: list[str]) -> str:
    """Where a run's outputs went: the trained model (or adapter), the plot, the summary, TensorBoard's logs."""
    output = Path(output_dir)
    lines = [
        "Outputs:",
        f"- trained model: {output}",
        f"- training curves: {output / 'training_curves.png'}",
        f"- summary: {output / 'summary.json'}",
    ]
    lines += [f"- TensorBoard logs: {folder}" for folder in tensorboard_dirs]
    return "\n".join(lines)
