"""The ablation study: the addition task, its rechecks and its verifier on hand-derived cases, difficulty buckets,
the regimes, the variant ladder's configs, the mechanism metrics on hand-built rollouts, the intervals, the memory
plan, the retry of failed runs, the summary's interpolation, and the whole `--smoke` pipeline (study and regime check)
end to end on the CPU."""

import itertools
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ablation import study
from ablation.check import measure
from ablation.config import MINIATURE, PAPER, StudyConfig, smoke
from ablation.model import build_char_tokenizer, build_model, warm_start
from ablation.plan import GIB, MemoryPlanError, memory_plan, parameter_count
from ablation.report import crossing, format_targets, spread, summarize, t_quantile, window_means
from ablation.study import deal
from ablation.task import (
    AdditionProblem,
    addition_splits,
    bucket_of,
    check_buckets,
    draw_rechecks,
    excess_columns,
    verify,
)
from ablation.variants import VARIANTS, AdditionReward, run_order, trainer_setup
from dapo_ablation import parse_args, study_config
from trl_dapo import DAPOConfig
from trl_dapo.evaluation import _by_group, _first_eos_mask
from trl_dapo.rewards import OverlongPenalty

ROOT = Path(__file__).parent.parent

SMOKE = smoke(PAPER)

BUCKETS = ((1, 2), (3, 4), (5, 6), (7, 8))


def test_scratchpad_adds_columns_with_carries():
    assert AdditionProblem(347, 85).solution == "7+5+0=12\n4+8+1=13\n3+0+1=4\nAnswer: 432"
    # a carry through every column and out of the last one
    assert AdditionProblem(1, 999).solution == "1+9+0=10\n0+9+1=10\n0+9+1=10\nAnswer: 1000"
    assert AdditionProblem(0, 0).solution == "0+0+0=0\nAnswer: 0"
    assert (AdditionProblem(85, 347).digits, AdditionProblem(85, 347).prompt) == (3, "85+347\n")


def test_rechecks_repeat_the_column_block_and_are_counted():
    problem = AdditionProblem(347, 85)
    block = "7+5+0=12\n4+8+1=13\n3+0+1=4\n"
    assert problem.worked(2) == block * 3 + "Answer: 432" and verify(problem.worked(2), "432")
    assert [excess_columns(problem.worked(r), problem.digits) for r in (0, 1, 2)] == [0, 3, 6]
    # a column written twice counts; lines that are not columns (the answer, a malformed line) do not
    assert excess_columns("7+5+0=12\n7+5+0=12\n4+8+1=13\n3+0+1=4\nAnswer: 432", 3) == 1
    assert excess_columns("7+5+0=12\n4+8+1=13\n3+0+1=4 \n3+0=4\nAnswer: 432", 3) == 0
    rng = random.Random(0)
    draws = [draw_rechecks(rng, 1 / 3) for _ in range(30_000)]
    # geometric: P(at least k) = p^k, mean p / (1 - p) = 0.5
    assert sum(draws) / len(draws) == pytest.approx(0.5, abs=0.02)
    assert sum(d >= 2 for d in draws) / len(draws) == pytest.approx(1 / 9, abs=0.01)
    state = rng.getstate()
    assert draw_rechecks(rng, 0.0) == 0 and rng.getstate() == state  # the miniature's warm start draws as before
    with pytest.raises(ValueError, match="recheck probability"):
        draw_rechecks(rng, 1.0)


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("7+5+0=12\nAnswer: 432", True),
        ("answer:432", True),  # the reference rule: case-insensitive, spaces optional
        ("Answer: 4321", False),  # the sum's digits and nothing else
        ("Answer: 0432", False),
        ("Answer: 432\nAnswer: 433", False),  # the last answer line counts
        ("Answer: 433\nAnswer: 432", True),
        ("the sum is 432", False),
        ("Answer: 432 + 0", False),
    ],
)
def test_verifier_is_exact(completion, correct):
    assert verify(completion, "432") is correct


def test_bucket_assignment_at_the_edges():
    assert [bucket_of(d, BUCKETS) for d in (1, 2, 3, 4, 5, 8)] == ["1-2", "1-2", "3-4", "3-4", "5-6", "7-8"]
    assert bucket_of(3, ((1, 2), (3, 3))) == "3"
    with pytest.raises(ValueError, match="none of the buckets"):
        bucket_of(9, BUCKETS)
    with pytest.raises(ValueError, match="should start at 3"):
        check_buckets(((1, 2), (4, 5)), 1, 5)  # a gap
    with pytest.raises(ValueError, match="should start at 3"):
        check_buckets(((1, 2), (2, 5)), 1, 5)  # an overlap
    with pytest.raises(ValueError, match="must end at max_digits=6"):
        check_buckets(((1, 2), (3, 5)), 1, 6)


