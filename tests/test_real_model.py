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
from types import SimpleNamespace

import pytest

from ablation.store import write_json
from dapo_real_model import SHIPPED_RESULTS, kept_pick, main, model_source, parse_args, study_config
from real_model.arms import trainer_args
from real_model.config import (
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
from real_model.report import area, seeds_to_decide, summarize
from real_model.runs import CountingMathReward, run_file
from real_model.schedule import arm_jobs, next_batch, run_jobs
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
    for job, curve in zip(jobs, curves, strict=True):  # none learned: the highest avg, the longest run
        write_json(Path(job["record"]), {"status": "ok", "curve": curve[:2]})
    fallback = pick(config, tmp_path, regime, jobs)
    assert not fallback["learned"] and fallback["cell"] == "word2-dapo-T1-c96" and fallback["max_steps"] == 32


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


def test_report_pairs_areas_by_seed_and_reads_targets(tmp_path):
    config = STUDY.with_overrides(seeds=(0, 1, 2), partial_seeds=(0, 1), ablation_seeds=(), trl_seeds=(0,))
    write_json(tmp_path / "pick.json", {"early_step": 4})
    for seed, (dapo, grpo) in enumerate([([0.0, 0.4, 0.8], [0.0, 0.2, 0.6]), ([0.0, 0.3, 0.5], [0.0, 0.3, 0.5]),
                                         ([0.0, 0.5, 0.6], [0.0, 0.2, 0.4])]):  # fmt: skip
        _run(tmp_path, DAPO, seed, dapo, seconds=20.0)
        _run(tmp_path, GRPO, seed, grpo)
    _run(tmp_path, PARTIAL, 0, [0.0, 0.4, 0.8], seconds=15.0)
    _run(tmp_path, PARTIAL, 1, [0.0, 0.2, 0.5], seconds=15.0)
    _run(tmp_path, TRL_GRPO, 0, [0.0, 0.3, 0.92], seconds=50.0)
    summary = summarize(config, tmp_path)
    main_pair = summary["comparisons"]["dapo_minus_grpo"]
    # AUC over 8 steps by the trapezoid rule: seed 0 DAPO (4 x 0.2 + 4 x 0.6) / 8 = 0.4, GRPO (0.4 + 1.6) / 8 = 0.25
    assert main_pair["auc_steps"]["by_seed"] == pytest.approx({0: 0.15, 1: 0.0, 2: 0.2})
    assert main_pair["early"]["by_seed"] == pytest.approx({0: 0.2, 1: 0.0, 2: 0.3})
    # over wall-clock, up to the shorter run (GRPO's 20 s, DAPO's step 4): seed 0 DAPO 0.2, GRPO (1 + 4) / 20
    assert main_pair["auc_wall_clock"]["by_seed"] == pytest.approx({0: -0.05, 1: -0.125, 2: 0.05})
    assert main_pair["train_s"]["by_seed"] == {0: 20.0, 1: 20.0, 2: 20.0}
    assert summary["comparisons"]["partial_minus_dapo"]["auc_steps"]["by_seed"] == pytest.approx({0: 0.0, 1: -0.05})
    assert summary["targets"]["dapo_auc_above_grpo_6_seeds"] is None  # 3 seeds: not measured, whatever the mean
    assert summary["targets"]["partial_faster"] is True and summary["partial_rollouts"]["faster"]
    # the TRL run reached 0.9 at 50 + 50 x 0.6 / 0.62 s; no DAPO run did: DAPO's time to it is not measured; the
    # highest level every compared run reached is 0.5 (DAPO's seed 1)
    levels = summary["wall_clock"]
    assert [entry["level"] for entry in levels] == [0.9, 0.5]
    assert levels[0]["trl"]["trl_grpo-seed0"]["wall_clock_s"] == pytest.approx(50 + 50 * 0.6 / 0.62)
    assert levels[0]["trl"]["trl_grpo-seed0"]["dapo_over_this"] is None
    assert summary["targets"]["dapo_faster_than_trl_to_level"] is None
    assert "dapo_partial_kept-seed2" not in summary["left"] and "trl_grpo_vllm-seed0" in summary["left"]


def test_no_target_is_met_on_a_reference_never_reached(tmp_path):
    """Every accuracy 0: a time to 0 is 0 for every run, which compares nothing (it once read as `True`)."""
    config = STUDY.with_overrides(seeds=(0, 1), partial_seeds=(), ablation_seeds=(), trl_seeds=(0,))
    for kind in (DAPO, GRPO):
        for seed in (0, 1):
            _run(tmp_path, kind, seed, [0.0, 0.0, 0.0])
    _run(tmp_path, TRL_GRPO, 0, [0.0, 0.0, 0.0], seconds=40.0)
    summary = summarize(config, tmp_path)
    assert True not in summary["targets"].values()
    assert [entry["level"] for entry in summary["wall_clock"]] == [0.9]
    assert summary["wall_clock"][0]["trl"]["trl_grpo-seed0"]["wall_clock_s"] is None


def test_runs_start_in_order_within_the_slots_and_the_deadline(tmp_path):
    config = STUDY.with_overrides(seeds=(0, 1), partial_seeds=(0,), ablation_seeds=(), slots=3)
    chosen = {"family": "add2", "style": "dapo", "temperature": 1.0, "cap": 128, "cell": "add2-dapo-T1-c128",
              "learning_rate": 1e-5, "max_steps": 16}  # fmt: skip
    jobs = arm_jobs(config, tmp_path, chosen)
    assert [j["name"] for j in jobs] == ["dapo-seed0", "grpo_settings-seed0", "dapo-seed1", "grpo_settings-seed1",
        "dapo_partial_kept-seed0", "trl_grpo-seed0", "trl_grpo_vllm-seed0", "trl_grpo_continuous_batching-seed0"]  # fmt: skip
    write_json(run_file(tmp_path, DAPO, 0), {"status": "ok", "total_s": 100.0})  # 140 s with start-up
    launcher = SimpleNamespace(running={}, deadline=time.time() + 130)
    # DAPO runs now take 140 s, more than is left; GRPO's prior: 40 + 16 x 4.4 x 0.5 + 5 x 5 x 0.5 = 87.7 s
    assert [j["name"] for j in next_batch(config, launcher, jobs, jobs)] == ["grpo_settings-seed0"]
    launcher.deadline = None
    vllm = [j for j in jobs if j["kind"] == TRL_VLLM]
    launcher.running = {"process": ([jobs[0]], 0.0)}
    assert next_batch(config, launcher, vllm, jobs) == []  # the vLLM arm runs alone
    launcher.running = {}
    assert next_batch(config, launcher, vllm, jobs) == vllm
    launcher.running = {"process": (vllm, 0.0)}
    assert next_batch(config, launcher, jobs[1:3], jobs) == []  # nothing beside it


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
    assert (  # the first study ran no arm of TRL's vLLM or continuous batching
        "incomplete: 2 runs have no result yet (trl_grpo_vllm-seed0, trl_grpo_continuous_batching-seed0); a study "
        "call with the same --output runs them." in printed.splitlines()
    )
    assert "task: add1-dapo-T1, cap 256, learning rate 1e-05, 48 steps, early step 24" in printed
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
    assert "[grid] add1-dapo-T1-c6" in result.stdout and "picked add1-dapo-T1-c6" in result.stdout
    config = smoke(STUDY)
    study = json.loads((output / "study.json").read_text())
    assert set(study) == {"environment", "settings", "grid", "pick", "runs", "schedule", "summary"}
    assert study["pick"]["max_steps"] == 2 and len(study["pick"]["pilot"]) == 1 and len(study["runs"]) == 9
    summary = study["summary"]
    assert summary["complete"] and summary["skipped"] == ["trl_grpo_vllm-seed0"]
    assert "vLLM" in study["runs"]["trl_grpo_vllm-seed0"]["reason"]
    for name, run in study["runs"].items():
        if run["status"] == "skipped":
            continue
        assert [p["step"] for p in run["curve"]] == [0, 1, 2] and run["steps"] == 2, name
        assert run["curve"][0]["wall_clock_s"] == 0.0 < run["curve"][2]["wall_clock_s"] <= run["train_s"]
        assert {"entropy", "truncated", "answer_line", "line_accuracy", "mean_length"} <= set(run["curve"][2])
        assert len(run["train"]["study/truncated"]) == 2, name  # every generated completion, every step
    engines = {name: run.get("rollout_engine") for name, run in study["runs"].items()}
    assert engines["trl_grpo-seed0"] == "transformers generate" and engines["dapo-seed0"] == "PagedRolloutEngine"
    assert engines["trl_grpo_continuous_batching-seed0"] == "transformers continuous batching"
    trained = study["runs"]["grpo_settings-seed0"]["train"]  # DAPO's steps are skipped: no informative group
    assert all(len(trained[name]) == 2 for name in ("entropy", "clip_ratio/low_mean", "logprob_gap_mean"))
    assert len(study["runs"]["dapo-seed0"]["train"]["dapo/generated_groups"]) == 2
    for figure in ("study.png", "mechanisms.png"):
        assert (output / figure).stat().st_size > 10_000
    # a rerun keeps every grid cell and finished run under these settings
    cell = json.loads((output / "grid" / "add1-dapo-T1.json").read_text())
    assert cell["settings"] == config.grid_fingerprint() and set(cell["caps"]) == {"6", "8"}
    assert run_jobs(config, output, arm_jobs(config, output, study["pick"]), deadline=None) == ([], [])
    assert kept_pick(config, output) == study["pick"]  # fixed once made: a rerun neither pilots nor picks again
