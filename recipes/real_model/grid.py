"""The base model on every (task family, prompt style) at the rollout temperature, sampled once up to the largest
length cap and scored at every cap (`scoring.cap_scores`), and the candidates for the study's regime by its rule:

- base avg@k at most `max_base_avg` and pass@k at least `min_base_pass` (most groups all-wrong, some problems
  sometimes right: dynamic sampling has work);
- at least `min_truncated` of the completions cut at the cap (the overlong shaping has work);
- per family and style, the smallest cap that meets both (lowering the cap is a fair way to reach the truncated share,
  and the shorter the cap the cheaper every run); candidates ordered by pass@k, highest first (the most learnable),
  ties by the lower avg@k. The pilot (`pilot.py`) tries the first `pilot_cells` of them.

Each (family, style) is its own file under OUTPUT/grid/, kept by a rerun under the same settings.
"""

from __future__ import annotations

import time
from pathlib import Path

from ablation.store import read_json, write_json
from trl_dapo.data.tasks import DISTINCT, draw_problems, to_dataset

from .config import RealModelConfig
from .scoring import EngineScorer, cap_scores


def cell_name(family: str, style: str, temperature: float, cap: int | None = None) -> str:
    name = f"{family}-{style}-T{temperature:g}"
    return name if cap is None else f"{name}-c{cap}"


def grid_problems(config: RealModelConfig, family: str, style: str):
    """The cell's problems: the family's first draw (its held-out problems in the study, for the same seed)."""
    count = min(config.grid_problems, DISTINCT.get(family, config.grid_problems))
    return to_dataset(draw_problems(family, count, config.data_seed), family, style)


def measure_grid(config: RealModelConfig, output: Path, model, tokenizer, scorer: EngineScorer) -> list[dict]:
    """Every (family, style)'s base-model scores per cap (measured, or kept from an earlier call under the same
    settings); the scorer samples up to the largest cap."""
    cells = []
    for family in config.families:
        for style in config.styles:
            path = output / "grid" / f"{cell_name(family, style, config.temperature)}.json"
            cell = read_json(path)
            if cell is None or cell.get("settings") != config.grid_fingerprint():
                began = time.perf_counter()
                problems = grid_problems(config, family, style)
                samples = scorer.sample(model, problems, config.temperature, config.data_seed)
                cell = {
                    "family": family,
                    "style": style,
                    "temperature": config.temperature,
                    "problems": len(problems),
                    "caps": {str(cap): cap_scores(samples, tokenizer, cap) for cap in config.caps},
                    "seconds": time.perf_counter() - began,
                    "settings": config.grid_fingerprint(),
                }
                write_json(path, cell)
            print("\n".join(format_cell(config, row) for row in rows_of(cell)), flush=True)
            cells.append(cell)
    return cells


def rows_of(cell: dict) -> list[dict]:
    """One row per cap: the cell's scores at that cap with its family, style, temperature and cap."""
    base = {key: cell[key] for key in ("family", "style", "temperature")}
    return [{**base, "cap": int(cap), **scores} for cap, scores in cell["caps"].items()]


def format_cell(config: RealModelConfig, row: dict) -> str:
    k = config.k
    line = row["line_accuracy"] if row.get("line_accuracy") is not None else float("nan")
    return (
        f"[grid] {cell_name(row['family'], row['style'], row['temperature'], row['cap']):<24} avg@{k} "
        f"{row[f'avg@{k}']['all']:.3f}  pass@{k} {row[f'pass@{k}']['all']:.3f}  answer line "
        f"{row['answer_line']:.2f} (right among them {line:.3f})  mean length {row['mean_length']:.0f}  truncated "
        f"{row['truncated']:.2f}"
    )


def miss(config: RealModelConfig, row: dict) -> float:
    """How far a row is from the regime's conditions (0: it meets them all)."""
    k = config.k
    mean, passed = row[f"avg@{k}"]["all"], row[f"pass@{k}"]["all"]
    return (
        max(0.0, mean - config.max_base_avg)
        + max(0.0, config.min_base_pass - passed)
        + max(0.0, config.min_truncated - row["truncated"])
    )


def candidates(config: RealModelConfig, cells: list[dict]) -> dict:
    """The regime's candidate rows in the pilot's order and whether any met the rule; where none did, the nearest
    row alone (`in_band: False`)."""
    k = config.k
    meeting = {}
    for cell in cells:
        rows = sorted((row for row in rows_of(cell) if miss(config, row) == 0.0), key=lambda row: row["cap"])
        if rows:
            meeting[(cell["family"], cell["style"])] = rows[0]  # the smallest cap that meets the rule
    ordered = sorted(meeting.values(), key=lambda row: (-row[f"pass@{k}"]["all"], row[f"avg@{k}"]["all"]))
    if not ordered:
        every = [row for cell in cells for row in rows_of(cell)]
        ordered = sorted(every, key=lambda row: (miss(config, row), row["cap"]))[:1]
    rule = (
        f"base avg@{k} <= {config.max_base_avg}, pass@{k} >= {config.min_base_pass}, truncated >= "
        f"{config.min_truncated}; per family and style the smallest cap that meets it; by pass@{k}, highest first"
    )
    return {"rule": rule, "in_band": bool(meeting), "rows": ordered}