def test_splits_are_deterministic_disjoint_and_stratified():
    splits = addition_splits(num_train=400, test_per_bucket=25, buckets=BUCKETS, seed=3)
    again = addition_splits(num_train=400, test_per_bucket=25, buckets=BUCKETS, seed=3)
    assert (
        splits["train"]["prompt"] == again["train"]["prompt"] and splits["test"]["prompt"] == again["test"]["prompt"]
    )
    assert addition_splits(400, 25, BUCKETS, seed=4)["train"]["prompt"] != splits["train"]["prompt"]
    train, test = splits["train"], splits["test"]
    assert not set(train["prompt"]) & set(test["prompt"])
    assert len(set(train["prompt"])) == 400 and len(set(test["prompt"])) == 100
    assert [test["bucket"].count(label) for label in ("1-2", "3-4", "5-6", "7-8")] == [25, 25, 25, 25]
    for row in [*train, *test]:
        a, b = map(int, row["prompt"].strip().split("+"))
        assert row["answer"] == str(a + b) and row["digits"] == max(len(str(a)), len(str(b)))
        assert row["bucket"] == bucket_of(row["digits"], BUCKETS)
        assert verify(row["solution"], row["answer"])  # every worked solution passes the verifier
    assert set(train["digits"]) == set(range(1, 9))
    with pytest.raises(ValueError, match="distinct problems"):
        addition_splits(num_train=10, test_per_bucket=200, buckets=((1, 1),))  # 100 one-digit pairs exist


def test_char_tokenizer_round_trips_a_solution():
    tokenizer = build_char_tokenizer()
    text = AdditionProblem(347, 85).prompt + AdditionProblem(347, 85).solution
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and len(tokenizer) == 2 + 10 + len("+=\n :Answer")  # pad, end, digits, 11 more
    assert tokenizer.decode([*ids, tokenizer.eos_token_id, tokenizer.pad_token_id], skip_special_tokens=True) == text


def test_default_model_has_the_documented_size(tmp_path):
    build_model(tmp_path, StudyConfig(), seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    # per layer: q 512*512 + 512, k and v 512*256 + 256 each (4 of 8 heads), o 512*512, gate/up/down 3*512*1408,
    # two norms 2*512 = 2,951,168; 6 layers + tied embedding 23*512 + final norm 512 = 17,719,296
    assert sum(p.numel() for p in model.parameters()) == 17_719_296 == parameter_count(StudyConfig())
    smaller = smoke(PAPER)
    build_model(tmp_path / "small", smaller, seed=0)
    assert sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tmp_path / "small").parameters()) == (
        parameter_count(smaller)
    )


