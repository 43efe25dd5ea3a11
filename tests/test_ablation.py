"""The ablation study: the addition task and its verifier on hand-derived cases, difficulty buckets, the variant
ladder's configs, the summary's interpolation, and the whole `--smoke` pipeline end to end on the CPU."""

import itertools
import json
import math
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_dapo import DAPOConfig
from trl_dapo.data import addition_splits
from trl_dapo.data.addition import AdditionProblem, bucket_of, check_buckets, verify

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
from ablation.config import SMOKE, StudyConfig  # noqa: E402
from ablation.evaluation import _by_bucket, _first_eos_mask  # noqa: E402
from ablation.model import build_char_tokenizer, build_model  # noqa: E402
from ablation.report import crossing, summarize  # noqa: E402
from ablation.study import deal  # noqa: E402
from ablation.variants import VARIANTS, AdditionReward, run_order, trainer_setup  # noqa: E402

BUCKETS = ((1, 2), (3, 4), (5, 6), (7, 8))


def test_scratchpad_adds_columns_with_carries():
    assert AdditionProblem(347, 85).solution == "7+5+0=12\n4+8+1=13\n3+0+1=4\nAnswer: 432"
    # a carry through every column and out of the last one
    assert AdditionProblem(1, 999).solution == "1+9+0=10\n0+9+1=10\n0+9+1=10\nAnswer: 1000"
    assert AdditionProblem(0, 0).solution == "0+0+0=0\nAnswer: 0"
    assert (AdditionProblem(85, 347).digits, AdditionProblem(85, 347).prompt) == (3, "85+347\n")


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
    assert sum(p.numel() for p in model.parameters()) == 17_719_296


def test_reward_scores_counts_and_logs_groups():
    reward, logged = AdditionReward(num_generations=2), {}
    scores = reward(
        completions=["Answer: 3", "Answer: 4", "Answer: 5", "Answer: 5", "x", "y"],
        answer=["3", "3", "5", "5", "7", "7"],
        completion_ids=[[1] * 4, [1] * 5, [1] * 6, [1] * 7, [1], [1, 1]],
        log_metric=logged.__setitem__,
    )
    assert scores == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    # groups solved 1/2, 2/2, 0/2: one informative group of three
    assert logged == {"study/informative_groups": 1 / 3, "study/solve_rate": 0.5}
    assert reward.totals() == {"generated_completions": 6, "generated_tokens": 25}
    with pytest.raises(ValueError, match="consecutive groups"):
        reward(completions=["a", "b"], answer=["3", "4"], completion_ids=[[1], [1]])


def test_ladder_adds_one_piece_per_variant(tmp_path):
    pieces = [f.name for f in fields(VARIANTS[0]) if f.name not in ("name", "adds")]
    for before, after in itertools.pairwise(VARIANTS):
        changed = [p for p in pieces if getattr(before, p) != getattr(after, p)]
        assert len(changed) == 1, (after.name, changed)
    config = StudyConfig(device="cpu", bf16=False)
    assert [v.name for v in run_order(config)] == [
        "grpo", "dynamic_sampling", "overlong_filter", "clip_higher", "soft_overlong", "token_level", "dapo_paged_engine"
    ]  # fmt: skip
    assert [v.name for v in run_order(config.with_overrides(variants=("clip_higher", "grpo")))] == [
        "grpo",
        "clip_higher",
    ]
    setups = {v.name: trainer_setup(v, config, 0, tmp_path) for v in VARIANTS}
    trainer_class, grpo, rewards = setups["grpo"]
    assert trainer_class.__name__ == "GRPOTrainer" and grpo.loss_type == "grpo" and len(rewards) == 1
    assert (grpo.epsilon, grpo.epsilon_high, grpo.mask_truncated_completions, grpo.beta) == (0.2, 0.2, False, 0.0)
    assert setups["clip_higher"][1].epsilon_high == 0.28 and setups["clip_higher"][1].mask_truncated_completions
    assert type(setups["soft_overlong"][2][1]).__name__ == "OverlongPenalty"
    dapo = setups["dynamic_sampling"][1]
    assert isinstance(dapo, DAPOConfig) and dapo.dynamic_sampling and dapo.rollout_engine == "trl"
    assert dapo.overlong_buffer_len == 32 and dapo.clip_ratio_c is None and dapo.dynamic_sampling_metric == "accuracy"
    assert not setups["token_level"][1].dynamic_sampling and setups["dapo_paged_engine"][1].rollout_engine == "paged"
    # same budget: every variant trains the same rows per optimizer step for the same steps
    geometry = {
        (a.per_device_train_batch_size, a.steps_per_generation, a.max_steps, a.learning_rate, a.num_generations)
        for _, a, _ in setups.values()
    }
    assert geometry == {(128, 4, 80, config.learning_rate, 8)}


