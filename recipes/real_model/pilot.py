"""The pilot and the pick: short runs of GRPO's settings on the grid's first candidates at each pilot learning rate,
and a rule fixed before any arm runs that reads them (never the difference between DAPO and GRPO's settings: the
pilot runs neither DAPO nor a second arm).

A pilot run *learned* when its held-out avg@k passed `learned_level` and, between its first and last evaluations, the
accuracy among completions that have an `Answer:` line rose by at least `line_accuracy_gain`: it learned more than to
write the line. The pick is the learned run that passed `learned_level` at the earliest step (interpolated between
evaluations; ties: the larger line-accuracy gain, then the lower learning rate). Its cell and learning rate are the
study's, and its step count is twice that step, rounded up to a generation batch and kept within [min_steps,
max_steps]: the runs go on as long again after learning shows, and stop before the ceiling where every arm ties.
Where no run learned, the run with the highest held-out avg@k is taken, marked `learned: false`, with `max_steps`.

The second cell (`pick["second"]`) is picked by the same rule among the pilot runs of the other cells, at the same
time: one cell shows a case, two show a pattern, and both are fixed before any arm runs.

Why GRPO's settings: it is the cheaper arm (no extra rounds), and any advantage the pick could give one arm goes to
the baseline, so it cannot make DAPO look better.
"""

from __future__ import annotations

import math
from pathlib import Path

from ablation.report import crossing
from ablation.store import read_json

from .config import CELLS, GRPO, PILOT, RealModelConfig
from .grid import cell_name


def pilot_jobs(config: RealModelConfig, output: Path, regime: dict) -> list[dict]:
    """One job per (candidate cell, pilot learning rate), candidates in the grid's order."""
    jobs = []
    for row in regime["rows"][: config.pilot_cells]:
        task = {key: row[key] for key in ("family", "style", "temperature", "cap")}
        name = cell_name(**task)
        task["cell"] = name
        for rate in config.pilot_learning_rates:
            jobs.append({
                "name": f"{PILOT}-{name}-lr{rate:g}",
                "kind": PILOT,
                "arm": GRPO,
                "seed": config.pilot_seed,
                "task": task,
                "learning_rate": rate,
                "max_steps": config.pilot_steps,
                "record": str(output / "pilot" / f"{name}-lr{rate:g}.json"),
            })  # fmt: skip
    return jobs


def reading(config: RealModelConfig, job: dict, record: dict | None) -> dict:
    """What the rule reads of one pilot run."""
    metric = f"avg@{config.k}"
    entry = {"job": job["name"], "cell": job["task"]["cell"], "learning_rate": job["learning_rate"]}
    if not record or record.get("status") != "ok" or not record["curve"]:
        return entry | {"status": (record or {}).get("status", "not run"), "learned": False}
    curve = record["curve"]
    first, last = curve[0].get("line_accuracy") or 0.0, curve[-1].get("line_accuracy") or 0.0
    reached = crossing(curve, metric, config.learned_level, "step")
    gain = last - first
    return entry | {
        "status": "ok",
        "curve": [[point["step"], point[metric]["all"], point.get("line_accuracy")] for point in curve],
        "best": max(point[metric]["all"] for point in curve),
        "step_to_level": reached,
        "line_accuracy_gain": gain,
        "learned": reached is not None and reached > 0 and gain >= config.line_accuracy_gain,
    }


def study_steps(config: RealModelConfig, step_to_level: float | None) -> int:
    if step_to_level is None:
        return config.max_steps
    batch = config.optimizer_steps_per_generation
    steps = math.ceil(2 * step_to_level / batch) * batch
    return min(config.max_steps, max(config.min_steps, steps))


def early_step(config: RealModelConfig, max_steps: int) -> int:
    """The fixed early step of the comparison: the last evaluation at or before half the run (the first after the
    start if none)."""
    steps = config.eval_steps(max_steps)[1:]
    return max((s for s in steps if s <= max_steps / 2), default=steps[0])


def choose(config: RealModelConfig, readings: list[dict]) -> tuple[dict, str] | None:
    """The rule's run among `readings` and why; None where none finished."""
    learned = [r for r in readings if r["learned"]]
    finished = [r for r in readings if r["status"] == "ok"]
    if learned:
        chosen = min(learned, key=lambda r: (r["step_to_level"], -r["line_accuracy_gain"], r["learning_rate"]))
        return chosen, (f"learned (held-out avg@{config.k} past {config.learned_level} and line accuracy up by "
                        f">= {config.line_accuracy_gain}); of {len(learned)} such runs, the earliest past "
                        f"{config.learned_level}")  # fmt: skip
    if finished:
        return max(finished, key=lambda r: (r["best"], -r["learning_rate"])), (
            "no pilot run learned: the highest held-out avg@k taken instead"
        )
    return None


def cell_pick(config: RealModelConfig, regime: dict, jobs: list[dict], chosen: dict, reason: str) -> dict:
    """One cell's task, learning rate, step count and fixed early step, with its grid row and why."""
    job = next(j for j in jobs if j["name"] == chosen["job"])
    steps = study_steps(config, chosen.get("step_to_level"))
    row = next(r for r in regime["rows"] if cell_name(r["family"], r["style"], r["temperature"], r["cap"])
               == job["task"]["cell"])  # fmt: skip
    return {
        **job["task"],
        "learning_rate": job["learning_rate"],
        "max_steps": steps,
        "early_step": early_step(config, steps),
        f"base_avg@{config.k}": row[f"avg@{config.k}"]["all"],
        f"base_pass@{config.k}": row[f"pass@{config.k}"]["all"],
        "base_truncated": row["truncated"],
        "in_band": regime["in_band"],
        "learned": chosen["learned"],
        "reason": f"{regime['rule']}; pilot: {reason}; steps: twice the step it passed {config.learned_level}, "
        f"within [{config.min_steps}, {config.max_steps}]",
    }


def pick(config: RealModelConfig, output: Path, regime: dict, jobs: list[dict]) -> dict:
    """The study's task, learning rate, step count and fixed early step, with the pilot's readings and why; under
    "second", the second cell's, by the same rule among the other cells' pilot runs (None with one pilot cell)."""
    readings = [reading(config, job, read_json(Path(job["record"]))) for job in jobs]
    first = choose(config, readings)
    if first is None:
        raise RuntimeError(f"no pilot run finished ({[r['status'] for r in readings]}); see {output / 'logs'}.")
    others = choose(config, [r for r in readings if r["cell"] != first[0]["cell"]])
    return {
        **cell_pick(config, regime, jobs, *first),
        "second": None if others is None else cell_pick(config, regime, jobs, *others),
        "pilot": readings,
        "settings": config.fingerprint(),
    }


def picked(pick: dict, cell: str) -> dict | None:
    """The pick of one of `CELLS`: the first is the pick itself, the second its "second" entry (None: none picked)."""
    return pick if cell == CELLS[0] else pick.get("second")
