"""The study's report as Markdown tables (printed, and pasted into docs/real-model.md): the grid, the pilot and the
picks, then per cell every run, the paired comparisons, each arm's time to the held-out levels, partial rollouts'
verdict and the targets."""

from __future__ import annotations

from pathlib import Path

from ablation.store import read_json

from .config import CELLS, RealModelConfig
from .grid import cell_name, rows_of
from .pilot import picked

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


def runs_table(cell: dict) -> list[str]:
    metric, rows = cell["metric"], []
    for kind, by_seed in cell["runs"].items():
        for seed, run in by_seed.items():
            note = run["note"] if isinstance(run["note"], str) else " ".join(run["note"])
            rows.append([kind, seed, run["status"], str(run["steps"]), _number(run["train_s"], 0),
                         _number(run["s_per_step"], 2), str(run["generated_completions"]), _number(run["final"]),
                         _number(run["auc_steps"]), _number(run["sharing"], 1), _number(run["peak_reserved_gib"], 1),
                         note[:80]])  # fmt: skip
    header = ["run", "seed", "status", "steps", "training s", "s/step", "completions", f"final {metric}",
              f"AUC {metric}", "runs sharing", "peak GiB", "note"]  # fmt: skip
    return _table(header, rows)


def comparison_table(cell: dict) -> list[str]:
    rows = []
    for name, comparison in cell["comparisons"].items():
        for measure, label in MEASURE_LABELS.items():
            stats = comparison.get(measure)
            if not stats:
                continue
            by_seed = ", ".join(f"{seed}: {value:+.3f}" for seed, value in stats["by_seed"].items())
            interval = "-" if not stats["ci95"] else f"{stats['ci95'][0]:+.3f} to {stats['ci95'][1]:+.3f}"
            unlike = stats.get("left_out_for_sharing") or 0
            rows.append([name, label, by_seed, f"{stats['mean']:+.3f}", interval, str(stats["n"]),
                         str(stats["seeds_to_decide"] or "-"), str(unlike)])  # fmt: skip
    header = ["comparison", "measure", "by seed", "mean", "95% interval", "seeds", "seeds that would decide",
              "pairs left out (sharing)"]  # fmt: skip
    return _table(header, rows) if rows else ["no pair of runs has finished yet"]


def level_table(cell: dict) -> list[str]:
    """Per arm and level: the share of seeds reaching it, the median seconds and step, and each seed's seconds."""
    rows = []
    for entry in cell["levels"]:
        for kind, arm in entry["arms"].items():
            seconds = ", ".join(f"{seed}: {_number(row['wall_clock_s'], 0)}" for seed, row in arm["by_seed"].items())
            rows.append([f"{entry['level']:g}", kind, f"{arm['reached']}/{arm['seeds']}",
                         _number(arm["median_wall_clock_s"], 1), _number(arm["median_step"], 1), seconds])  # fmt: skip
    header = ["held-out level", "run", "seeds reaching it", "median training s", "median step",
              "training s by seed (- : not reached)"]  # fmt: skip
    return _table(header, rows) if rows else []


def cell_report(label: str, cell: dict, pick: dict) -> list[str]:
    lines = [f"## {label} cell: {pick.get('cell')}, cap {pick.get('cap')}, learning rate "
             f"{pick.get('learning_rate')}, {pick.get('max_steps')} steps, early step {pick.get('early_step')}",
             f"why: {pick.get('reason')}", f"TRL's faster path here: {cell['trl_path']}", ""]  # fmt: skip
    for table in (runs_table(cell), comparison_table(cell), level_table(cell)):
        lines += [*table, ""] if table else []
    lines.append(f"partial rollouts with kept KV against full DAPO: {cell['partial_rollouts']['verdict']}; "
                 f"propose as the default: {cell['partial_rollouts']['propose_default']}")  # fmt: skip
    marks = {True: "met", False: "NOT met", None: "not measured"}
    lines += ["targets: " + ", ".join(f"{key} {marks[value]}" for key, value in cell["targets"].items()), ""]
    return lines


def format_report(config: RealModelConfig, output: Path, summary: dict) -> str:
    pick = read_json(output / "pick.json") or {}
    lines = []
    for table in (grid_table(config, output), pilot_table(pick)):
        lines += [*table, ""] if table else []
    for cell in CELLS:
        if cell in summary["cells"]:
            chosen = picked(pick, cell) or {}
            if not chosen.get("cell") and chosen.get("family"):  # the first study's pick has no cell name
                chosen = {**chosen, "cell": cell_name(chosen["family"], chosen["style"], chosen["temperature"])}
            lines += cell_report(cell, summary["cells"][cell], chosen)
    if summary["skipped"]:
        lines.append(f"skipped: {summary['skipped']} (see their notes)")
    lines.append(f"complete: {summary['complete']}" + (f"; left: {summary['left']}" if summary["left"] else ""))
    return "\n".join(lines)