def test_crossing_interpolates_between_evaluations():
    curve = [{"t": t, "avg": {"all": v}} for t, v in ((0, 0.2), (10, 0.4), (30, 0.8), (40, 0.7))]
    assert crossing(curve, "avg", 0.6, "t") == pytest.approx(20.0)  # 10 + (0.6 - 0.4) / (0.8 - 0.4) * 20
    assert crossing(curve, "avg", 0.1, "t") == 0.0
    assert crossing(curve, "avg", 0.9, "t") is None


def test_summary_pairs_each_variant_with_grpo_from_the_same_seed():
    def run(curve: list[tuple[float, float]]) -> dict:
        points = [
            {"step": 10 * i, "wall_clock_s": t, "generated_completions": 8, "generated_tokens": 80, "entropy": 0.5,
             "mean_length": 10.0, "greedy": {"all": v}, "avg@8": {"all": v}, "pass@8": {"all": v}}
            for i, (t, v) in enumerate(curve)
        ]  # fmt: skip
        return {"status": "ok", "train_s": curve[-1][0], "curve": points}

    records = [  # seed 0 starts at 0.4, seed 1 at 0.7: the start points differ more than the variants
        {"seed": 0, "runs": {"grpo": run([(0, 0.4), (20, 0.5)]), "clip_higher": run([(0, 0.4), (10, 0.6)])}},
        {"seed": 1, "runs": {"grpo": run([(0, 0.7), (20, 0.8)]), "clip_higher": run([(0, 0.7), (10, 0.8)])}},
    ]
    summary = summarize(StudyConfig(device="cpu", variants=("grpo", "clip_higher")), records)
    assert summary["targets"] == {0: 0.5, 1: 0.8}
    higher = summary["variants"]["clip_higher"]
    # gains 0.6 - 0.5 and 0.8 - 0.8; the unpaired means (0.7 vs 0.65) would say the same, their spreads would not
    assert higher["gain_over_baseline"]["mean"] == pytest.approx(0.05)
    assert (higher["gain_over_baseline"]["min"], higher["gain_over_baseline"]["max"]) == pytest.approx((0.0, 0.1))
    # seed 0 reaches its 0.5 at 5 s (halfway from 0.4 to 0.6), seed 1 its 0.8 at 10 s
    assert higher["wall_clock_to_target_s"]["mean"] == pytest.approx(7.5) and higher["reached_target"] == 2
    assert summary["variants"]["grpo"]["gain_over_baseline"]["max"] == 0.0


def test_evaluation_masks_and_bucket_means():
    completion = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    assert _first_eos_mask(completion, eos_token_id=1).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert _by_bucket([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]) == {"a": 0.5, "all": 0.75, "b": 1.0}


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
    assert "| grpo | 2 |" in stdout and "plan (estimates" in stdout
    study = json.loads((output / "ablation.json").read_text())
    assert {"date", "device", "versions", "commit", "settings", "plan", "summary", "seeds"} <= set(study)
    assert (output / "ablation.png").stat().st_size > 20_000
    summary = study["summary"]
    assert list(summary["variants"]) == [v.name for v in VARIANTS]
    assert set(summary["targets"]) == {"0", "1"} and all(0.0 <= t <= 1.0 for t in summary["targets"].values())
    # one generation batch per run: 2 prompts x 4 samples per step, 2 steps per batch
    batch = SMOKE.prompts_per_step * SMOKE.num_generations * SMOKE.steps_per_generation
    for name, variant in summary["variants"].items():
        assert variant["seeds_ok"] == 2 and variant["seeds_failed"] == 0
        for metric in ("avg@2", "greedy", "pass@2"):
            assert 0.0 <= variant["final"][metric]["min"] <= variant["final"][metric]["max"] <= 1.0
        assert variant["final"]["avg@2"]["min"] <= variant["final"]["pass@2"]["max"]
        generated = variant["generated_completions"]
        if name in ("dynamic_sampling", "dapo_paged_engine"):  # at least one round, more when groups are filtered
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
            assert {"entropy", "completions/mean_length", "study/informative_groups"} <= set(run["train"])
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
    # seed 1's recorded start point and runs are not the weights on disk: its runs did not start from them
    start1 = json.loads((runs / "seed1" / "start.json").read_text())
    for path in (runs / "seed1").glob("*.json"):
        record = json.loads(path.read_text())
        record["start_digest" if path.stem != "start" else "digest"] = "0" * 64
        path.write_text(json.dumps(record))
    stdout = run_smoke(output).stdout
    assert "[seed 0] start point in" in stdout and "[seed 0] grpo: ok" in stdout
    assert "[seed 1] 7 earlier runs did not start from these weights" in stdout
    seed0 = [line for line in stdout.splitlines() if line.startswith("[seed 0]") and ": ok in" in line]
    assert len(seed0) == 1  # the other six runs of seed 0 were kept, byte for byte
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
        f"{v.name}.json" for v in VARIANTS
    )
    assert json.loads((runs / "seed1" / "start.json").read_text())["digest"] == start1["digest"]  # the true one
    summary = json.loads((output / "ablation.json").read_text())["summary"]
    assert all(variant["seeds_ok"] == 2 for variant in summary["variants"].values())
