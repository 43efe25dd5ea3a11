"""The base model on every (task family, prompt style, temperature) cell, and the pick by the issue's rule: base
pass@k within [band_low, band_high] and avg@k below max_mean, the cell whose pass@k is closest to the band's middle
(ties: the lower avg@k). Each cell is its own file under OUTPUT/grid/, kept by a rerun under the same settings."""

from __future__ import annotations

import time
from pathlib import Path

from ablation.store import read_json, write_json
from trl_dapo.data.tasks import DISTINCT, draw_problems, to_dataset

from .config import RealModelConfig
from .scoring import EngineScorer


def cell_name(family: str, style: str, temperature: float) -> str:
    return f"{family}-{style}-T{temperature:g}"


def grid_cells(config: RealModelConfig) -> list[tuple[str, str, float]]:
    return [(f, s, t) for f in config.families for s in config.styles for t in config.temperatures]


def grid_problems(config: RealModelConfig, family: str, style: str):
    """The cell's problems: the family's first draw (its held-out problems in the study, for the same seed)."""
    count = min(config.grid_problems, DISTINCT.get(family, config.grid_problems))
    return to_dataset(draw_problems(family, count, config.data_seed), family, style)


def measure_grid(config: RealModelConfig, output: Path, model, tokenizer, scorer: EngineScorer) -> list[dict]:
    """Every cell's base-model scores (measured, or kept from an earlier call under the same settings)."""
    cells = []
    for family, style, temperature in grid_cells(config):
        path = output / "grid" / f"{cell_name(family, style, temperature)}.json"
        cell = read_json(path)
        if cell is None or cell.get("settings") != config.grid_fingerprint():
            began = time.perf_counter()
            scores = scorer.score(model, grid_problems(config, family, style), temperature, config.data_seed)
            cell = {
                "family": family,
                "style": style,
                "temperature": temperature,
                "problems": min(config.grid_problems, DISTINCT.get(family, config.grid_problems)),
                **scores,
                "seconds": time.perf_counter() - began,
                "settings": config.grid_fingerprint(),
            }
            write_json(path, cell)
        print(format_cell(config, cell), flush=True)
        cells.append(cell)
    return cells


def format_cell(config: RealModelConfig, cell: dict) -> str:
    k = config.k
    return (
        f"[grid] {cell_name(cell['family'], cell['style'], cell['temperature']):<22} avg@{k} "
        f"{cell[f'avg@{k}']['all']:.3f}  pass@{k} {cell[f'pass@{k}']['all']:.3f}  answer line "
        f"{cell['answer_line']:.2f}  mean length {cell['mean_length']:.0f}  truncated {cell['truncated']:.2f}"
    )


def pick(config: RealModelConfig, cells: list[dict]) -> dict:
    """The chosen cell and why. Where no cell is in the band, the one nearest it, marked `in_band: False`."""
    k, middle = config.k, (config.band_low + config.band_high) / 2

    def miss(cell: dict) -> float:  # how far a cell is from the band's conditions (0 inside)
        passed, mean = cell[f"pass@{k}"]["all"], cell[f"avg@{k}"]["all"]
        return max(0.0, config.band_low - passed, passed - config.band_high) + max(0.0, mean - config.max_mean)

    inside = [cell for cell in cells if miss(cell) == 0.0 and cell[f"avg@{k}"]["all"] < config.max_mean]
    pool = inside or sorted(cells, key=miss)[:1]
    chosen = min(pool, key=lambda c: (abs(c[f"pass@{k}"]["all"] - middle), c[f"avg@{k}"]["all"]))
    rule = (
        f"base pass@{k} in [{config.band_low}, {config.band_high}] and avg@{k} < {config.max_mean}; of "
        f"{len(inside)} such cells, pass@{k} closest to {middle:g}"
    )
    if not inside:
        rule = f"no cell met: {rule.split(';')[0]}; the nearest cell taken instead"
    return {
        "cell": cell_name(chosen["family"], chosen["style"], chosen["temperature"]),
        "family": chosen["family"],
        "style": chosen["style"],
        "temperature": chosen["temperature"],
        f"base_avg@{k}": chosen[f"avg@{k}"]["all"],
        f"base_pass@{k}": chosen[f"pass@{k}"]["all"],
        "in_band": bool(inside),
        "candidates": [cell_name(c["family"], c["style"], c["temperature"]) for c in inside],
        "reason": rule,
    }
