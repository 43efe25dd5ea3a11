"""The real-model study (`recipes/dapo_real_model.py`): the task generator, the grid's pick by the issue's rule, the
report's paired difference and targets, and the whole `--smoke` pipeline on a tiny model (grid of one cell, one step
per run, one evaluation after it), so the GPU command cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ablation.store import write_json
from dapo_real_model import launch_runs, parse_args, study_config
from real_model.config import DAPO, GRPO, STUDY, TRL_GRPO, RealModelConfig, smoke
from real_model.grid import pick
from real_model.report import summarize
from real_model.runs import run_file
from trl_dapo.data.tasks import FAMILIES, PROMPT_STYLES, draw_problems, task_splits

ROOT = Path(__file__).parent.parent


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_states_problems_whose_answer_is_right(family):
    for text, answer in draw_problems(family, 50, seed=3):
        numbers = _numbers(text)
        if family == "word2":  # has a, buys b more, gives c away
            a, b, c = numbers
            assert answer == a + b - c >= 0
        else:
            a, b = numbers
            assert answer == a + b
            digits = sorted(len(str(n)) for n in (a, b))
            assert digits == {"add1": [1, 1], "add12": [1, 2], "add2": [2, 2]}[family]


def test_splits_are_deterministic_disjoint_and_styled():
    first, again = task_splits("add2", "oneshot", 200, 64, seed=7), task_splits("add2", "oneshot", 200, 64, seed=7)
    assert first["train"]["problem"] == again["train"]["problem"] and len(first["test"]) == 64
    assert not set(first["train"]["problem"]) & set(first["test"]["problem"])
    row = first["test"][0]
    assert row["prompt"][0]["content"] == PROMPT_STYLES["oneshot"].format(problem=row["problem"])
    assert row["answer"] == str(sum(_numbers(row["problem"])))
    # the study's held-out problems are the grid's first ones: the grid measured the base model on them
    assert first["test"]["problem"] == [text for text, _ in draw_problems("add2", 64, seed=7)]


def test_one_digit_addition_trains_on_what_the_held_out_set_leaves():
    splits = task_splits("add1", "dapo", 1000, 64, seed=0)
    assert len(splits["train"]) == 100 - 64 and not set(splits["train"]["problem"]) & set(splits["test"]["problem"])
    with pytest.raises(ValueError, match="num_test=100 leaves none"):
        task_splits("add1", "dapo", 10, 100)
    with pytest.raises(ValueError, match="family='add3' is unknown"):
        task_splits("add3", "dapo", 10, 10)


def _cell(family: str, mean: float, passed: float, style: str = "dapo", temperature: float = 1.0) -> dict:
    return {"family": family, "style": style, "temperature": temperature, "avg@16": {"all": mean},
            "pass@16": {"all": passed}}  # fmt: skip


def test_pick_takes_the_cell_in_the_band_closest_to_its_middle():
    cells = [
        _cell("add1", 0.06, 0.38),  # in the band, 0.12 from its middle
        _cell("add2", 0.01, 0.13),  # pass@16 below the band
        _cell("add12", 0.45, 0.60),  # pass@16 in the band, but avg@16 above 0.4
        _cell("word2", 0.20, 0.56, "oneshot", 0.7),  # in the band, 0.06 from its middle: the pick
    ]
    chosen = pick(STUDY, cells)
    assert chosen["cell"] == "word2-oneshot-T0.7" and chosen["in_band"]
    assert chosen["candidates"] == ["add1-dapo-T1", "word2-oneshot-T0.7"]
    nearest = pick(STUDY, [_cell("add2", 0.01, 0.13), _cell("add1", 0.02, 0.05)])
    assert nearest["cell"] == "add2-dapo-T1" and not nearest["in_band"] and "no cell met" in nearest["reason"]


def _run(output: Path, kind: str, seed: int, values: list[float], status: str = "ok", seconds: float = 10.0) -> None:
    curve = [{"step": 8 * i, "wall_clock_s": seconds * i, "avg@16": {"all": v}} for i, v in enumerate(values)]
    write_json(run_file(output, kind, seed), {"kind": kind, "seed": seed, "status": status, "curve": curve,
                                              "steps": 8 * (len(values) - 1), "train_s": curve[-1]["wall_clock_s"]})  # fmt: skip


def test_report_pairs_by_seed_at_the_last_common_step_and_reads_the_targets(tmp_path):
    config = STUDY
    _run(tmp_path, DAPO, 0, [0.10, 0.30, 0.40])
    _run(tmp_path, DAPO, 1, [0.10, 0.35, 0.36])
    _run(tmp_path, DAPO, 2, [0.10, 0.20], status="stopped")  # a time budget stopped it after one evaluation
    _run(tmp_path, GRPO, 0, [0.10, 0.25, 0.30])
    _run(tmp_path, GRPO, 1, [0.10, 0.30, 0.34])
    _run(tmp_path, GRPO, 2, [0.10, 0.22, 0.28])
    _run(tmp_path, TRL_GRPO, 0, [0.10, 0.20, 0.30], seconds=40.0)
    summary = summarize(config, tmp_path)
    paired = summary["dapo_minus_grpo"]
    assert paired["seeds"] == [0, 1, 2] and paired["steps"] == [16, 16, 8]
    assert paired["by_seed"] == pytest.approx([0.10, 0.02, -0.02])
    # mean 0.0333, sample sd 0.0611, t(0.975, 2) = 4.303: half-width 0.1518
    assert paired["mean"] == pytest.approx(0.1 / 3)
    assert paired["ci95"] == pytest.approx([0.1 / 3 - 0.1518, 0.1 / 3 + 0.1518], abs=2e-4)
    # DAPO's mean curve over the steps every seed reached (0 and 8): 0.10 -> 0.2833
    assert summary["dapo_gain_over_base"] == pytest.approx(0.85 / 3 - 0.10)
    # TRL's final 0.30 at 80 s; DAPO seeds reach it at 10 s (interpolated), 10 s (0.35 at step 8), never (0.20)
    speed = summary["dapo_to_trl_final"]
    assert speed["trl_train_s"] == 80.0 and speed["dapo_s"] == pytest.approx([10.0, 10 * 0.2 / 0.25, None])
    assert summary["targets"] == {"gain_at_least_0.20": False, "no_loss_against_grpo": False,
                                  "half_of_trl_wall_clock": False}  # fmt: skip
    assert not summary["complete"]


def test_smoke_preset_and_overrides():
    assert study_config(parse_args(["--smoke"])) == smoke(STUDY)
    config = study_config(parse_args(["--learning-rate", "3e-6", "--seeds", "4", "5"]))
    assert config.learning_rate == 3e-6 and config.seeds == (4, 5) and config.max_steps == STUDY.max_steps
    with pytest.raises(ValueError, match="micro_batch_rows=12"):
        RealModelConfig(micro_batch_rows=12)


def test_smoke_study_runs_end_to_end(tmp_path):
    output = tmp_path / "study"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's trl_dapo, in the runs' processes too
    command = [sys.executable, str(ROOT / "recipes/dapo_real_model.py"), "--smoke", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[grid] add1-dapo-T1" in result.stdout and "picked add1-dapo-T1" in result.stdout
    config = smoke(STUDY)
    study = json.loads((output / "study.json").read_text())
    assert set(study) == {"environment", "settings", "grid", "pick", "runs", "summary"}
    assert study["settings"]["max_steps"] == 1 and len(study["grid"]) == 1 and len(study["runs"]) == 3
    summary = study["summary"]
    assert summary["complete"] and set(summary["runs"]) == {DAPO, GRPO, TRL_GRPO}
    for kind in (DAPO, GRPO, TRL_GRPO):
        run = json.loads(run_file(output, kind, 0).read_text())
        assert [p["step"] for p in run["curve"]] == [0, 1] and run["steps"] == 1
        engine = "transformers generate" if kind == TRL_GRPO else "PagedRolloutEngine"
        assert run["rollout_engine"] == engine and run["trainer"] == (
            "GRPOTrainer" if kind == TRL_GRPO else "DAPOTrainer"
        )
        assert run["curve"][0]["wall_clock_s"] == 0.0 < run["curve"][1]["wall_clock_s"] <= run["train_s"]
        assert 0.0 <= run["curve"][1]["avg@2"]["all"] <= run["curve"][1]["pass@2"]["all"] <= 1.0
        rows = config.prompts_per_step * config.num_generations
        assert run["generated_completions"] >= rows and run["curve"][1]["mean_length"] <= config.max_completion_length
    assert (output / "study.png").stat().st_size > 10_000
    # a rerun keeps the grid cell and starts no run: every one finished under these settings
    cell = json.loads((output / "grid" / "add1-dapo-T1.json").read_text())
    assert cell["settings"] == config.grid_fingerprint() and cell["problems"] == config.grid_problems
    assert launch_runs(config, output, deadline=None) == []
