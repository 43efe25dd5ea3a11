"""The study's report as Markdown tables (printed, and pasted into docs/real-model.md): the grid, the pilot and the
pick, every run, the paired comparisons, the TRL wall-clock arms, partial rollouts' verdict and the targets."""

from __future__ import annotations

from pathlib import Path

from ablation.store import read_json

from .config import RealModelConfig
from .grid import cell_name, rows_of

MEASURE_LABELS = {
    "auc_steps": "AUC over steps",
    "early": "at the early step",
    "final": "at the last step",
    "auc_wall_clock": "AUC over training wall-clock",
    "line_accuracy_auc": "AUC of accuracy among completions with an Answer: line",
    "entropy_last": "held-out entropy at the last step",
    "truncated_after_start": "held-out truncated share after the start",
    "train_s": "training wall-clock s",
}


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def grid_table(config: RealModelConfig, output: Path) -> list[str]:
    k, rows = config.k, []
    for path in sorted((output / "grid").glob("*.json")):
        for row in rows_of(read_json(path)):
            rows.append([row["family"], row["style"], f"{row['temperature']:g}", str(row["cap"]),
                         _number(row[f"avg@{k}"]["all"]), _number(row[f"pass@{k}"]["all"]),
                         _number(row["answer_line"], 2), _number(row.get("line_accuracy")),
                         _number(row["mean_length"], 0), _number(row["truncated"], 2)])  # fmt: skip
    header = ["family", "prompt", "T", "cap", f"avg@{k}", f"pass@{k}", "Answer: line", "right among them",
              "mean length", "truncated"]  # fmt: skip
    return _table(header, rows) if rows else []


def pilot_table(pick: dict) -> list[str]:
    rows = []
    for entry in pick.get("pilot", []):
        curve = ", ".join(f"{step}: {value:.3f}" for step, value, _ in entry.get("curve", []))
        rows.append([entry["cell"], f"{entry['learning_rate']:g}", entry["status"], curve or "-",
                     _number(entry.get("step_to_level"), 1), _number(entry.get("line_accuracy_gain")),
                     "yes" if entry["learned"] else "no"])  # fmt: skip
    header = ["cell", "learning rate", "status", "held-out avg by step", "step past the level", "line accuracy gain",
              "learned"]  # fmt: skip
    return _table(header, rows) if rows else []


def runs_table(summary: dict) -> list[str]:
    metric, rows = summary["metric"], []
    for kind, by_seed in summary["runs"].items():
        for seed, run in by_seed.items():
            note = run["note"] if isinstance(run["note"], str) else " ".join(run["note"])
            rows.append([kind, seed, run["status"], str(run["steps"]), _number(run["train_s"], 0),
                         _number(run["s_per_step"], 2), str(run["generated_completions"]), _number(run["final"]),
                         _number(run["auc_steps"]), _number(run["sharing"], 1), _number(run["peak_reserved_gib"], 1),
                         note[:80]])  # fmt: skip
    header = ["run", "seed", "status", "steps", "training s", "s/step", "completions", f"final {metric}",
              f"AUC {metric}", "runs sharing", "peak GiB", "note"]  # fmt: skip
    return _table(header, rows)


def comparison_table(summary: dict) -> list[str]:
    rows = []
    for name, comparison in summary["comparisons"].items():
        for measure, label in MEASURE_LABELS.items():
            stats = comparison.get(measure)
            if not stats:
                continue
            by_seed = ", ".join(f"{seed}: {value:+.3f}" for seed, value in stats["by_seed"].items())
            interval = "-" if not stats["ci95"] else f"{stats['ci95'][0]:+.3f} to {stats['ci95'][1]:+.3f}"
            rows.append([name, label, by_seed, f"{stats['mean']:+.3f}", interval, str(stats["n"]),
                         str(stats["seeds_to_decide"] or "-")])  # fmt: skip
    header = ["comparison", "measure", "by seed", "mean", "95% interval", "seeds", "seeds that would decide"]
    return _table(header, rows) if rows else ["no pair of runs has finished yet"]


def wall_clock_table(summary: dict) -> list[str]:
    lines = []
    for entry in summary["wall_clock"]:
        rows = [[r["kind"], str(r["seed"]), _number(r["wall_clock_s"], 1), _number(r["step"], 1),
                 _number(r["sharing"], 1), "-"] for r in entry["dapo"]]  # fmt: skip
        rows += [[r["kind"], str(r["seed"]), _number(r["wall_clock_s"], 1), _number(r["step"], 1),
                  _number(r["sharing"], 1), _number(r["dapo_over_this"], 2)] for r in entry["trl"].values()]  # fmt: skip
        lines += [f"training wall-clock to held-out {summary['metric']} {entry['level']:.3f} (- : not reached)"]
        header = ["run", "seed", "seconds", "step", "runs sharing", "DAPO's mean over this"]
        lines += [*_table(header, rows), ""]
    return lines


def format_report(config: RealModelConfig, output: Path, summary: dict) -> str:
    pick = read_json(output / "pick.json") or {}
    name = pick.get("cell") or cell_name(pick.get("family"), pick.get("style"), pick.get("temperature", 1.0))
    lines = [f"task: {name}, cap {pick.get('cap')}, learning rate {pick.get('learning_rate')}, "
             f"{pick.get('max_steps')} steps, early step {pick.get('early_step')}", f"why: {pick.get('reason')}", ""]  # fmt: skip
    for table in (grid_table(config, output), pilot_table(pick), runs_table(summary), comparison_table(summary)):
        lines += [*table, ""] if table else []
    lines += wall_clock_table(summary)
    lines.append(f"partial rollouts with kept KV against full DAPO: {summary['partial_rollouts']['verdict']}; "
                 f"propose as the default: {summary['partial_rollouts']['propose_default']}")  # fmt: skip
    marks = {True: "met", False: "NOT met", None: "not measured"}
    lines.append("targets: " + ", ".join(f"{key} {marks[value]}" for key, value in summary["targets"].items()))
    if summary["skipped"]:
        lines.append(f"skipped: {summary['skipped']} (see their notes)")
    lines.append(f"complete: {summary['complete']}" + (f"; left: {summary['left']}" if summary["left"] else ""))
    return "\n".join(lines)
