"""The real-model study (`recipes/dapo_real_model.py`): the task generator, scoring at several caps from one sampling,
the regime's candidates, the pilot's pick rule, the run order under a deadline, the arms' fields, the reward's
metrics over every generated completion, the report's paired measures and targets (a target whose reference was
never reached is not measured), `--report` on the shipped bundle and on an empty folder, and the whole `--smoke`
pipeline on a tiny model, so the GPU command cannot rot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ablation.store import write_json
from dapo_real_model import SHIPPED_RESULTS, kept_pick, main, model_source, parse_args, study_config
from real_model.arms import ENGINE_PART, EVALUATION_ROWS_BESIDE_VLLM, VLLM_PART, evaluation_plan, trainer_args
from real_model.config import (
    CELLS,
    DAPO,
    GRPO,
    NO_OVERLONG,
    PARTIAL,
    STUDY,
    SYMMETRIC_CLIP,
    TRL_CONTINUOUS,
    TRL_GRPO,
    TRL_VLLM,
    RealModelConfig,
    smoke,
)
from real_model.grid import candidates
from real_model.pilot import pick, pilot_jobs
from real_model.report import area, faster_trl, seeds_to_decide, summarize, time_target
from real_model.runs import CountingMathReward, run_file
from real_model.schedule import Launcher, arm_jobs, next_batch, run_jobs
from real_model.scoring import Samples, cap_scores
from trl_dapo.data.tasks import FAMILIES, PROMPT_STYLES, draw_problems, task_splits
from trl_dapo.gguf import shipped_smollm2

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
    with pytest.raises(ValueError, match="num_test=100 leaves none"):
        task_splits("add1", "dapo", 10, 100)


class _Pieces:
    """A tokenizer of whole pieces: id i decodes to PIECES[i]; id 0 is the end token (dropped as a special token)."""

    PIECES = ("<end>", "so ", "Answer: ", "5", "7", "\n")

    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(self.PIECES[i] for i in ids if i or not skip_special_tokens) for ids in sequences]


def test_cap_scores_score_each_cap_from_one_sampling():
    samples = Samples(
        completions=[
            [2, 3, 0],
            [1, 1, 2, 3, 0],
            [1, 2, 3, 0],
            [1, 1, 1, 1, 1],
        ],  # problem "5" twice, problem "7" twice
        logprobs=[[-1.0, -1.0, -1.0], [-2.0] * 5, [-0.5] * 4, [-1.0] * 5],
        answers=["5", "5", "7", "7"],
        k=2,
        end_tokens=frozenset({0}),
    )
    full = cap_scores(samples, _Pieces(), cap=5)
    # right: 1, 1, 0 (wrong answer), 0 (no line); per problem 1.0 and 0.0
    assert full["avg@2"] == {"all": 0.5} and full["pass@2"] == {"all": 0.5}
    assert full["answer_line"] == 0.75 and full["line_accuracy"] == pytest.approx(2 / 3)
    assert full["truncated"] == 0.25 and full["mean_length"] == 17 / 4
    assert full["entropy"] == pytest.approx((3 * 1.0 + 5 * 2.0 + 4 * 0.5 + 5 * 1.0) / 17)
    cut = cap_scores(samples, _Pieces(), cap=3)  # the second completion loses its answer, the third its end token
    assert cut["avg@2"] == {"all": 0.25} and cut["pass@2"] == {"all": 0.5} and cut["truncated"] == 0.75
    assert cut["line_accuracy"] == pytest.approx(1 / 3) and cut["mean_length"] == 12 / 4
    assert cut["entropy"] == pytest.approx((3 * 1.0 + 3 * 2.0 + 3 * 0.5 + 3 * 1.0) / 12)


def _row(mean: float, passed: float, truncated: float) -> dict:
    return {"avg@16": {"all": mean}, "pass@16": {"all": passed}, "answer_line": 0.2, "mean_length": 80.0,
            "truncated": truncated}  # fmt: skip


def _cell(family: str, style: str, by_cap: dict[int, tuple[float, float, float]]) -> dict:
    return {"family": family, "style": style, "temperature": 1.0,
            "caps": {str(cap): _row(*values) for cap, values in by_cap.items()}}  # fmt: skip


def test_candidates_take_the_smallest_cap_that_meets_the_rule_most_learnable_first():
    cells = [
        _cell("add2", "dapo", {96: (0.01, 0.08, 0.40), 128: (0.02, 0.20, 0.20), 192: (0.03, 0.30, 0.06)}),
        _cell("word2", "dapo", {96: (0.02, 0.30, 0.30), 128: (0.03, 0.40, 0.10), 192: (0.04, 0.45, 0.02)}),
        _cell("add12", "dapo", {96: (0.08, 0.60, 0.30), 128: (0.09, 0.70, 0.20), 192: (0.10, 0.70, 0.10)}),
    ]
    regime = candidates(STUDY, cells)
    assert regime["in_band"]  # add2 at 96: pass too low; add12: avg too high everywhere
    assert [(r["family"], r["cap"]) for r in regime["rows"]] == [("word2", 96), ("add2", 128)]
    nearest = candidates(STUDY, [cells[2]])
    assert not nearest["in_band"] and [(r["family"], r["cap"]) for r in nearest["rows"]] == [("add12", 96)]


def _curve(values: list[float], every: int = 4, line: list[float] | None = None, seconds: float = 10.0) -> list:
    line = line or [0.1] * len(values)
    return [{"step": every * i, "wall_clock_s": seconds * i, "avg@16": {"all": v}, "line_accuracy": la,
             "entropy": 1.0, "truncated": 0.1} for i, (v, la) in enumerate(zip(values, line, strict=True))]  # fmt: skip


def test_pilot_picks_the_earliest_learner_and_doubles_its_step_within_bounds(tmp_path):
    regime = candidates(STUDY, [_cell("word2", "dapo", {96: (0.02, 0.30, 0.30)}),
                                _cell("add2", "dapo", {128: (0.02, 0.20, 0.20)})])  # fmt: skip
    config = STUDY.with_overrides(pilot_learning_rates=(1e-5, 3e-5))
    jobs = pilot_jobs(config, tmp_path, regime)
    assert [(j["task"]["cell"], j["learning_rate"]) for j in jobs] == [
        ("word2-dapo-T1-c96", 1e-5), ("word2-dapo-T1-c96", 3e-5), ("add2-dapo-T1-c128", 1e-5),
        ("add2-dapo-T1-c128", 3e-5)]  # fmt: skip
    curves = [
        _curve(
            [0.02, 0.05, 0.08, 0.12, 0.2], line=[0.1, 0.1, 0.2, 0.3, 0.4]
        ),  # past 0.1 at step 10, line accuracy up 0.3
        _curve([0.02, 0.06, 0.14, 0.2, 0.3], line=[0.1, 0.1, 0.1, 0.1, 0.12]),  # earliest (step 6), line gain 0.02
        _curve([0.02, 0.04, 0.12, 0.3, 0.4], line=[0.1, 0.2, 0.3, 0.3, 0.3]),  # past 0.1 at step 7
        _curve([0.02, 0.03, 0.04, 0.05, 0.06]),  # never
    ]
    for job, curve in zip(jobs, curves, strict=True):
        write_json(Path(job["record"]), {"status": "ok", "curve": curve})
    chosen = pick(config, tmp_path, regime, jobs)
    # the second run passed 0.1 first but its line accuracy rose by 0.02 only: it learned the answer line
    assert chosen["cell"] == "add2-dapo-T1-c128" and chosen["learning_rate"] == 1e-5 and chosen["learned"]
    assert chosen["max_steps"] == 16 and chosen["early_step"] == 8  # 2 x 7 = 14, at least min_steps 16
    assert [r["learned"] for r in chosen["pilot"]] == [True, False, True, False]
    # the second cell by the same rule among the other cell's runs: word2 at 1e-5, past 0.1 at step 10 -> 20 steps
    second = chosen["second"]
    assert (second["cell"], second["learning_rate"], second["learned"]) == ("word2-dapo-T1-c96", 1e-5, True)
    assert second["max_steps"] == 20 and second["early_step"] == 8 and "pilot" not in second
    for job, curve in zip(jobs, curves, strict=True):  # none learned: the highest avg, the longest run
        write_json(Path(job["record"]), {"status": "ok", "curve": curve[:2]})
    fallback = pick(config, tmp_path, regime, jobs)
    assert not fallback["learned"] and fallback["cell"] == "word2-dapo-T1-c96" and fallback["max_steps"] == 32
    assert fallback["second"]["cell"] == "add2-dapo-T1-c128" and fallback["second"]["learning_rate"] == 1e-5
    one_cell = pick(config, tmp_path, regime, jobs[:2])  # a pilot of one cell picks no second cell
    assert one_cell["cell"] == "word2-dapo-T1-c96" and one_cell["second"] is None


def test_area_and_seeds_to_decide():
    curve = _curve([0.0, 0.4, 0.8], every=4)  # trapezoids: 4 x 0.2 + 4 x 0.6 = 3.2 over 8 steps
    assert area(curve, "step", lambda p: p["avg@16"]["all"], 8) == pytest.approx(0.4)
    # cut at 6 by interpolation: 4 x 0.2 + 2 x (0.4 + 0.6) / 2 = 1.8 over 6
    assert area(curve, "step", lambda p: p["avg@16"]["all"], 6) == pytest.approx(0.3)
    assert area(curve, "step", lambda p: p["avg@16"]["all"], 9) is None  # past the last evaluation
    # mean 0.2, sd 0.1414: t(0.975, n-1) x sd / sqrt(n) is 0.225 at 4 seeds and 0.176 at 5
    assert seeds_to_decide([0.1, 0.3], 0.0) == 5 and seeds_to_decide([0.1, 0.3], -0.03) == 4
    assert seeds_to_decide([-0.1, 0.05], 0.0) is None and seeds_to_decide([0.1], 0.0) is None


def _run(output: Path, kind: str, seed: int, values: list[float], seconds: float = 10.0, **extra) -> None:
    curve = _curve(values, seconds=seconds)
    write_json(run_file(output, kind, seed), {"kind": kind, "seed": seed, "status": "ok", "curve": curve,
               "steps": curve[-1]["step"], "train_s": curve[-1]["wall_clock_s"], "train": {}, **extra})  # fmt: skip


def _sharing(output: Path, runs: dict[str, float]) -> None:
    """A schedule.json under which each named run shared the device with the given mean number of runs: each run
    alone in a window of its own, with `n - 1` filler processes covering it whole."""
    schedule = {}
    for window, (name, mean) in enumerate(runs.items()):
        start = 200.0 * window
        schedule[name] = {"start": start, "end": start + 100, "processes_in_batch": 1, "filler": False}
        for other in range(round(mean) - 1):
            schedule[f"{name}-beside{other}"] = {"start": start - 1 - other, "end": start + 101 + other,
                                                 "processes_in_batch": 1, "filler": True}  # fmt: skip
    write_json(output / "schedule.json", schedule)


def test_report_pairs_areas_by_seed_and_reads_targets(tmp_path):
    config = STUDY.with_overrides(seeds=(0, 1, 2), second_cell_seeds=(), vllm_seeds=(0,), partial_seeds=(0, 1),
                                  ablation_seeds=(), continuous_batching_seeds=())  # fmt: skip
    write_json(tmp_path / "pick.json", {"early_step": 4, "cell": "add2-dapo-T1-c96", "second": None})
    for seed, (dapo, grpo) in enumerate([([0.0, 0.4, 0.8], [0.0, 0.2, 0.6]), ([0.0, 0.3, 0.5], [0.0, 0.3, 0.5]),
                                         ([0.0, 0.5, 0.6], [0.0, 0.2, 0.4])]):  # fmt: skip
        _run(tmp_path, DAPO, seed, dapo, seconds=20.0)
        _run(tmp_path, GRPO, seed, grpo)
        _run(tmp_path, TRL_GRPO, seed, [0.0, 0.3, 0.92], seconds=50.0)
    _run(tmp_path, PARTIAL, 0, [0.0, 0.4, 0.8], seconds=15.0)
    _run(tmp_path, PARTIAL, 1, [0.0, 0.2, 0.5], seconds=15.0)
    # seed 2's TRL run shared the device with 3 runs, its DAPO run with 9: their wall-clocks do not compare
    _sharing(tmp_path, {"dapo-seed0": 9, "trl_grpo-seed0": 9, "dapo-seed1": 9, "trl_grpo-seed1": 9,
                        "dapo-seed2": 9, "trl_grpo-seed2": 3})  # fmt: skip
    summary = summarize(config, tmp_path)
    cell = summary["cells"]["first"]
    assert set(summary["cells"]) == {"first"} and cell["trl_path"] == TRL_GRPO
    main_pair = cell["comparisons"]["dapo_minus_grpo"]
    # AUC over 8 steps by the trapezoid rule: seed 0 DAPO (4 x 0.2 + 4 x 0.6) / 8 = 0.4, GRPO (0.4 + 1.6) / 8 = 0.25
    assert main_pair["auc_steps"]["by_seed"] == pytest.approx({0: 0.15, 1: 0.0, 2: 0.2})
    assert main_pair["early"]["by_seed"] == pytest.approx({0: 0.2, 1: 0.0, 2: 0.3})
    # over wall-clock, up to the shorter run (GRPO's 20 s, DAPO's step 4): seed 0 DAPO 0.2, GRPO (1 + 4) / 20
    assert main_pair["auc_wall_clock"]["by_seed"] == pytest.approx({0: -0.05, 1: -0.125, 2: 0.05})
    assert main_pair["train_s"]["by_seed"] == {0: 20.0, 1: 20.0, 2: 20.0}
    # against TRL over DAPO's 40 s: seed 0 DAPO (20 x 0.2 + 20 x 0.6) / 40 = 0.4, TRL (at 40 s: 0.3 x 40 / 50) 0.12
    against_trl = cell["comparisons"]["dapo_minus_trl"]
    assert against_trl["auc_wall_clock"]["by_seed"] == pytest.approx({0: 0.28, 1: 0.155})
    assert against_trl["auc_wall_clock"]["left_out_for_sharing"] == 1 and against_trl["auc_steps"]["n"] == 3
    assert cell["comparisons"]["grpo_minus_trl"]["seeds"] == [0, 1, 2]
    assert cell["comparisons"]["partial_minus_dapo"]["auc_steps"]["by_seed"] == pytest.approx({0: 0.0, 1: -0.05})
    assert cell["targets"]["dapo_wall_clock_auc_above_trl"] is None  # 2 pairs: not measured, whatever the mean
    assert cell["targets"]["partial_faster"] is True and cell["partial_rollouts"]["faster"]
    # held-out 0.5: DAPO seed 0 at 20 + 20 x 0.1 / 0.4 = 25 s (step 5), seed 1 at 40 s, seed 2 at 20 s
    half, high = ({kind: arm for kind, arm in entry["arms"].items()} for entry in cell["levels"])
    assert [row["wall_clock_s"] for row in half[DAPO]["by_seed"].values()] == pytest.approx([25.0, 40.0, 20.0])
    assert half[DAPO]["median_wall_clock_s"] == pytest.approx(25.0) and half[DAPO]["median_step"] == pytest.approx(5)
    # 0.9: every TRL run at 50 + 50 x 0.6 / 0.62 s, no DAPO run: DAPO is not faster to it
    assert high[DAPO]["share"] == 0.0 and high[TRL_GRPO]["share"] == 1.0
    assert high[TRL_GRPO]["median_wall_clock_s"] == pytest.approx(50 + 50 * 0.6 / 0.62)
    assert cell["targets"]["dapo_half_trl_time_to_0.9"] is False
    assert summary["left"] == ["trl_grpo_vllm-seed0"] and not summary["complete"]


def test_no_target_is_met_on_a_reference_never_reached(tmp_path):
    """Every accuracy 0: a time to 0 is 0 for every run, which compares nothing (it once read as `True`)."""
    config = STUDY.with_overrides(seeds=(0, 1), second_cell_seeds=(), vllm_seeds=(), partial_seeds=(),
                                  ablation_seeds=(), continuous_batching_seeds=())  # fmt: skip
    for kind in (DAPO, GRPO, TRL_GRPO):
        for seed in (0, 1):
            _run(tmp_path, kind, seed, [0.0, 0.0, 0.0], seconds=40.0 if kind == TRL_GRPO else 10.0)
    cell = summarize(config, tmp_path)["cells"]["first"]
    assert True not in cell["targets"].values() and cell["targets"]["dapo_half_trl_time_to_0.9"] is None
    assert all(arm["median_wall_clock_s"] is None for entry in cell["levels"] for arm in entry["arms"].values())


def test_faster_trl_path_and_time_target():
    def runs(seconds_per_step: float) -> dict[int, dict]:
        return {seed: {"train_s": seconds_per_step * 16, "steps": 16} for seed in range(3)}

    assert faster_trl({TRL_GRPO: runs(3.0), TRL_VLLM: runs(2.0)}) == TRL_VLLM
    assert faster_trl({TRL_GRPO: runs(3.0)}) == TRL_GRPO and faster_trl({DAPO: runs(1.0)}) is None

    def levels(dapo: tuple, trl: tuple) -> list[dict]:
        arm = lambda median, share: {"median_wall_clock_s": median, "share": share}  # noqa: E731
        return [{"level": 0.9, "arms": {DAPO: arm(*dapo), TRL_GRPO: arm(*trl)}}]

    assert time_target(levels((50.0, 0.5), (100.0, 0.5)), TRL_GRPO) is True
    assert time_target(levels((50.1, 0.5), (100.0, 0.5)), TRL_GRPO) is False  # more than half TRL's time
    assert time_target(levels((40.0, 0.4), (100.0, 0.5)), TRL_GRPO) is False  # fewer seeds reach it
    assert time_target(levels((40.0, 0.4), (None, 0.0)), TRL_GRPO) is True  # TRL never reaches it
    assert time_target(levels((None, 0.0), (None, 0.0)), TRL_GRPO) is None


def test_runs_start_in_order_with_the_slots_kept_full(tmp_path):
    config = STUDY.with_overrides(seeds=(0, 1), second_cell_seeds=(0,), vllm_seeds=(0,), partial_seeds=(0,),
                                  ablation_seeds=(), continuous_batching_seeds=(), slots=3, device="cpu")  # fmt: skip
    second = {"family": "word2", "style": "dapo", "temperature": 1.0, "cap": 96, "cell": "word2-dapo-T1-c96",
              "learning_rate": 3e-5, "max_steps": 20}  # fmt: skip
    chosen = {"family": "add2", "style": "dapo", "temperature": 1.0, "cap": 128, "cell": "add2-dapo-T1-c128",
              "learning_rate": 1e-5, "max_steps": 16, "second": second}  # fmt: skip
    jobs = arm_jobs(config, tmp_path, chosen)
    assert [j["name"] for j in jobs] == [
        "dapo-seed0", "grpo_settings-seed0", "trl_grpo-seed0", "dapo-seed1", "grpo_settings-seed1", "trl_grpo-seed1",
        "second-dapo-seed0", "second-grpo_settings-seed0", "second-trl_grpo-seed0", "trl_grpo_vllm-seed0",
        "dapo_partial_kept-seed0"]  # fmt: skip
    assert {(j["task"]["cell"], j["learning_rate"], j["max_steps"]) for j in jobs if j["cell"] == "second"} == {
        ("word2-dapo-T1-c96", 3e-5, 20)
    }
    assert [j["name"] for j in arm_jobs(config, tmp_path, {**chosen, "second": None})][-1] == "dapo_partial_kept-seed0"
    write_json(run_file(tmp_path, DAPO, 0), {"status": "ok", "total_s": 100.0})  # 140 s with start-up
    launcher = Launcher(config, tmp_path, deadline=time.time() + 130)
    # DAPO runs now take 140 s, more than is left; GRPO's prior: 40 + 16 x 4.4 x 0.5 + 5 x 5 x 0.5 = 87.7 s
    assert next_batch(config, launcher, jobs, jobs) == ([jobs[1]], False)
    dapo_only = [jobs[0], jobs[3]]
    assert next_batch(config, launcher, dapo_only, jobs) == ([], False)  # nothing fits, nothing expected running
    launcher.running = {"expected": ([jobs[1]], 0.0, False)}
    assert next_batch(config, launcher, dapo_only, jobs) == ([jobs[0]], True)  # a filler keeps the slots full
    launcher.running = {"a": ([jobs[1]], 0.0, False), "b": ([jobs[2]], 0.0, False), "c": ([jobs[4]], 0.0, False)}
    assert next_batch(config, launcher, dapo_only, jobs) == ([], False)  # the slots are full
    launcher.deadline = None
    vllm = next(j for j in jobs if j["kind"] == TRL_VLLM)
    write_json(Path(vllm["record"]), {"status": "building"})  # as `Launcher.start` marks it
    launcher.running = {"vllm": ([vllm], 0.0, False)}
    assert next_batch(config, launcher, jobs[1:3], jobs) == ([], False)  # nothing starts while vLLM starts
    write_json(Path(vllm["record"]), {"status": "running", "curve": []})
    assert next_batch(config, launcher, jobs[1:3], jobs) == ([jobs[1]], False)


def test_fillers_are_stopped_with_what_they_started_and_recorded(tmp_path):
    config = STUDY.with_overrides(device="cpu")
    launcher = Launcher(config, tmp_path, deadline=None)
    job = {"name": "dapo-seed7", "kind": DAPO, "seed": 7, "record": str(tmp_path / "runs" / "dapo-seed7.json")}
    # a process that starts a child of its own, as a run starts its reward worker
    process = subprocess.Popen(["sh", "-c", "sleep 60 & echo $! > child; wait"], cwd=tmp_path, start_new_session=True)
    launcher.running[process] = ([job], time.time(), True)
    for _ in range(100):
        if (tmp_path / "child").is_file() and (tmp_path / "child").read_text().strip():
            break
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    assert not launcher.expected_running()
    launcher.stop_fillers()
    assert launcher.reap() == [] and not launcher.running  # a filler's exit code is no failure of the study
    entry = json.loads((tmp_path / "schedule.json").read_text())["dapo-seed7"]
    assert entry["filler"] is True and entry["end"] >= entry["start"]
    time.sleep(0.2)
    stat = Path(f"/proc/{child}/stat")  # gone, or a zombie no one has reaped yet: no longer running either way
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_the_vllm_arm_evaluates_in_a_bounded_pool_beside_vllm():
    job = {"kind": TRL_VLLM, "task": {"cap": 96}}
    plan = evaluation_plan(STUDY, job, share=0.1)
    assert plan["max_rows"] == EVALUATION_ROWS_BESIDE_VLLM and plan["max_cache_tokens"] == 128 * (160 + 96)
    assert plan["memory_fraction"] == pytest.approx(ENGINE_PART * 0.1)
    assert evaluation_plan(STUDY, {**job, "kind": DAPO}, share=0.1) == {
        "memory_fraction": pytest.approx(ENGINE_PART * 0.1), "max_rows": STUDY.engine_max_rows,
        "max_cache_tokens": None}  # fmt: skip
    vllm_config = trainer_args(smoke(STUDY), {**job, "seed": 0, "learning_rate": 1e-4, "max_steps": 2,
                                              "task": {"family": "add1", "style": "dapo", "temperature": 1.0,
                                                       "cap": 8}}, "unused", 0.1)[1]  # fmt: skip
    assert vllm_config.vllm_gpu_memory_utilization == pytest.approx(VLLM_PART * 0.1)


def test_the_arms_differ_in_their_pieces_only():
    config = smoke(STUDY)
    job = {"seed": 0, "learning_rate": 1e-4, "max_steps": 2,
           "task": {"family": "add1", "style": "dapo", "temperature": 1.0, "cap": 8}}  # fmt: skip
    built = {kind: trainer_args(config, {**job, "kind": kind}, "unused", 0.5)
             for kind in (DAPO, GRPO, PARTIAL, SYMMETRIC_CLIP, NO_OVERLONG, TRL_CONTINUOUS)}  # fmt: skip
    dapo = built[DAPO][1]
    assert (dapo.epsilon_high, dapo.dynamic_sampling, dapo.overlong_buffer_len) == (0.28, True, 2)
    grpo = built[GRPO][1]
    assert (grpo.epsilon_high, grpo.dynamic_sampling, grpo.overlong_buffer_len) == (0.2, False, 0)
    partial = built[PARTIAL][1]
    assert partial.partial_rollouts and partial.partial_rollout_keep_cache == pytest.approx(0.025)
    assert built[SYMMETRIC_CLIP][1].epsilon_high == 0.2 and built[NO_OVERLONG][1].overlong_buffer_len == 0
    for other in (GRPO, PARTIAL, SYMMETRIC_CLIP, NO_OVERLONG):
        assert built[other][1].learning_rate == dapo.learning_rate and built[other][1].max_completion_length == 8
    trainer_class, continuous = built[TRL_CONTINUOUS]
    assert trainer_class.__name__ == "GRPOTrainer" and continuous.use_transformers_continuous_batching
    # one generation batch (one step of 4 rows) of up to 160 + 8 tokens: one 256-token page a row
    assert continuous.transformers_continuous_batching_config["num_blocks"] == 4


def test_the_reward_logs_truncation_and_informative_groups_over_every_completion():
    logged = {}
    reward = CountingMathReward(group_size=2, end_tokens=frozenset({0}))
    scores = reward(["Answer: 5", "Answer: 4", "Answer: 1", "so"], answer=["5", "5", "2", "2"],
                    completion_ids=[[7, 0], [7, 7, 0], [7, 0], [7, 7, 7]],
                    log_metric=lambda name, value: logged.__setitem__(name, value))  # fmt: skip
    assert scores == [1.0, -1.0, -1.0, -1.0] and reward.completions == 4 and reward.tokens == 10
    assert logged["study/truncated"] == 0.25 and logged["study/mean_length"] == 2.5
    assert logged["study/informative_groups"] == 0.5


def test_smoke_preset_overrides_and_the_shipped_model_name():
    assert study_config(parse_args(["--smoke"])) == smoke(STUDY)
    config = study_config(parse_args(["--seeds", "4", "5", "--slots", "6"]))
    assert config.seeds == (4, 5) and config.slots == 6 and config.max_steps == STUDY.max_steps
    with pytest.raises(ValueError, match="micro_batch_rows=12"):
        RealModelConfig(micro_batch_rows=12)
    assert model_source("smollm2") == shipped_smollm2()
    with pytest.raises(SystemExit, match="no such file or folder"):
        main(["--device", "cpu", "--model", "SmolLM2-135M-Instruct.Q4_1.gguf", "--output", "/nonexistent/x"])


def test_report_reads_the_shipped_bundle_and_says_when_a_folder_has_no_study(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=f"no study in {tmp_path}.*--report --output {SHIPPED_RESULTS}"):
        main(["--report", "--output", str(tmp_path)])
    assert main(["--report", "--output", str(ROOT / SHIPPED_RESULTS)]) == 0  # incomplete, which is no failure
    printed = capsys.readouterr().out
    assert (  # the first study ran one TRL seed beside its three of DAPO and GRPO's settings
        "incomplete: 2 runs have no result yet (trl_grpo-seed1, trl_grpo-seed2); a study call with the same --output "
        "runs them." in printed.splitlines()
    )
    assert "## first cell: add1-dapo-T1, cap 256, learning rate 1e-05, 48 steps, early step 24" in printed
    # the first study's paired final difference, as docs/real-model.md quotes it
    assert (
        "| dapo_minus_grpo | at the last step | 0: -0.030, 1: -0.020, 2: +0.032 | -0.006 | -0.089 to +0.077 |"
        in printed
    )
    assert (tmp_path / "outputs" / f"report-{Path(SHIPPED_RESULTS).stem}" / "study.png").stat().st_size > 10_000


def test_smoke_study_runs_end_to_end(tmp_path):
    output = tmp_path / "study"
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's trl_dapo, in the runs' processes too
    command = [sys.executable, str(ROOT / "recipes/dapo_real_model.py"), "--smoke", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[grid] add1-dapo-T1-c6" in result.stdout and "[grid] add1-oneshot-T1-c6" in result.stdout
    first, second = (re.search(rf"picked \({cell} cell\) (add1-\w+-T1-c6)", result.stdout) for cell in CELLS)
    assert first and second and first.group(1) != second.group(1)
    config = smoke(STUDY)
    study = json.loads((output / "study.json").read_text())
    assert set(study) == {"environment", "settings", "grid", "pick", "runs", "schedule", "summary"}
    assert study["pick"]["max_steps"] == 2 and len(study["pick"]["pilot"]) == 2 and len(study["runs"]) == 12
    assert study["pick"]["second"]["cell"] == second.group(1) and "second-trl_grpo-seed0" in study["runs"]
    summary = study["summary"]
    assert set(summary["cells"]) == set(CELLS) and summary["cells"]["second"]["task"] == second.group(1)
    assert summary["complete"] and summary["skipped"] == ["trl_grpo_vllm-seed0"]
    assert "vLLM" in study["runs"]["trl_grpo_vllm-seed0"]["reason"]
    for name, run in study["runs"].items():
        if run["status"] == "skipped":
            continue
        assert [p["step"] for p in run["curve"]] == [0, 1, 2] and run["steps"] == 2, name
        assert run["curve"][0]["wall_clock_s"] == 0.0 < run["curve"][2]["wall_clock_s"] <= run["train_s"]
        assert {"entropy", "truncated", "answer_line", "line_accuracy", "mean_length"} <= set(run["curve"][2])
        assert len(run["train"]["study/truncated"]) == 2, name  # every generated completion, every step
        assert run["trained_dtypes"] == ["float32"], name  # no generation path cast the weights (bf16 is off here)
    engines = {name: run.get("rollout_engine") for name, run in study["runs"].items()}
    assert engines["trl_grpo-seed0"] == "transformers generate" and engines["dapo-seed0"] == "PagedRolloutEngine"
    assert engines["trl_grpo_continuous_batching-seed0"] == "transformers continuous batching"
    trained = study["runs"]["grpo_settings-seed0"]["train"]  # DAPO's steps are skipped: no informative group
    assert all(len(trained[name]) == 2 for name in ("entropy", "clip_ratio/low_mean", "logprob_gap_mean"))
    assert len(study["runs"]["dapo-seed0"]["train"]["dapo/generated_groups"]) == 2
    for figure in ("study.png", "mechanisms.png", "study-second.png", "mechanisms-second.png"):
        assert (output / figure).stat().st_size > 10_000
    # a rerun keeps every grid cell and finished run under these settings
    cell = json.loads((output / "grid" / "add1-dapo-T1.json").read_text())
    assert cell["settings"] == config.grid_fingerprint() and set(cell["caps"]) == {"6", "8"}
    assert run_jobs(config, output, arm_jobs(config, output, study["pick"]), deadline=None) == ([], [])
    assert kept_pick(config, output) == study["pick"]  # fixed once made: a rerun neither pilots nor picks again
