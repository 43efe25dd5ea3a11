"""A study in one file (`study.json`: settings, every call's environment, grid, pick with the pilot, every run's record,
when each ran, the summary; everything but the model), and back: `unpack` lays a bundle out as a study folder, so
`--report` reads a bundle kept under benchmarks/results/ as it reads the folder it came from.

The first study (2026-12-06, `add1`) wrote its bundle before the grid had caps and the pick had a pilot: its settings
name one `max_completion_length`, learning rate and step count, which `unpack` moves into its pick and grid cells,
and it ran no second cell, partial-rollout, ablation, TRL-vLLM or continuous-batching arms, which its settings then
list no seeds for (its TRL `generate` arm ran seed 0 alone: the report lists seeds 1 and 2 as left).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ablation.store import read_json, write_json

from .config import SEED_FIELDS, RealModelConfig
from .grid import cell_name
from .pilot import early_step


def bundle(config: RealModelConfig, output: Path, summary: dict) -> dict:
    """Everything the study measured, in one dictionary without the model."""
    return {
        "environment": read_json(output / "environment.json"),
        "settings": asdict(config),
        "grid": [read_json(path) for path in sorted((output / "grid").glob("*.json"))],
        "pick": read_json(output / "pick.json"),
        "runs": {path.stem: read_json(path) for path in sorted((output / "runs").glob("*.json"))},
        "schedule": read_json(output / "schedule.json"),
        "summary": summary,
    }


def legacy_pick(settings: dict, pick: dict, config: RealModelConfig) -> dict:
    """The first study's pick in this version's layout: its task's cap, rate and steps were settings."""
    steps = settings["max_steps"]
    return {**pick, "cap": settings["max_completion_length"], "learning_rate": settings["learning_rate"],
            "max_steps": steps, "early_step": early_step(config, steps)}  # fmt: skip


def legacy_cell(cell: dict, cap: int) -> dict:
    """A first-study grid cell (one cap, its scores beside its name) in this version's layout (scores per cap)."""
    names = ("family", "style", "temperature", "problems", "seconds", "settings")
    return {**{k: cell[k] for k in names if k in cell}, "caps": {str(cap): {k: v for k, v in cell.items()
                                                                            if k not in names}}}  # fmt: skip


def unpack(path: Path, folder: Path) -> RealModelConfig:
    """The bundle at `path` written out as a study folder at `folder`; its settings."""
    data = json.loads(path.read_text())
    settings = dict(data["settings"])
    legacy = "caps" not in settings
    if legacy:
        settings |= {field: () for field in SEED_FIELDS if field != "seeds"}
    config = RealModelConfig.from_dict(settings)
    folder.mkdir(parents=True, exist_ok=True)
    config.save(folder / "study_config.json")
    pick = legacy_pick(data["settings"], data["pick"], config) if legacy else data["pick"]
    write_json(folder / "pick.json", pick)
    write_json(folder / "environment.json", data["environment"])
    for cell in data["grid"]:
        cell = legacy_cell(cell, data["settings"]["max_completion_length"]) if legacy else cell
        write_json(folder / "grid" / f"{cell_name(cell['family'], cell['style'], cell['temperature'])}.json", cell)
    for name, run in data["runs"].items():
        write_json(folder / "runs" / f"{name}.json", run)
    if data.get("schedule"):
        write_json(folder / "schedule.json", data["schedule"])
    return config