def test_the_warm_start_attends_on_the_math_backend_only(tmp_path, monkeypatch):
    # the fused kernels' backward is nondeterministic on a GPU: a start point rebuilt elsewhere would not reproduce
    config = SMOKE.with_overrides(sft_max_steps=1, sft_check_every=1)
    build_model(tmp_path, config, seed=0)
    sdpa, fused = torch.nn.functional.scaled_dot_product_attention, []

    def recording(*args, **kwargs):
        fused.append(torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    record = warm_start(tmp_path, config, held_out_prompts=set(), seed=0)
    assert record["steps"] == 1 and fused and not any(fused)


def test_the_readme_names_the_command_of_the_study_it_reports():
    """The README reports a 10-seed study while the default runs 5: the command it prints runs as many seeds as the
    study it reports, and the default does not."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("\n## The ablation\n", 1)[1].split("\n## ", 1)[0]
    reported = int(re.search(r"\((\d+) seeds x 7 variants", section).group(1))
    commands = re.findall(r"`\.venv/bin/python recipes/dapo_ablation\.py([^`]*)`", section)
    seeds = [len(study_config(parse_args(command.split())).seeds) for command in commands if "--seeds" in command]
    assert seeds == [reported] and reported == 10
    assert len(study_config(parse_args([])).seeds) == 5


def test_regimes_keep_the_first_study_and_give_the_paper_regime_its_preconditions():
    recorded = json.loads((ROOT / "benchmarks/results/ablation_h200_2026-12-03.json").read_text())["settings"]
    recorded["buckets"] = tuple(tuple(b) for b in recorded["buckets"])
    recorded["seeds"], recorded["variants"] = tuple(recorded["seeds"]), tuple(recorded["variants"])
    assert StudyConfig(**recorded) == MINIATURE  # the first study's settings, runnable as --regime miniature
    assert MINIATURE.sft_recheck_probability == 0.0 and MINIATURE.name == "miniature"
    longest = max(len(AdditionProblem(a, b).solution) + 1 for a, b in ((99_999_999, 99_999_999), (10**7, 0)))
    assert longest == 90  # 8 columns of up to 8 characters and a newline, "Answer: " and 9 digits, the end token
    # the paper regime: every minimal solution fits and is never punished, the punishment starts right after the
    # longest one (the paper's buffer, a fifth of the limit); one recheck of an 8-digit problem does not fit
    penalty = OverlongPenalty(PAPER.max_completion_length, PAPER.overlong_buffer_len, PAPER.overlong_penalty_factor)
    assert penalty(completion_ids=[[1] * 90, [1] * 91, [1] * 112]) == pytest.approx([0.0, -1 / 22, -1.0])
    assert len(AdditionProblem(10**7, 0).worked(1)) + 1 > PAPER.max_completion_length
    assert PAPER.steps_per_generation == 16 and PAPER.generation_rows == 2048 and len(PAPER.seeds) >= 5
    assert PAPER.max_steps % PAPER.steps_per_generation == 0 and PAPER.eval_steps() == [0, 32, 64, 96, 128, 160]
    # a changed RL setting keeps the start points (the regime check's are the study's), not the runs
    other = PAPER.with_overrides(learning_rate=3e-4, max_steps=16, eval_every=16, workers=2)
    assert other.start_fingerprint() == PAPER.start_fingerprint() and other.fingerprint() != PAPER.fingerprint()
    assert PAPER.with_overrides(sft_target_accuracy=0.5).start_fingerprint() != PAPER.start_fingerprint()
    assert PAPER.start_fingerprint() != MINIATURE.start_fingerprint()


def test_reward_scores_counts_and_logs_groups_and_mechanisms():
    reward, logged = AdditionReward(num_generations=2, end_token_ids=frozenset({0, 1})), {}
    recheck = "3+0+0=3\n3+0+0=3\nAnswer: 3"  # one column, written twice: right, and a recheck
    scores = reward(
        completions=[recheck, "Answer: 4", "Answer: 5", "Answer: 5", "x", "y"],
        answer=["3", "3", "5", "5", "7", "7"],
        digits=[1, 1, 1, 1, 1, 1],
        # rows end with the end token (1), pad (0) or neither (truncated: the third and the fifth)
        completion_ids=[[5, 1], [5] * 4 + [1], [5] * 6, [5] * 6 + [0], [5] * 8, [5, 5, 1]],
        log_metric=logged.__setitem__,
    )
    assert scores == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    # groups solved 1/2, 2/2, 0/2: one informative group of three; lengths 2 to 8
    assert logged == {
        "study/informative_groups": 1 / 3,
        "study/solve_rate": 0.5,
        "study/truncated": 2 / 6,
        "study/length_spread": 4.0,
        "study/rechecked": 1 / 6,
    }
    assert reward.totals() == {"generated_completions": 6, "generated_tokens": 2 + 5 + 6 + 7 + 8 + 3}
    with pytest.raises(ValueError, match="consecutive groups"):
        reward(completions=["a", "b"], answer=["3", "4"], digits=[1, 1], completion_ids=[[1], [1]])


def test_ladder_adds_one_piece_per_variant(tmp_path):
    pieces = [f.name for f in fields(VARIANTS[0]) if f.name not in ("name", "adds")]
    for before, after in itertools.pairwise(VARIANTS):
        changed = [p for p in pieces if getattr(before, p) != getattr(after, p)]
        assert len(changed) == 1, (after.name, changed)
    config = StudyConfig(device="cpu", bf16=False)
    tokenizer = build_char_tokenizer()
    assert [v.name for v in run_order(config)] == [
        "grpo", "dynamic_sampling", "overlong_filter", "clip_higher", "soft_overlong", "token_level", "dapo_paged_engine",
        "dapo_partial",
    ]  # fmt: skip
    assert [v.name for v in run_order(config.with_overrides(variants=("clip_higher", "grpo")))] == [
        "grpo",
        "clip_higher",
    ]
    setups = {v.name: trainer_setup(v, config, 0, tmp_path, tokenizer, memory_share=0.15) for v in VARIANTS}
    trainer_class, grpo, rewards = setups["grpo"]
    assert trainer_class.__name__ == "GRPOTrainer" and grpo.loss_type == "grpo" and len(rewards) == 1
    assert (grpo.epsilon, grpo.epsilon_high, grpo.mask_truncated_completions, grpo.beta) == (0.2, 0.2, False, 0.0)
    assert setups["clip_higher"][1].epsilon_high == 0.28 and setups["clip_higher"][1].mask_truncated_completions
    assert type(setups["soft_overlong"][2][1]).__name__ == "OverlongPenalty"
    dapo = setups["dynamic_sampling"][1]
    assert isinstance(dapo, DAPOConfig) and dapo.dynamic_sampling and dapo.rollout_engine == "trl"
    assert dapo.overlong_buffer_len == 32 and dapo.clip_ratio_c is None and dapo.dynamic_sampling_metric == "accuracy"
    assert not setups["token_level"][1].dynamic_sampling and setups["dapo_paged_engine"][1].rollout_engine == "paged"
    assert setups["dapo_paged_engine"][1].rollout_memory_fraction == 0.15  # the worker's share, not the device's
    assert not setups["dapo_paged_engine"][1].partial_rollouts and setups["dapo_partial"][1].partial_rollouts
    assert setups["dapo_partial"][1].rollout_engine == "paged" and setups["dapo_partial"][1].dynamic_sampling
    # same budget: every variant trains the same rows per optimizer step for the same steps
    geometry = {
        (a.per_device_train_batch_size, a.steps_per_generation, a.max_steps, a.learning_rate, a.num_generations)
        for _, a, _ in setups.values()
    }
    assert geometry == {(128, 4, 80, config.learning_rate, 8)}
    paper_cpu = PAPER.with_overrides(device="cpu", bf16=False)
    paper = [trainer_setup(v, paper_cpu, 0, tmp_path, tokenizer, 0.15)[1] for v in VARIANTS]
    assert {(a.per_device_train_batch_size, a.steps_per_generation, a.max_completion_length) for a in paper} == {
        (128, 16, 112)
    }


def test_crossing_interpolates_between_evaluations():
    curve = [{"t": t, "avg": {"all": v}} for t, v in ((0, 0.2), (10, 0.4), (30, 0.8), (40, 0.7))]
    assert crossing(curve, "avg", 0.6, "t") == pytest.approx(20.0)  # 10 + (0.6 - 0.4) / (0.8 - 0.4) * 20
    assert crossing(curve, "avg", 0.1, "t") == 0.0
    assert crossing(curve, "avg", 0.9, "t") is None


def test_t_interval_against_tabulated_and_hand_values():
    # Student's t, two-sided 95%: the tables' 12.706, 4.303, 2.776, 2.228 and 2.042
    for df, tabulated in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert t_quantile(0.95, df) == pytest.approx(tabulated, abs=5e-4)
    gains = spread([0.1, 0.2, 0.3, 0.4, 0.5])
    # mean 0.3, sample sd sqrt(0.025) = 0.158114, half-width 2.776445 * 0.158114 / sqrt(5) = 0.196324
    assert gains["ci95"] == pytest.approx([0.3 - 0.196324, 0.3 + 0.196324], abs=1e-6)
    assert spread([0.2])["ci95"] is None and spread([]) is None


def test_window_means_average_the_updates_between_evaluations():
    series = [[1, 1.0], [2, 2.0], [3, 3.0], [4, float("nan")], [5, 5.0]]
    assert window_means(series, [0, 2, 4]) == [None, 1.5, 3.0]  # step 5 is past the last evaluation, nan skipped
    assert window_means([], [0, 2]) == [None, None]


def _hand_run(points: list[tuple], train_s: float = 20.0, train: dict | None = None) -> dict:
    """A finished run from (step, wall-clock s, avg@8, held-out entropy, held-out truncated share) per evaluation."""
    curve = [
        {"step": step, "wall_clock_s": t, "generated_completions": 8, "generated_tokens": 80, "entropy": entropy,
         "truncated": truncated, "rechecked": truncated / 2, "mean_length": 10.0, "max_length": 40,
         "greedy": {"all": v}, "avg@8": {"all": v, "1": v}, "pass@8": {"all": v}}
        for step, t, v, entropy, truncated in points
    ]  # fmt: skip
    return {"status": "ok", "train_s": train_s, "curve": curve, "train": train or {}}


def test_summary_pairs_runs_by_seed_reads_the_targets_and_reports_failures():
    config = StudyConfig(
        device="cpu",
        variants=("grpo", "clip_higher", "dapo_paged_engine"),
        seeds=(0, 1, 2),
        max_steps=20,
        eval_every=20,
    )
    clipped = {"clip_ratio/high_mean": [[1, 0.0], [2, 0.02], [10, 0.04], [20, 0.06]]}
    grpo = [  # seeds start at 0.4, 0.7 and 0.5: the start points differ more than the variants
        _hand_run([(0, 0, 0.4, 0.4, 0.2), (20, 20, 0.5, 0.10, 0.10)], train=clipped),
        _hand_run([(0, 0, 0.7, 0.4, 0.2), (20, 20, 0.8, 0.16, 0.10)], train=clipped),
        _hand_run([(0, 0, 0.5, 0.4, 0.2), (20, 20, 0.6, 0.12, 0.10)], train=clipped),
    ]
    higher = [
        _hand_run([(0, 0, 0.4, 0.4, 0.2), (20, 10, 0.6, 0.30, 0.05)]),
        _hand_run([(0, 0, 0.7, 0.4, 0.2), (20, 10, 0.8, 0.31, 0.10)]),
        {"status": "failed", "attempts": 2, "error": "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory"},
    ]
    paged = [  # reaches GRPO's final at 4 s of GRPO's 20 on seeds 0 and 1, never on seed 2
        _hand_run([(0, 0, 0.4, 0.4, 0.2), (20, 8, 0.6, 0.2, 0.1)]),
        _hand_run([(0, 0, 0.7, 0.4, 0.2), (20, 8, 0.9, 0.2, 0.1)]),
        _hand_run([(0, 0, 0.5, 0.4, 0.2), (20, 8, 0.55, 0.2, 0.1)]),
    ]
    records = [
        {"seed": seed, "runs": {"grpo": grpo[seed], "clip_higher": higher[seed], "dapo_paged_engine": paged[seed]}}
        for seed in (0, 1, 2)
    ]
    summary = summarize(config, records)
    assert summary["targets"] == {0: 0.5, 1: 0.8, 2: 0.6}
    gain = summary["variants"]["clip_higher"]["gain_over_baseline"]
    # paired gains 0.1 and 0.0 (seed 2 failed: left out of the mean, and said so below): mean 0.05, sd 0.070711,
    # half-width 12.706205 * 0.070711 / sqrt(2) = 0.635310; unpaired, the seeds' spread would swamp it
    assert gain["n"] == 2 and gain["mean"] == pytest.approx(0.05)
    assert gain["ci95"] == pytest.approx([0.05 - 0.635310, 0.05 + 0.635310], abs=1e-5)
    assert summary["variants"]["clip_higher"]["seeds_failed"] == 1
    assert summary["failures"] == [
        {"seed": 2, "variant": "clip_higher", "attempts": 2, "error": "torch.OutOfMemoryError: CUDA out of memory"}
    ]
    assert not summary["complete"] and summary["left"] == []
    # seed 0 reaches its 0.5 at 5 s (halfway from 0.4 to 0.6), seed 1 its 0.8 at 10 s
    assert summary["variants"]["clip_higher"]["wall_clock_to_target_s"]["mean"] == pytest.approx(7.5)
    mechanisms = summary["variants"]["grpo"]["mechanisms"]
    assert mechanisms["clip_high"][0] is None and mechanisms["clip_high"][1]["mean"] == pytest.approx(0.03)
    assert mechanisms["entropy"][1]["mean"] == pytest.approx((0.10 + 0.16 + 0.12) / 3)
    read = summary["targets_read"]
    # GRPO's entropy over its start: 0.25, 0.40, 0.30
    assert read["grpo_entropy_over_start"]["mean"] == pytest.approx(0.95 / 3) and read["grpo_entropy_halved"]
    # final entropy: GRPO 0.1267, half-width 4.302653 * 0.030551 / sqrt(3) = 0.075893, so up to 0.202560;
    # Clip-Higher 0.305, half-width 12.706205 * 0.007071 / sqrt(2) = 0.063531, so from 0.241469: separated
    assert read["final_entropy"]["grpo"]["ci95"][1] == pytest.approx(0.202560, abs=1e-5)
    assert read["final_entropy"]["clip_higher"]["ci95"][0] == pytest.approx(0.241469, abs=1e-5)
    assert read["clip_higher_entropy_separated"]
    wider = [json.loads(json.dumps(r)) for r in records]  # Clip-Higher's final entropies 0.20 and 0.40: higher on
    wider[0]["runs"]["clip_higher"]["curve"][-1]["entropy"] = 0.20  # average, but its interval reaches into GRPO's
    wider[1]["runs"]["clip_higher"]["curve"][-1]["entropy"] = 0.40
    assert not summarize(config, wider)["targets_read"]["clip_higher_entropy_separated"]
    # truncation after the start: Clip-Higher 0.05 and 0.10 against GRPO's 0.10 and 0.10
    assert read["truncation_after_start_minus_grpo"]["clip_higher"]["mean"] == pytest.approx(-0.025)
    assert read["full_dapo_gain"]["dapo_paged_engine"]["mean"] == pytest.approx((0.1 + 0.1 - 0.05) / 3)
    assert not read["full_dapo_beats_grpo"]["dapo_paged_engine"]
    paged_time = read["paged_wall_clock_to_grpo_final_over_grpo"]
    assert paged_time["by_seed"] == [pytest.approx(0.2), pytest.approx(0.2), math.inf] and paged_time["reached"] == 2
    assert not read["paged_within_half_grpo_wall_clock"]  # a seed that never reaches it is not within half
    lighter = [json.loads(json.dumps(r)) for r in records]  # seed 2's engine run shared the device with fewer
    lighter[2]["runs"]["dapo_paged_engine"]["memory_share"] = 0.22  # workers than its GRPO run: not compared
    for record in lighter:
        record["runs"]["grpo"]["memory_share"] = 0.15
        record["runs"]["dapo_paged_engine"].setdefault("memory_share", 0.15)
    lighter_time = summarize(config, lighter)["targets_read"]
    assert lighter_time["paged_wall_clock_to_grpo_final_over_grpo"]["equal_sharing"] == [True, True, False]
    assert lighter_time["paged_within_half_grpo_wall_clock"]  # seeds 0 and 1: 0.2 of GRPO's time
    left = summarize(config, records[:1])["left"]  # seeds 1 and 2 not run yet: every one of their runs is left
    assert left == [[seed, name] for seed in (1, 2) for name in ("grpo", "clip_higher", "dapo_paged_engine")]


def test_partial_rollouts_are_read_against_the_paged_engine_seed_by_seed():
    """Final avg@8 of the paged engine 0.6, 0.8, 0.5 and with partial rollouts 0.58, 0.80, 0.49: paired differences
    -0.02, 0, -0.01, mean -0.01, sd 0.01, half-width 4.302653 * 0.01 / sqrt(3) = 0.024841, so the interval starts at
    -0.034841, below -0.03: no loss is not shown. Wall-clock to the seed's paged final (which the paged run reaches at
    its end, 20 s): partial rollouts reach seed 1's at 12 s (0.6 of 20 s), and never seed 0's or seed 2's
    (infinite). With partial finals equal to the paged ones, each is reached at 12 s, and the interval is [0, 0]."""
    config = StudyConfig(
        device="cpu", variants=("dapo_paged_engine", "dapo_partial"), seeds=(0, 1, 2), max_steps=20, eval_every=20
    )
    paged = [_hand_run([(0, 0, start, 0.4, 0.2), (20, 20, final, 0.2, 0.1)]) for start, final in
             ((0.4, 0.6), (0.6, 0.8), (0.3, 0.5))]  # fmt: skip
    partial = [
        _hand_run([(0, 0, 0.4, 0.4, 0.2), (20, 12, 0.58, 0.2, 0.1)]),
        _hand_run([(0, 0, 0.6, 0.4, 0.2), (20, 12, 0.80, 0.2, 0.1)]),
        _hand_run([(0, 0, 0.3, 0.4, 0.2), (20, 12, 0.49, 0.2, 0.1)]),
    ]
    records = [{"seed": seed, "runs": {"dapo_paged_engine": paged[seed], "dapo_partial": partial[seed]}}
               for seed in (0, 1, 2)]  # fmt: skip
    summary = summarize(config, records)
    read = summary["targets_read"]["partial_rollouts"]
    assert read["final_minus_paged"]["mean"] == pytest.approx(-0.01)
    assert read["final_minus_paged"]["ci95"][0] == pytest.approx(-0.01 - 0.024841, abs=1e-5)
    assert not read["no_loss"]
    assert read["wall_clock_to_paged_final_over_paged"] == [math.inf, pytest.approx(0.6), math.inf]
    assert read["equal_sharing"] == [True] * 3 and read["median_where_alike"] == math.inf
    assert not read["sooner_where_alike"]
    closer = [json.loads(json.dumps(r)) for r in records]  # partial's finals 0.60, 0.80, 0.50: no difference at all
    for record, final in zip(closer, (0.60, 0.80, 0.50), strict=True):
        record["runs"]["dapo_partial"]["curve"][-1]["avg@8"]["all"] = final
    read = summarize(config, closer)["targets_read"]["partial_rollouts"]
    assert read["no_loss"] and read["wall_clock_to_paged_final_over_paged"] == [pytest.approx(0.6)] * 3
    assert read["sooner_where_alike"]
    assert "dapo_partial minus dapo_paged_engine, final avg@8: +0.000" in format_targets(summarize(config, closer))


def test_evaluation_masks_and_bucket_means():
    completion = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    assert _first_eos_mask(completion, eos_token_id=1).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert _by_group([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]) == {"a": 0.5, "all": 0.75, "b": 1.0}


def test_study_config_rejects_bad_settings_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match="multiple of steps_per_generation"):
        StudyConfig(max_steps=10, steps_per_generation=4)
    with pytest.raises(ValueError, match="unknown study settings"):
        SMOKE.with_overrides(max_step=3)
    SMOKE.save(tmp_path / "c.json")
    assert StudyConfig.load(tmp_path / "c.json") == SMOKE


def test_jobs_go_longest_first_to_the_least_loaded_worker_then_run_in_ladder_order():
    cost = {"a": 5.0, "b": 3.0, "c": 2.0}  # run order a, b, c
    jobs = [(seed, name) for seed in (0, 1, 2) for name in cost]
    # by hand: a0->w0 (5), a1->w1 (5), a2->w0 (10), b0->w1 (8), b1->w1 (11), b2->w0 (13), c0->w1 (13), c1->w0 (15,
    # the tie to the first), c2->w1 (15)
    assert deal(jobs, cost, workers=2) == [
        [(0, "a"), (2, "a"), (2, "b"), (1, "c")],
        [(1, "a"), (0, "b"), (1, "b"), (0, "c"), (2, "c")],
    ]
    assert deal(jobs[:2], cost, workers=6) == [[(0, "a")], [(0, "b")]]  # no idle worker started


def test_the_command_line_names_the_regimes_and_overrides_only_what_it_is_given():
    from dapo_ablation import parse_args, study_config

    assert study_config(parse_args([])) == PAPER and study_config(parse_args(["--regime", "miniature"])) == MINIATURE
    assert study_config(parse_args(["--smoke", "--regime", "miniature"])) == smoke(MINIATURE)
    changed = study_config(parse_args(["--learning-rate", "3e-4", "--warm-start-target", "0.3", "--seeds", "7"]))
    assert (changed.learning_rate, changed.sft_target_accuracy, changed.seeds) == (3e-4, 0.3, (7,))
    assert (
        changed.with_overrides(learning_rate=PAPER.learning_rate, sft_target_accuracy=0.4, seeds=PAPER.seeds) == PAPER
    )


def test_memory_plan_fits_the_workers_on_the_device_or_refuses():
    h200 = 139 * GIB
    plan = memory_plan(PAPER, h200, workers=6)
    # the largest live set is generate's cache of a dynamic-sampling round: 2,048 rows x 2 (oversampling) x 130
    # tokens x 6 layers x 2 (k, v) x 256 x 4 bytes, twice while it grows = 12.2 GiB; then the training state and the
    # allocator's slack: 1.25 x (12.19 + 0.26) GiB
    assert plan["parts_bytes"]["generation"] == 2 * 4096 * 130 * 6 * 2 * 256 * 4
    assert plan["need_bytes"] == int(1.25 * (2 * 4096 * 130 * 6 * 2 * 256 * 4 + 17_719_296 * 16))
    # six shares and six contexts stay within the usable part of the device
    assert 6 * (plan["share_bytes"] + 0.75 * GIB) <= 0.92 * h200 + 1
    assert plan["share"] == pytest.approx(plan["share_bytes"] / h200) and plan["most_workers"] == 7
    with pytest.raises(MemoryPlanError, match="use --workers 7 or fewer"):
        memory_plan(PAPER, h200, workers=8)
    with pytest.raises(MemoryPlanError, match="use --workers 1 or fewer"):
        memory_plan(PAPER, 24 * GIB, workers=2)
    # the miniature's rounds are smaller (512 rows, oversampled 4x), so its plan needs less
    assert memory_plan(MINIATURE, h200, workers=6)["need_bytes"] < plan["need_bytes"]


def test_the_check_reads_its_preconditions_from_the_logs():
    logs = [
        {"step": 1, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "entropy": 0.30, "study/truncated": 0.125,
         "study/length_spread": 6.0, "study/rechecked": 0.25, "study/informative_groups": 0.5, "study/solve_rate": 0.4,
         "completions/mean_length": 60.0},
        {"step": 2, "clip_ratio/low_mean": 0.002, "clip_ratio/high_mean": 0.004, "entropy": 0.28},
        {"step": 3, "clip_ratio/low_mean": 0.004, "clip_ratio/high_mean": 0.014, "entropy": 0.25},
        {"train_runtime": 1.0, "step": 3},
    ]  # fmt: skip
    measured = measure(logs)
    assert measured["clip_high_mean"] == pytest.approx(0.006) and measured["clip_low_mean"] == pytest.approx(0.002)
    assert measured["clip_one_side"] == pytest.approx(0.006)  # the larger side's mean over the three updates
    assert (measured["entropy"], measured["entropy_last"], measured["truncated"]) == (0.30, 0.25, 0.125)
    assert measured["length_spread"] == 6.0 and [u["step"] for u in measured["updates"]] == [1, 2, 3]


def test_failed_runs_are_retried_once_in_fewer_processes(tmp_path, monkeypatch):
    config = SMOKE.with_overrides(seeds=(0, 1), variants=("grpo", "clip_higher"), workers=2)
    for seed in config.seeds:  # start points on record: no warm start needed
        study.write_json(
            study.result_file(tmp_path, seed, study.START), {"settings": config.start_fingerprint(), "digest": "d"}
        )
    phases = []

    def phase(self, name: str, shares: list[list[str]]) -> list[int]:
        phases.append((name, shares))
        for share in shares:
            for job in share:
                seed, variant = job.split(":")
                # seed 1's clip_higher fails every time; the others succeed
                status = "failed" if job == "1:clip_higher" else "ok"
                record = {"status": status, "start_digest": "d", "settings": config.fingerprint(), "error": "boom"}
                study.write_json(study.result_file(tmp_path, int(seed), variant), record)
        return [0] * len(shares)

    monkeypatch.setattr(study.Launcher, "phase", phase)
    monkeypatch.setattr(study.Launcher, "prepare", lambda self, seeds, second_warm_start=None: [])
    study.launch_workers(config, tmp_path, {"grpo": 2.0, "clip_higher": 1.0}, deadline=None)
    assert phases == [
        ("run", [["0:grpo", "0:clip_higher"], ["1:grpo", "1:clip_higher"]]),
        ("run", [["1:clip_higher"]]),  # once more, in one process (a larger share of the device), then no more
    ]
    assert study.pending_jobs(config, tmp_path) == [(1, "clip_higher")]  # reported, and the next call tries again
    assert study.seeds_to_prepare(config, tmp_path) == [1]  # seed 0's runs are all done: no warm start for it


def test_a_worker_leaves_jobs_past_the_deadline_for_the_next_call(tmp_path, capsys):
    SMOKE.save(tmp_path / "config.json")
    study._worker_main(
        ["run", str(tmp_path / "config.json"), str(tmp_path), "--processes", "2", "--memory-share", "1",
         "--deadline", str(time.time() + 1.0), "--jobs", "0:grpo", "1:grpo"]
    )  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "[seed 0] grpo: left for the next call",
        "[seed 1] grpo: left for the next call",
    ]
    assert not (tmp_path / "runs").exists()  # nothing started


def run_smoke(output: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "recipes/dapo_ablation.py"), "--smoke", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def smoke_study(tmp_path_factory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("ablation") / "study"
    return output, run_smoke(output).stdout


def test_smoke_study_runs_end_to_end(smoke_study):
    output, stdout = smoke_study
    assert "| grpo | 2 |" in stdout and "plan (estimates" in stdout and "targets, read from" in stdout
    study = json.loads((output / "ablation.json").read_text())
    assert {"date", "device", "versions", "commit", "settings", "plan", "summary", "seeds"} <= set(study)
    assert study["settings"]["name"] == "paper" and study["settings"]["sft_recheck_probability"] == 1 / 3
    assert (output / "ablation.png").stat().st_size > 20_000
    summary = study["summary"]
    assert summary["complete"] and summary["failures"] == summary["left"] == []
    assert list(summary["variants"]) == [v.name for v in VARIANTS]
    assert set(summary["targets"]) == {"0", "1"} and all(0.0 <= t <= 1.0 for t in summary["targets"].values())
    # one generation batch per run: 2 prompts x 4 samples per step, 2 steps per batch
    batch = SMOKE.prompts_per_step * SMOKE.num_generations * SMOKE.steps_per_generation
    for name, variant in summary["variants"].items():
        assert variant["seeds_ok"] == 2 and variant["seeds_failed"] == 0
        for metric in ("avg@2", "greedy", "pass@2"):
            assert 0.0 <= variant["final"][metric]["min"] <= variant["final"][metric]["max"] <= 1.0
        assert variant["final"]["avg@2"]["min"] <= variant["final"]["pass@2"]["max"]
        mechanisms = variant["mechanisms"]
        assert mechanisms["clip_high"][0] is None and mechanisms["clip_high"][1]["n"] == 2  # per evaluation window
        assert 0.0 <= mechanisms["truncated"][1]["mean"] <= 1.0 and mechanisms["max_length"][1]["max"] <= 40
        generated = variant["generated_completions"]
        if name in ("dynamic_sampling", "dapo_paged_engine", "dapo_partial"):  # a round or more (groups filtered)
            assert generated["min"] >= batch
        else:
            assert generated["min"] == generated["max"] == batch
    for record in study["seeds"]:
        assert record["warm_start"]["steps"] <= SMOKE.sft_max_steps
        for run in record["runs"].values():
            curve = run["curve"]
            assert [p["step"] for p in curve] == [0, 2] and len(run["step_wall_clock_s"]) == 2
            assert curve[0]["wall_clock_s"] == 0.0 < curve[1]["wall_clock_s"] <= run["train_s"]
            assert curve[0]["greedy"] == record["runs"]["grpo"]["curve"][0]["greedy"]  # one start per seed
            assert math.isfinite(curve[1]["entropy"]) and curve[1]["entropy"] >= 0.0
            assert 0.0 <= curve[1]["rechecked"] <= 1.0 and curve[1]["max_length"] <= SMOKE.max_completion_length
            expected = {"entropy", "completions/mean_length", "study/informative_groups", "study/truncated"}
            assert expected | {"study/rechecked", "clip_ratio/high_mean"} <= set(run["train"])
            assert run["attempts"] == 1
        assert record["runs"]["dapo_paged_engine"]["rollout_engine"] == "PagedRolloutEngine"
        assert record["runs"]["grpo"]["rollout_engine"] == "transformers generate"


def test_a_rerun_does_only_what_is_missing_and_checks_the_start_points(smoke_study, tmp_path):
    output = tmp_path / "study"
    shutil.copytree(smoke_study[0], output)
    runs = output / "runs"
    before = {path.relative_to(runs): path.read_bytes() for path in runs.glob("*/*.json")}
    # seed 0 on a fresh machine, one run lost: its warm start is redone and must reproduce the recorded weights
    shutil.rmtree(output / "models" / "seed0")
    (runs / "seed0" / "grpo.json").unlink()
    # seed 1's recorded start point and runs are not the weights on disk, and one run is missing: the others did not
    # start from the weights the missing one will start from
    start1 = json.loads((runs / "seed1" / "start.json").read_text())
    for path in (runs / "seed1").glob("*.json"):
        record = json.loads(path.read_text())
        record["start_digest" if path.stem != "start" else "digest"] = "0" * 64
        path.write_text(json.dumps(record))
    (runs / "seed1" / "clip_higher.json").unlink()
    stdout = run_smoke(output).stdout
    assert "[seed 0] start point in" in stdout and "[seed 0] grpo: ok" in stdout
    assert f"[seed 1] {len(VARIANTS) - 1} earlier runs did not start from these weights" in stdout
    seed0 = [line for line in stdout.splitlines() if line.startswith("[seed 0]") and ": ok in" in line]
    assert len(seed0) == 1  # the other runs of seed 0 were kept, byte for byte
    for name in VARIANTS[1:]:
        assert (runs / "seed0" / f"{name.name}.json").read_bytes() == before[Path("seed0", f"{name.name}.json")]
    new_start0 = json.loads((runs / "seed0" / "start.json").read_text())
    old_start0 = json.loads(before[Path("seed0/start.json")])
    assert new_start0["digest"] == old_start0["digest"] and new_start0["start_point"] == old_start0["start_point"]
    # the CPU run is deterministic: the redone run learned exactly what the lost one had
    redone, lost = json.loads((runs / "seed0" / "grpo.json").read_text()), json.loads(before[Path("seed0/grpo.json")])

    def learned(run: dict) -> list[dict]:
        return [{k: v for k, v in point.items() if k != "wall_clock_s"} for point in run["curve"]]

    assert learned(redone) == learned(lost) and redone["train"] == lost["train"]
    assert sorted(p.name for p in (runs / "seed1" / "stale").glob("*/*.json")) == sorted(
        f"{v.name}.json" for v in VARIANTS if v.name != "clip_higher"
    )
    assert json.loads((runs / "seed1" / "start.json").read_text())["digest"] == start1["digest"]  # the true one
    summary = json.loads((output / "ablation.json").read_text())["summary"]
    assert all(variant["seeds_ok"] == 2 for variant in summary["variants"].values())


def test_the_smoke_regime_check_reuses_the_start_points_and_reports(smoke_study, tmp_path):
    output = tmp_path / "study"
    shutil.copytree(smoke_study[0], output)
    command = [sys.executable, str(ROOT / "recipes/dapo_ablation.py"), "--smoke", "--check", "--output", str(output)]
    command += ["--seeds", "0", "--check-learning-rates", "0.001"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode in (0, 2), result.stdout[-3000:] + result.stderr[-3000:]  # 2: a precondition fails
    assert "[seed 0] start point kept" in result.stdout and "[seed 0] check at lr 0.001: ok" in result.stdout
    assert "[seed 0] second warm start in" in result.stdout and not (output / "models/reproduce-seed0").exists()
    check = json.loads((output / "regime_check.json").read_text())
    assert check["start_points_reproduce"] == {"0": True}  # a fresh process warm-started the same weights
    assert check["settings"]["0.001"]["learning_rate"] == 0.001 and check["settings"]["0.001"]["max_steps"] == 2
    entry = check["by_learning_rate"]["0.001"]
    assert entry["seeds"] == [0] and entry["missing"] == 0
    assert check["passed"] == all(entry["holds"].values()) and (result.returncode == 0) == check["passed"]
    assert 0.0 <= entry["truncated"]["mean"] <= 1.0 and entry["length_spread"]["mean"] >= 1.0
    assert entry["entropy"]["mean"] > 0.0 and 0.0 <= entry["clip_high_mean"]["mean"] <= 1.0
    record = json.loads((output / "check/seed0/lr0.001.json").read_text())
    assert len(record["updates"]) == SMOKE.steps_per_generation  # one generation batch of updates
