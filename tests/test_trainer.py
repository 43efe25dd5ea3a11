"""Real `DAPOTrainer.train()` runs on the tiny local model: generation, metrics, dynamic sampling, limits, overlong
shaping, integrity errors, PEFT, evaluation and checkpoint resume."""

import datetime
import math

import numpy as np
import pytest
import torch
from datasets import Dataset, IterableDataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import (
    Snapshots,
    arithmetic_prompts,
    dapo_args,
    first_token_parity,
    length_reward,
    teacher_forced_logprobs,
    trained_rows,
)
from trl_dapo import DAPOTrainer
from trl_dapo.data import arithmetic_dataset
from trl_dapo.evaluation import MathAccuracyCallback
from trl_dapo.integrity import RolloutIntegrityError
from trl_dapo.rewards import soft_overlong_penalty
from trl_dapo.rewards.math import dapo_math_reward
from trl_dapo.rollout_batch import OLD_LOGPROBS_STEP
from trl_dapo.sampling import DynamicSamplingLimitError, GenerationStats
from trl_dapo.testing import ScriptedRollout
from trl_dapo.trainer.collection.collect import RoundProgress
from trl_dapo.trainer.collection.round import RoundContext, RoundScores
from trl_dapo.trainer.safety.checkpoint_files import GENERATION_BATCH_FILE
from trl_dapo.trainer.safety.checkpoint_manifest import MANIFEST_FILE, write_manifest
from trl_dapo.trainer.set_up import check_datasets
from trl_dapo.trainer.trainer import SAMPLING_STATE_FILE
from trl_dapo.trainer.training.batch_metrics import trained_batch_metric_names
from trl_dapo.trainer.training.micro_batches import MicroBatch
from trl_dapo.trainer.training.step_metrics import StepMetrics

DAPO_METRICS = [
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/dual_mean",
    "ratio_mean",
    "ratio_std",
    "rollout_logprobs_mean",
    "train_logprobs_mean",
    "logprob_gap_max",
    "logprob_gap_mean",
    "rollout_kl",
    "dapo/gen_batches",
    "dapo/generated_groups",
    "dapo/qualified_groups",
    "dapo/filtered_groups",
    "dapo/sampling_efficiency",
    "dapo/solve_rate",
    "dapo/overlong_penalty_mean",
    "dapo/truncated_ratio",
]


def make_trainer(tiny_model, tmp_path, reward=length_reward, scripted=False, dataset=None, **overrides):
    settings = dict(per_device_train_batch_size=8, learning_rate=1e-3, max_steps=2)
    settings.update(overrides)
    extra = {"rollout_func": ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))} if scripted else {}
    return DAPOTrainer(
        model=tiny_model,
        reward_funcs=reward,
        args=dapo_args(tmp_path, **settings),
        train_dataset=dataset if dataset is not None else arithmetic_prompts(40),
        **extra,
    )


def logged(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def test_real_generation_trains_and_logs_finite_dapo_metrics(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path, reward=first_token_parity, steps_per_generation=2, max_steps=4)
    trainer.train()
    for name in DAPO_METRICS:
        values = logged(trainer, name)
        assert values and all(math.isfinite(v) for v in values), name
    # the first micro-batch of a generation batch is on-policy; the second runs after an update: ratio moves off 1
    assert max(logged(trainer, "ratio_std")) > 0
    assert max(logged(trainer, "logprob_gap_max")) > 0
    assert min(logged(trainer, "logprob_gap_max")) < 1e-4  # rollout and training forward agree before updates


def test_dynamic_sampling_filters_then_retries(tiny_model, tmp_path, caplog):
    calls = []

    def all_equal_first(completion_ids, **kwargs):
        calls.append(len(completion_ids))
        if len(calls) == 1:
            return [1.0] * len(completion_ids)  # every group all-correct: nothing to learn from
        return [float(len(ids) % 2) for ids in completion_ids]

    trainer = make_trainer(tiny_model, tmp_path, reward=all_equal_first, scripted=True, max_steps=1)
    with caplog.at_level("INFO", logger="trl_dapo"):
        trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["dapo/gen_batches"] >= 2
    assert metrics["dapo/filtered_groups_all_correct"] >= 2  # the whole first round
    assert metrics["dapo/qualified_groups"] >= 2
    assert calls[0] == 8 and len(calls) == metrics["dapo/gen_batches"]
    # every extra round is visible
    assert "Dynamic sampling round 2: 0 of 2 informative groups found so far, generating 2 candidate groups." in (
        caplog.text
    )
    assert caplog.text.count("Dynamic sampling round") == metrics["dapo/gen_batches"] - 1


def test_extra_rounds_show_a_progress_bar(capsys):
    with RoundProgress(enabled=True) as progress:
        progress(1, 4, 3, 8)
    assert "dynamic sampling" in capsys.readouterr().err


def test_limit_raises_a_clear_error(tiny_model, tmp_path):
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=constant_reward,
        max_num_gen_batches=3,
        dynamic_sampling_on_limit="raise",
    )
    with pytest.raises(DynamicSamplingLimitError, match=r"3 candidate generation rounds .* found 0 of the 2"):
        trainer.train()


def constant_reward(completion_ids, **kwargs) -> list[float]:
    return [0.0] * len(completion_ids)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_step_without_informative_groups_is_skipped(tiny_model, tmp_path, caplog, num_iterations):
    """The default train_on_partial: the first generation batch trains; the second finds no informative group in
    its rounds, and each of its optimizer steps (num_iterations of them) must leave the parameters and AdamW's
    moments untouched (a zero-gradient step would still move them: weight decay and momentum), while the step
    counter advances and dapo/skipped_steps counts them."""

    def varied_then_constant(completion_ids, trainer_state, **kwargs):
        return (
            first_token_parity(completion_ids) if trainer_state.global_step == 0 else constant_reward(completion_ids)
        )

    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=varied_then_constant,
        optim="adamw_torch",
        weight_decay=0.1,
        max_num_gen_batches=2,
        num_iterations=num_iterations,
        max_steps=2 * num_iterations,
    )
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    with caplog.at_level("WARNING", logger="trl_dapo"):
        trainer.train()
    assert trainer.state.global_step == 2 * num_iterations
    trained, skipped = snapshots.steps[num_iterations - 1], snapshots.steps[num_iterations:]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert any(not torch.equal(trained[0][n], initial[n]) for n in trained[0])  # the first batch trained
    assert trained[1]
    for parameters, moments in skipped:
        assert all(torch.equal(parameters[name], value) for name, value in trained[0].items())
        assert all(torch.equal(moments[key], value) for key, value in trained[1].items())
    # a running count, logged with every step as it stands (TRL's metrics are averaged over the logging window)
    assert logged(trainer, "dapo/skipped_steps") == [0.0] * num_iterations + list(range(1, num_iterations + 1))
    assert logged(trainer, "dapo/qualified_groups")[1] == 0 and logged(trainer, "dapo/gen_batches")[1] == 2
    assert (
        f"{num_iterations} of the {num_iterations} optimizer steps of this generation batch have no rollout rows"
        in caplog.text
    )


def test_unlimited_rounds_stop_after_a_full_pass_over_the_prompts(tiny_model, tmp_path):
    trainer = make_trainer(
        tiny_model, tmp_path, reward=constant_reward, max_num_gen_batches=0, dataset=arithmetic_prompts(8)
    )
    with pytest.raises(DynamicSamplingLimitError, match="at least 8 groups in a row, as many as train_dataset has"):
        trainer.train()


def test_unlimited_rounds_over_a_stream_stop_once_its_size_is_known(tiny_model, tmp_path):
    """A stream's size is unknown until its first pass ends, which happens during the rounds: the search must stop
    then (8 prompts, 2 groups a round: about 5 rounds), not loop forever. The reward fails the test past 20 rounds."""
    rounds = []

    def constant_for_20_rounds(completion_ids, **kwargs):
        rounds.append(len(completion_ids))
        assert len(rounds) <= 20, "dynamic sampling still going after 20 rounds over a stream of 8 prompts"
        return constant_reward(completion_ids)

    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=constant_for_20_rounds,
        max_num_gen_batches=0,
        dataset=arithmetic_prompts(8).to_iterable_dataset(),
    )
    with pytest.raises(DynamicSamplingLimitError, match="at least 8 groups in a row, as many as train_dataset has"):
        trainer.train()
    # the dataloader's 2 prompts, then 2 a round from the stream: its 9th draw (round 5) ends its first pass, and
    # by then 12 groups in a row were uninformative
    assert len(rounds) == 6


def test_train_on_partial_uses_the_groups_found_and_their_token_count(tiny_model, tmp_path):
    def one_prompt_informative(completion_ids, index, **kwargs):
        return [float(len(c) % 2) if i == 3 else 0.0 for c, i in zip(completion_ids, index, strict=True)]

    dataset = arithmetic_prompts(4)
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=one_prompt_informative,
        scripted=True,
        dataset=dataset,
        per_device_train_batch_size=16,
        max_num_gen_batches=1,
        dynamic_sampling_on_limit="train_on_partial",
        max_steps=1,
    )
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["dapo/partial_batch"] == 1.0 and metrics["dapo/qualified_groups"] == 1
    (micro_batch,) = trainer._buffered_inputs
    rows = trained_rows(trainer)
    assert rows["completion_ids"].size(0) == 4  # one group, not padded up to four
    assert int(micro_batch.step_tokens) == int(rows["completion_mask"].sum())


def test_overlong_penalty_enters_the_reward_before_advantages(tiny_model, tmp_path):
    trainer = make_trainer(
        tiny_model, tmp_path, scripted=True, dynamic_sampling=False, overlong_buffer_len=4, max_steps=1
    )
    trainer.train()
    batch = trained_rows(trainer)
    lengths = batch["completion_mask"].sum(dim=1)
    penalty = soft_overlong_penalty(lengths, 8, 4)
    assert logged(trainer, "dapo/overlong_penalty_mean")[0] == pytest.approx(penalty.mean().item(), abs=1e-6)
    assert penalty.min() < 0  # the scripted lengths reach into the buffer
    # rows of one prompt: advantage = (r - mean) / (std + 1e-4) with r = task reward + penalty
    prompts = [tuple(p.tolist()) for p in batch["prompt_ids"]]
    for prompt in set(prompts):
        rows = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
        reward = (lengths[rows] % 2).float() + penalty[rows]
        expected = (reward - reward.mean()) / (reward.std() + 1e-4)
        torch.testing.assert_close(batch["advantages"][rows], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("reward", "error", "message"),
    [
        (lambda completion_ids, **kw: [None] * len(completion_ids), RolloutIntegrityError, "got no reward"),
        (lambda completion_ids, **kw: [math.inf] * len(completion_ids), RolloutIntegrityError, "returned inf"),
        (lambda completion_ids, **kw: [1.0], ValueError, "returned 1 rewards"),
        # finite, but the group's standard deviation squares them past float32: every advantage would be 0
        (
            lambda completion_ids, **kw: [1e20 * (j % 2) for j in range(len(completion_ids))],
            RolloutIntegrityError,
            r"returned 1e\+20 for completion 1; rewards beyond ±1e\+15",
        ),
        # past float64: TRL's cast raised an OverflowError naming no function
        (
            lambda completion_ids, **kw: [10**400 * (j % 2) for j in range(len(completion_ids))],
            RolloutIntegrityError,
            r"'<lambda>' returned 1.000e\+400 for completion 1; rewards beyond ±1e\+15",
        ),
        # float32 rounds it to 1e15 itself: compared after the cast, it passed
        (
            lambda completion_ids, **kw: [1.00000001e15 * (j % 2) for j in range(len(completion_ids))],
            RolloutIntegrityError,
            r"returned 1000000010000000.0 for completion 1; rewards beyond ±1e\+15",
        ),
    ],
)
def test_bad_rewards_stop_training_with_a_clear_error(tiny_model, tmp_path, reward, error, message):
    with pytest.raises(error, match=message):
        make_trainer(tiny_model, tmp_path, reward=reward, max_steps=1).train()


def test_a_weighted_reward_beyond_the_bound_stops_training(tiny_model, tmp_path):
    def large(completion_ids, **kwargs):
        return [1e10 * (j % 2) for j in range(len(completion_ids))]

    trainer = make_trainer(tiny_model, tmp_path, reward=large, reward_weights=[1e10], max_steps=1)
    with pytest.raises(RolloutIntegrityError, match=r"completion 1's weighted reward 1e\+20 is beyond"):
        trainer.train()


def returns_a_string(completion_ids, **kwargs):
    return "1.0"


def returns_nothing(completion_ids, **kwargs):
    return None


def returns_strings(completion_ids, **kwargs):
    return ["1.0"] * len(completion_ids)


async def returns_a_string_later(completion_ids, **kwargs):
    return "1.0"


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (returns_a_string, r"reward function 'returns_a_string' returned str '1.0'; return a list with one float"),
        (returns_nothing, r"reward function 'returns_nothing' returned NoneType None; return a list with one float"),
        (returns_strings, r"reward function 'returns_strings' returned str '1.0' for completion 0; return a float"),
        (returns_a_string_later, r"reward function 'returns_a_string_later' returned str '1.0'; return a list"),
    ],
)
def test_a_reward_function_returning_no_list_of_numbers_is_named(tiny_model, tmp_path, reward, message):
    """TRL's own errors here are `too many dimensions 'str'` and `'NoneType' object is not iterable`."""
    with pytest.raises(TypeError, match=message):
        make_trainer(
            tiny_model, tmp_path, reward=[length_reward, reward], dynamic_sampling_metric="length_reward", max_steps=1
        ).train()


def test_rewards_as_numbers_of_any_kind_are_accepted(tiny_model, tmp_path):
    """Tuples, arrays, tensors, ints, bools and None (not applicable) are numbers TRL takes: they must still pass."""

    def varied(completion_ids, **kwargs):
        return tuple(len(ids) % 2 == 0 for ids in completion_ids)

    def as_array(completion_ids, **kwargs):
        return np.array([float(ids[0] % 2) if ids else 0.0 for ids in completion_ids])

    def as_tensor(completion_ids, **kwargs):
        return torch.tensor([len(ids) for ids in completion_ids])

    def sometimes(completion_ids, **kwargs):
        return [None if index % 2 else 1 for index in range(len(completion_ids))]

    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=[varied, as_array, as_tensor, sometimes],
        dynamic_sampling_metric="reward",
        max_steps=1,
    )
    trainer.train()
    assert trainer.state.global_step == 1


def test_rollout_with_missing_logprobs_is_rejected(tiny_model, tmp_path):
    rollout = ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))

    def drops_a_logprob(prompts, trainer):
        out = rollout(prompts, trainer)
        out["logprobs"][0][0] = None
        return out

    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=length_reward,
        args=dapo_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
        train_dataset=arithmetic_prompts(16),
        rollout_func=drops_a_logprob,
    )
    with pytest.raises(RolloutIntegrityError, match="old_per_token_logps: value nan at completion 0, token 0"):
        trainer.train()


def test_unknown_filter_metric_is_rejected(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_metric='accuracy' names no reward function"):
        make_trainer(tiny_model, tmp_path, dynamic_sampling_metric="accuracy")


def test_a_filter_metric_naming_two_reward_functions_is_rejected(tiny_model, tmp_path):
    twins = [lambda completion_ids, **kw: length_reward(completion_ids), lambda completion_ids, **kw: [0.0] * 8]
    with pytest.raises(
        ValueError, match=r"dynamic_sampling_metric='<lambda>' names 2 reward functions .*a `def` function"
    ):
        make_trainer(tiny_model, tmp_path, reward=twins, dynamic_sampling_metric="<lambda>")


async def async_length_reward(completion_ids, **kwargs) -> list[float]:
    return length_reward(completion_ids)


@pytest.mark.parametrize(
    ("settings", "reward", "message"),
    [
        (
            dict(dynamic_sampling_metric="accurcy"),
            length_reward,
            r"dynamic_sampling_metric='accurcy' names no reward function; use one of \['length_reward', 'overlong_pe",
        ),
        (
            dict(dynamic_sampling_mode="stream", rollout_engine="paged"),
            async_length_reward,
            "reward_funcs: 'async_length_reward' is a reward model or an async function",
        ),
        (
            dict(dynamic_sampling_mode="stream", rollout_engine="paged"),
            "some-org/a-reward-model",
            "reward_funcs: 'a-reward-model' is a reward model",
        ),
        (
            dict(dynamic_sampling_mode="stream", rollout_engine="paged", min_p=0.1),
            length_reward,
            "rollout_engine='paged' cannot be used here: min_p",
        ),
        (dict(reward_weights=[1.0, 2.0]), length_reward, r"reward_weights=\[1.0, 2.0\] has 2 weights for 1 reward"),
    ],
    ids=["filter-metric-typo", "stream-async-reward", "stream-reward-model", "paged-min-p", "reward-weights"],
)
def test_settings_are_checked_before_any_model_loads(tmp_path, settings, reward, message):
    """The model path does not exist: an error about the model would mean the settings were checked after it."""
    with pytest.raises(ValueError, match=message):
        DAPOTrainer(
            model=str(tmp_path / "no-model-here"),
            reward_funcs=reward,
            args=dapo_args(tmp_path, per_device_train_batch_size=8, **settings),
            train_dataset=arithmetic_prompts(8),
        )


class EchoEnvironment:
    """An environment whose public method TRL turns into a tool."""

    def reset(self, **kwargs) -> None:
        return None

    def echo(self, text: str) -> str:
        """Echo the text.

        Args:
            text: what to echo.
        """
        return text


@pytest.mark.parametrize("tool_source", ["tools", "environment_factory"])
def test_stream_mode_with_tools_is_refused_before_any_model_loads(tmp_path, tool_source):
    """Tools, given directly or through an environment's methods, need TRL's multi-turn loop, which the stream's
    engine does not run: refused at set-up, not found out after the model loads."""
    tools = (
        dict(tools=[EchoEnvironment().echo]) if tool_source == "tools" else dict(environment_factory=EchoEnvironment)
    )
    with pytest.raises(ValueError, match="tool calling needs TRL's multi-turn loop"):
        DAPOTrainer(
            model=str(tmp_path / "no-model-here"),
            reward_funcs=length_reward,
            args=dapo_args(
                tmp_path, per_device_train_batch_size=8, dynamic_sampling_mode="stream", rollout_engine="paged"
            ),
            train_dataset=arithmetic_prompts(8),
            **tools,
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the 'auto' engine is the paged one")
def test_stream_mode_without_cuda_needs_the_paged_engine_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_engine='auto': without a CUDA device TRL's path generates\)\. Set"):
        DAPOTrainer(
            model=str(tmp_path / "no-model-here"),
            reward_funcs=length_reward,
            args=dapo_args(tmp_path, per_device_train_batch_size=8, dynamic_sampling_mode="stream"),
            train_dataset=arithmetic_prompts(8),
        )


def always_right(completion_ids, **kwargs) -> list[float]:
    return [1.0] * len(completion_ids)


class AlternatingForEveryThirdPrompt:
    """0, 1, 0, 1 within the group of a prompt whose index is a multiple of 3 (a group is consecutive rows), 0 for
    the others; records the prompt index of every group it scores."""

    __name__ = "alternating_for_every_third_prompt"

    def __init__(self, num_generations: int) -> None:
        self.num_generations = num_generations
        self.groups: list[int] = []

    def __call__(self, completion_ids, index, **kwargs) -> list[float]:
        self.groups += index[:: self.num_generations]
        return [float(row % 2) if i % 3 == 0 else 0.0 for row, i in enumerate(index)]


@pytest.mark.parametrize(
    ("metric", "weights", "kept"),
    [("reward", None, "varied"), ("reward", [1.0, 0.0], "none"), ("always_right", None, "none")],
    ids=["total", "total-with-zero-weight", "named-function"],
)
def test_the_filter_reads_the_metric_it_is_told(tiny_model, tmp_path, metric, weights, kept):
    """The first function is constant, the second varies only in the groups of every third prompt: the total reward
    keeps exactly those groups, unless the second function weighs 0; the constant function named keeps none (no
    overlong penalty, which would join the total)."""
    varying = AlternatingForEveryThirdPrompt(num_generations=4)
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=[always_right, varying],
        scripted=True,
        overlong_buffer_len=0,
        dynamic_sampling_metric=metric,
        reward_weights=weights,
        max_num_gen_batches=3,
        max_steps=1,
    )
    trainer.train()
    varied = sum(i % 3 == 0 for i in varying.groups)
    assert 0 < varied < len(varying.groups)  # both kinds were generated
    assert logged(trainer, "dapo/generated_groups") == [len(varying.groups)]
    assert logged(trainer, "dapo/qualified_groups") == [varied if kept == "varied" else 0]
    if kept == "none":
        assert logged(trainer, "dapo/skipped_steps") == [1.0]
        return
    assert trained_rows(trainer)["advantages"].abs().sum() > 0
    # TRL's reward metrics describe the trained groups (rewards 1 + 0/1 alternating), not the candidates, where
    # (generated - varied) of the groups had zero std
    assert logged(trainer, "frac_reward_zero_std") == [0.0]
    assert logged(trainer, "reward") == [1.5] and logged(trainer, "rewards/always_right/mean") == [1.0]
    assert logged(trainer, "rewards/alternating_for_every_third_prompt/mean") == [0.5]


def test_the_filter_is_not_guessed_among_several_reward_functions(tiny_model, tmp_path):
    """Two reward functions and no `dynamic_sampling_metric`: which is the task's accuracy is not guessed from their
    order; the error names both and the settings that say it. One function (the overlong penalty aside), or dynamic
    sampling off, needs no metric."""
    with pytest.raises(ValueError, match=r"2 reward functions \(\['always_right', 'length_reward'\]\).*"
                       r"dynamic_sampling_metric='length_reward'.*'reward'.*dynamic_sampling=False"):  # fmt: skip
        make_trainer(tiny_model, tmp_path, reward=[always_right, length_reward])
    make_trainer(tiny_model, tmp_path, reward=[always_right, length_reward], dynamic_sampling=False)
    make_trainer(tiny_model, tmp_path, reward=[always_right])
    from trl_dapo.trainer.set_up import filter_column

    # TRL's overlong penalty is shaping too: the one task function is found wherever it stands
    assert filter_column(None, ["soft_overlong_punishment_reward", "accuracy", "overlong_penalty"], True) == 1


def test_rollout_metrics_describe_the_trained_groups(tiny_model, tmp_path):
    """`rollout_logprobs_mean`, `dapo/truncated_ratio` and `dapo/overlong_penalty_mean` cover the groups trained, not
    the candidate rounds: derived here from the scripted rollout's own completions for the accepted prompts."""
    varying = AlternatingForEveryThirdPrompt(num_generations=4)
    trainer = make_trainer(
        tiny_model, tmp_path, reward=varying, scripted=True, overlong_buffer_len=4, max_num_gen_batches=5, max_steps=1
    )
    trainer.train()
    assert any(i % 3 for i in varying.groups)  # some candidate groups were filtered out
    script, eos = trainer.rollout_func, trainer.processing_class.eos_token_id
    batch = trained_rows(trainer)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    rows = [script.completion(prompt, index) for prompt in prompts[::4] for index in range(4)]
    assert len(rows) == 8  # the two accepted groups
    tokens = sum(len(ids) for ids, _ in rows)
    lengths = torch.tensor([len(ids) for ids, _ in rows])
    expected = {
        "rollout_logprobs_mean": sum(sum(logps) for _, logps in rows) / tokens,
        "dapo/truncated_ratio": sum(ids[-1] != eos for ids, _ in rows) / len(rows),
        "dapo/overlong_penalty_mean": soft_overlong_penalty(lengths, 8, 4).mean().item(),
    }
    for name, value in expected.items():
        assert logged(trainer, name) == [pytest.approx(value, abs=1e-6)], name


def alternating(completion_ids, **kwargs) -> list[float]:
    """0, 1, 0, 1 down the rows: every group varies."""
    return [float(row % 2) for row in range(len(completion_ids))]


def test_trained_batch_metrics_are_trls_when_every_candidate_is_trained(tiny_model, tmp_path):
    """When the first round is accepted whole, DAPO's recomputed completion and reward metrics must equal the ones
    GRPOTrainer logs for the same scripted completions and rewards."""
    from trl import GRPOConfig, GRPOTrainer

    from helpers import CPU_ARGS

    rollout = ScriptedRollout(AutoTokenizer.from_pretrained(tiny_model))
    settings = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, max_steps=1, seed=0)
    grpo = GRPOTrainer(
        model=tiny_model,
        reward_funcs=[alternating, length_reward],
        args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **settings, **CPU_ARGS),
        train_dataset=arithmetic_prompts(40),
        rollout_func=rollout,
    )
    grpo.train()
    dapo = make_trainer(
        tiny_model,
        tmp_path / "dapo",
        reward=[alternating, length_reward],
        scripted=True,
        overlong_buffer_len=0,
        dynamic_sampling_metric="alternating",
        max_steps=1,
    )
    dapo.train()
    assert logged(dapo, "dapo/gen_batches") == [1] and logged(dapo, "dapo/filtered_groups") == [0]
    names = [n for n in grpo.state.log_history[0] if n.startswith(("completions/", "reward", "frac_reward"))]
    assert len(names) == 14 and set(names) == set(trained_batch_metric_names(grpo.reward_func_names))
    for name in names:
        assert dapo.state.log_history[0][name] == pytest.approx(grpo.state.log_history[0][name], abs=1e-6), name


@pytest.mark.parametrize(("every", "steps"), [(1, [1, 2, 3]), (2, [2, 3])])
def test_held_out_accuracy_is_logged_once_per_evaluated_step(tiny_model, tmp_path, every, steps):
    """Every `every` steps and at the end of training: a last step already evaluated is not evaluated again (the
    recipe's summary averaged the duplicate, and at 7B it cost a whole avg@32 pass)."""
    splits = arithmetic_dataset(num_train=8, num_test=2)
    trainer = make_trainer(tiny_model, tmp_path, dataset=splits["train"], max_steps=3)
    trainer.add_callback(MathAccuracyCallback(trainer, splits["test"], k=2, every=every))
    trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "eval/accuracy" in entry] == steps


def no_rows():
    yield from ()


@pytest.mark.parametrize("form", ["dataset", "stream", "dict"])
def test_an_empty_evaluation_set_is_an_error(tiny_model, tmp_path, form):
    """GRPOTrainer would evaluate on 0 prompts without a word."""
    empty = arithmetic_prompts(0)
    if form == "stream":
        eval_dataset = IterableDataset.from_generator(no_rows)
    else:
        eval_dataset = {"dataset": empty, "dict": {"held_out": empty}}[form]
    name = r"eval_dataset\['held_out'\]" if form == "dict" else "eval_dataset"
    with pytest.raises(ValueError, match=rf"{name} is empty: evaluation would run on 0 prompts"):
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=length_reward,
            args=dapo_args(tmp_path, per_device_train_batch_size=8, eval_strategy="steps", eval_steps=1),
            train_dataset=arithmetic_prompts(8),
            eval_dataset=eval_dataset,
        )
    with pytest.raises(ValueError, match="MathAccuracyCallback: the held-out dataset is empty"):
        MathAccuracyCallback(None, arithmetic_dataset(num_train=4, num_test=0)["test"])


def test_lora_and_evaluation(tiny_model, tmp_path):
    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=first_token_parity,
        args=dapo_args(
            tmp_path,
            per_device_train_batch_size=8,
            per_device_eval_batch_size=8,
            learning_rate=1e-3,
            optim="adamw_torch",
            max_steps=2,
            eval_strategy="steps",
            eval_steps=2,
        ),
        train_dataset=arithmetic_prompts(40),
        eval_dataset=arithmetic_prompts(8, offset=50),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert logged(trainer, "eval_loss")


@pytest.mark.parametrize("scripted", [True, False], ids=["scripted-rollout", "sampled-generation"])
def test_resume_gives_the_same_next_batch_and_parameters(tiny_model, tmp_path, scripted):
    # with sampled generation the checkpoint's RNG state (restored by the Trainer) must reproduce the samples too
    settings = dict(
        scripted=scripted,
        reward=length_reward if scripted else first_token_parity,
        dynamic_sampling_oversample="2.0",
        max_steps=3,
        save_strategy="steps",
        save_steps=2,
    )
    straight = make_trainer(tiny_model, tmp_path / "straight", **settings)
    straight.train()
    assert any(h.get("dapo/surplus_groups", 0) > 0 for h in straight.state.log_history[:2])

    resumed = make_trainer(tiny_model, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    for key, value in trained_rows(straight).items():
        torch.testing.assert_close(trained_rows(resumed)[key], value, msg=key)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_streaming_dataset_feeds_the_extra_rounds(tiny_model, tmp_path):
    """An IterableDataset with dynamic sampling: the first round of each step comes from the Trainer's dataloader,
    extra rounds from a stream of its own, whose position is saved with the checkpoint."""
    calls = []

    def all_equal_first(completion_ids, **kwargs):
        calls.append(len(completion_ids))
        return [1.0] * len(completion_ids) if len(calls) == 1 else length_reward(completion_ids)

    stream = arithmetic_prompts(16).to_iterable_dataset()
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        reward=all_equal_first,
        scripted=True,
        dataset=stream,
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert logged(trainer, "dapo/gen_batches")[0] >= 2 and logged(trainer, "dapo/qualified_groups")[0] >= 2
    state = torch.load(tmp_path / "checkpoint-1" / SAMPLING_STATE_FILE, weights_only=True)
    drawn = logged(trainer, "dapo/generated_groups")[0] - 2  # groups beyond the dataloader's 2
    assert state["prompt_stream"]["rows_in_epoch"] == drawn and state["prompt_stream"]["epoch"] == 0


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["plain", "mask_truncated_completions"])
def test_truncated_ratio_counts_the_completions_without_eos(tiny_model, tmp_path, mask_truncated):
    """The scripted rollout ends some completions with EOS and not others (all shorter than the limit of 8, so a
    completion is truncated exactly when it lacks EOS); masking truncated completions must not hide them."""
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        scripted=True,
        dynamic_sampling=False,
        mask_truncated_completions=mask_truncated,
        max_steps=1,
    )
    trainer.train()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = trained_rows(trainer)
    real = batch["completion_ids"] != tokenizer.pad_token_id  # scripted tokens are never the pad token
    last = batch["completion_ids"].gather(1, (real.sum(dim=1, keepdim=True) - 1))
    expected = (last.squeeze(1) != tokenizer.eos_token_id).float().mean().item()
    assert 0 < expected < 1
    assert logged(trainer, "dapo/truncated_ratio") == [pytest.approx(expected)]


def test_the_callers_reward_lists_are_left_alone(tiny_model, tmp_path):
    reward_funcs, processing_classes = [length_reward, first_token_parity], [None, None]
    trainer = DAPOTrainer(
        model=tiny_model,
        reward_funcs=reward_funcs,
        reward_processing_classes=processing_classes,
        args=dapo_args(tmp_path, per_device_train_batch_size=8, dynamic_sampling_metric="length_reward"),
        train_dataset=arithmetic_prompts(8),
    )
    assert trainer.reward_func_names == ["length_reward", "first_token_parity", "overlong_penalty"]
    assert reward_funcs == [length_reward, first_token_parity] and processing_classes == [None, None]


@pytest.mark.parametrize("which", ["train_dataset", "eval_dataset"])
def test_a_missing_prompt_column_is_named_when_the_trainer_is_built(tiny_model, tmp_path, which):
    datasets = {"train_dataset": arithmetic_prompts(8), "eval_dataset": arithmetic_prompts(8)}
    datasets[which] = datasets[which].rename_column("prompt", "question")
    with pytest.raises(ValueError, match=rf"{which} has no 'prompt' column \(columns: \['question', 'index'\]\)"):
        DAPOTrainer(
            model=tiny_model,
            reward_funcs=length_reward,
            args=dapo_args(tmp_path, per_device_train_batch_size=8),
            **datasets,
        )


def test_one_prompt_is_a_prompt(tmp_path):
    args = dapo_args(tmp_path, per_device_train_batch_size=8)
    with pytest.raises(
        ValueError, match=r"train_dataset has 1 prompt, fewer than one generation batch takes: 2 prompts"
    ):
        check_datasets(args, arithmetic_prompts(1), None, processes=1, prompts_from_environment=False)


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_a_run_that_would_train_zero_steps_is_an_error(tiny_model, tmp_path, streaming):
    dataset = arithmetic_prompts(3)  # one generation batch = 16 rows / 4 samples = 4 prompts
    with pytest.raises(ValueError, match=r"train_dataset has 3 prompts, fewer than one generation batch takes: 4 "):
        make_trainer(
            tiny_model,
            tmp_path,
            dataset=dataset.to_iterable_dataset() if streaming else dataset,
            per_device_train_batch_size=16,
        )


def test_fp16_cannot_skip_a_step_and_says_so(tiny_model, tmp_path):
    """torch's GradScaler asserts on an optimizer step without gradients; a skipped step under fp16 must say why
    (fp16 needs a GPU, so the scaler is set by hand on the CPU trainer)."""
    trainer = make_trainer(tiny_model, tmp_path)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    no_rows = torch.zeros(0, 3, dtype=torch.long)
    empty = {"prompt_ids": no_rows, "prompt_mask": no_rows, "completion_ids": no_rows, "completion_mask": no_rows}
    with pytest.raises(ValueError, match="fp16's gradient scaler cannot step without gradients"):
        trainer.passes.micro_batches(empty)


def test_a_round_context_takes_its_generations_then_one_scoring():
    """The order of TRL's hooks within one round is what DAPOTrainer relies on: the engine's (or the stream's) rows
    are the round's one generation; TRL's path may generate again (a tool-calling turn); every generation comes before
    the one scoring. Anything else is an error rather than a stale read."""
    scores = RoundScores(torch.zeros(2, 1), torch.ones(2), torch.zeros(2, dtype=torch.bool))
    context = RoundContext()
    counts = GenerationStats(busy_slot_steps=4, pool_slot_steps=5, prefill_tokens=6)
    context.record_generation(torch.zeros(2, 3), counts)
    with pytest.raises(RuntimeError, match="generated twice within one round"):
        context.record_generation(torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="after the rollout engine's"):
        context.record_trl_generation()
    context.record_scores(scores)
    with pytest.raises(RuntimeError, match="scored a round twice"):
        context.record_scores(scores)
    assert context.generation is counts and context.scores is scores
    turns = RoundContext()  # TRL's path with tools: a generation per turn, then the scoring
    turns.record_trl_generation()
    turns.record_trl_generation()
    with pytest.raises(RuntimeError, match="generated twice within one round"):
        turns.record_generation(torch.zeros(2, 3))
    turns.record_scores(scores)
    with pytest.raises(RuntimeError, match="after scoring the round"):
        turns.record_trl_generation()
    assert turns.generations == 2
    scored_first = RoundContext()  # a rollout_func generates without the hook: scoring alone is seen
    scored_first.record_scores(scores)
    with pytest.raises(RuntimeError, match="or after scoring it"):
        scored_first.record_generation(torch.zeros(2, 3))


def hand_weights(mode, log_rho, mask):
    """The correction weights and the tokens they cap or mask, as the docs define them: TIS capped at 1.1; a
    sequence's geometric-mean ratio kept inside [1/1.05, 1.05], its tokens dropped outside."""
    if mode == "token_truncate":
        return log_rho.exp().clamp(max=1.1) * mask, (log_rho.exp() > 1.1) * mask
    geometric = ((log_rho * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True)).exp()
    kept = (geometric >= 1 / 1.05) & (geometric <= 1.05)
    return geometric * kept * mask, ~kept * mask


@pytest.mark.parametrize(("mode", "cap"), [("token_truncate", 1.1), ("sequence_mask", 1.05)])
def test_the_recomputed_old_policy_and_its_correction_reach_the_loss(tiny_model, tmp_path, mode, cap):
    """A scripted rollout's logprobs (-5.9 +- 0.25) are not the model's. With old_logprobs='recompute' the old policy
    must be the model's own logprobs (the ratio of the single update is then 1), the rollout's kept apart, and the loss
    -Σ w·A / N with the weights of the correction, which must differ from the uncorrected -Σ A / N."""
    trainer = make_trainer(
        tiny_model, tmp_path, scripted=True, dynamic_sampling=False, overlong_buffer_len=0, max_steps=1,
        old_logprobs="recompute", rollout_correction=mode, rollout_correction_max=cap,
    )  # fmt: skip
    trainer.train()
    batch = trained_rows(trainer)
    mask = batch["completion_mask"].float()
    old, sampled = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.testing.assert_close(old * mask, teacher_forced_logprobs(model, batch) * mask, atol=1e-5, rtol=1e-5)
    scripted_values = -5.9 + torch.arange(-5, 6) / 20
    assert ((sampled.unsqueeze(-1) - scripted_values).abs().min(dim=-1).values * mask).max() < 1e-6
    weights, corrected = hand_weights(mode, old - sampled, mask)
    assert 0 < corrected.sum() < mask.sum()  # the correction acts on some tokens, not all
    advantages = batch["advantages"].unsqueeze(1)
    expected, uncorrected = (-(weights * advantages).sum() / mask.sum()), (-(advantages * mask).sum() / mask.sum())
    (metrics,) = [h for h in trainer.state.log_history if "loss" in h]
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert abs(expected - uncorrected) > 1e-3
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["ratio_std"] < 1e-5
    assert metrics["rollout_correction/token_fraction"] == pytest.approx((corrected.sum() / mask.sum()).item())
    assert metrics["old_logprob_gap_mean"] == pytest.approx(((old - sampled).abs().sum() / mask.sum()).item())


def test_recompute_reuses_trls_pass_and_refreshes_surplus_rows(tiny_model, tmp_path):
    """steps_per_generation 2 > gradient_accumulation_steps 1: TRL runs its own old-logprob pass on each round. The
    first round (8 informative groups for 4 wanted) must take TRL's pass as its old policy with no second pass; the
    next generation batch is the 4 surplus groups, whose old policy must be recomputed, under the weights after the
    two updates in between, and nothing else."""
    no_grad_calls = []
    trainer = make_trainer(
        tiny_model, tmp_path, reward=alternating, scripted=True, overlong_buffer_len=0, steps_per_generation=2,
        dynamic_sampling_oversample="2.0", max_steps=3, old_logprobs="recompute",
    )  # fmt: skip
    forward = trainer.passes.logprobs

    def counted(model, input_ids, *args, **kwargs):
        if not torch.is_grad_enabled():
            no_grad_calls.append((trainer.state.global_step, input_ids.size(0)))
        return forward(model, input_ids, *args, **kwargs)

    trainer.passes.logprobs = counted
    snapshots = Snapshots()
    trainer.add_callback(snapshots)
    trainer.train()
    assert logged(trainer, "dapo/surplus_groups_used") == [0, 4]
    # TRL's pass over the round; ours over the surplus rows only: the two steps' passes of 8 rows
    assert no_grad_calls == [(0, 32), (2, 8), (2, 8)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.load_state_dict(snapshots.steps[1][0], strict=False)  # the weights after two updates
    for micro_batch in trainer._buffered_inputs:
        batch = trained_rows(trainer, [micro_batch])
        mask = batch["completion_mask"].float()
        expected = teacher_forced_logprobs(model, batch) * mask
        torch.testing.assert_close(batch["old_per_token_logps"] * mask, expected, atol=1e-5, rtol=1e-5)


def test_every_rank_runs_each_recompute_pass_some_rank_needs(tiny_model, tmp_path, monkeypatch):
    """A sharded model (ZeRO-3, FSDP) gathers weights in each forward with every rank taking part, so a rank runs every
    pass that holds a stale row on any rank (emulated by the max reduction), its empty passes' stand-in rows included:
    its own stale rows are recomputed, its other rows computed and their logprobs kept."""
    trainer = make_trainer(
        tiny_model, tmp_path, scripted=True, dynamic_sampling=False, max_steps=1, old_logprobs="recompute",
        per_device_train_batch_size=8, gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer.train()
    batch = trained_rows(trainer)
    mask = batch["completion_mask"].float()
    step = trainer.state.global_step
    kept = torch.full_like(mask, -1.0) * mask  # a value no forward pass gives, on the rows that keep theirs
    first = {key: value[:4].clone() for key, value in batch.items()}
    second = {key: value[4:8].clone() for key, value in batch.items()}
    first.update(old_per_token_logps=kept[:4], **{OLD_LOGPROBS_STEP: torch.tensor([step, -1, -1, step])})
    second.update(old_per_token_logps=kept[4:8], **{OLD_LOGPROBS_STEP: torch.tensor([step] * 4)})
    stand_in = {key: value[:1].clone() for key, value in batch.items()}
    stand_in.update(old_per_token_logps=kept[:1], **{OLD_LOGPROBS_STEP: torch.tensor([step])})
    one = batch["advantages"].new_ones(())
    micro_batches = [
        MicroBatch([first, stand_in], [False, True], one, 3, StepMetrics(), False),
        MicroBatch([second], [False], one, 3, StepMetrics(), True),
    ]
    forwarded = []
    forward = trainer.passes.logprobs

    def counted(model, input_ids, *args, **kwargs):
        forwarded.append(input_ids.size(0))
        return forward(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(trainer.passes, "logprobs", counted)
    monkeypatch.setattr(trainer.accelerator, "reduce", lambda tensor, reduction: torch.ones_like(tensor))
    trainer.passes._with_old_policy(micro_batches)
    assert forwarded == [4, 1, 4]  # the first pass, the stand-in row, the second pass (stale on another rank)
    expected = teacher_forced_logprobs(trainer.model, batch) * mask
    old = torch.cat([first["old_per_token_logps"], second["old_per_token_logps"]])
    torch.testing.assert_close(old[1:3], expected[1:3], atol=1e-5, rtol=1e-5)
    assert torch.equal(old[[0, 3, 4, 5, 6, 7]], kept[[0, 3, 4, 5, 6, 7]])


def test_a_run_resumed_inside_a_generation_batch_equals_the_uninterrupted_run(tiny_model, tmp_path):
    """Two optimizer steps per generation batch (4 micro-batches, GA 2), a checkpoint after each step: resumed from
    the one inside the first batch, the run trains that batch's last two micro-batches as saved, then generates the
    next batch where the uninterrupted run did (sampled generation: the checkpoint's RNG state reproduces it)."""
    settings = dict(
        reward=first_token_parity,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
    )
    straight = make_trainer(tiny_model, tmp_path / "straight", **settings)
    straight.train()
    saved = [
        step
        for step in range(1, 5)
        if (tmp_path / "straight" / f"checkpoint-{step}" / "dapo_generation_batch_0.pt").exists()
    ]
    assert saved == [1, 3] and GENERATION_BATCH_FILE.format(rank=0) == "dapo_generation_batch_0.pt"

    resumed = make_trainer(tiny_model, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))
    losses = [[h["loss"] for h in trainer.state.log_history if "loss" in h] for trainer in (straight, resumed)]
    assert len(losses[0]) == 4 and losses[1] == losses[0]  # step 1 from the checkpoint's log, then 2, 3 and 4
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
        lambda path: torch.save({"buffer": datetime.date(2026, 1, 1)}, path),  # not plain tensors and values
    ],
    ids=["truncated", "foreign"],
)
def test_an_unreadable_checkpoint_file_is_named_with_the_ways_to_go_on(tiny_model, tmp_path, damage):
    """torch's own error for these advises `weights_only=False`, which runs whatever the file holds: the error names
    the file and the checkpoint, says it cannot be read and how to resume without it, and shows nothing of torch's.
    The manifest is written again after each damage: a file it vouches for that cannot be read all the same (one
    above its checksum limit damaged in place, or a checkpoint saved before manifests)."""
    settings = dict(
        scripted=True, gradient_accumulation_steps=2, steps_per_generation=4, max_steps=1, save_strategy="steps"
    )
    make_trainer(tiny_model, tmp_path / "saved", save_steps=1, **settings).train()
    checkpoint = tmp_path / "saved" / "checkpoint-1"
    for name, way_on in [
        (SAMPLING_STATE_FILE, "Resume from an earlier checkpoint of this run, or start a new run from this"),
        ("dapo_generation_batch_0.pt", "Delete it to resume with a new generation batch drawn at this step"),
    ]:
        original = (checkpoint / name).read_bytes()
        damage(checkpoint / name)
        write_manifest(checkpoint)
        resumed = make_trainer(tiny_model, tmp_path / "resumed", **{**settings, "max_steps": 2})
        with pytest.raises(RuntimeError) as error:
            resumed.train(resume_from_checkpoint=str(checkpoint))
        message = str(error.value)
        assert message.startswith(f"{name} of resume_from_checkpoint={str(checkpoint)!r} cannot be read (")
        assert way_on in message and "weights_only" not in message and error.value.__suppress_context__
        (checkpoint / name).write_bytes(original)
        write_manifest(checkpoint)


def test_resuming_a_checkpoint_without_the_sampling_state_is_refused_with_dynamic_sampling(tiny_model, tmp_path):
    """A checkpoint without the sampling state (a GRPOTrainer's, which has no manifest either) would restart the
    surplus, the extra-prompt stream and the skipped-step count from zero: refused before training with dynamic
    sampling, which keeps them; resumed without it, which has none."""
    settings = dict(scripted=True, max_steps=1, save_strategy="steps", save_steps=1)
    make_trainer(tiny_model, tmp_path / "saved", **settings).train()
    checkpoint = tmp_path / "saved" / "checkpoint-1"
    (checkpoint / SAMPLING_STATE_FILE).unlink()
    (checkpoint / MANIFEST_FILE).unlink()
    resumed = make_trainer(tiny_model, tmp_path / "resumed", **settings)
    with pytest.raises(
        FileNotFoundError,
        match=rf"has no {SAMPLING_STATE_FILE} .*dynamic_sampling=False and partial_rollouts=False\.$",
    ):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    plain = make_trainer(tiny_model, tmp_path / "plain", dynamic_sampling=False, **{**settings, "max_steps": 2})
    plain.train(resume_from_checkpoint=str(checkpoint))
    assert plain.state.global_step == 2  # step 1 from the checkpoint, then one more


@pytest.mark.parametrize("blank", ["", "   ", None])
def test_an_empty_or_missing_prompt_is_named_by_its_row_at_set_up(tiny_model, tmp_path, blank):
    prompts = [f"What is {i} + 1?" for i in range(8)]
    prompts[5] = blank
    dataset = Dataset.from_dict({"prompt": prompts})
    with pytest.raises(ValueError, match=rf"train_dataset row 5 has no prompt \({blank!r}\)"):
        make_trainer(tiny_model, tmp_path, dataset=dataset)


def test_a_reward_function_requiring_a_missing_column_is_named_at_set_up(tiny_model, tmp_path):
    """`dapo_math_reward` reads the `answer` column: without one, its first call raised a bare `TypeError`, after the
    model had loaded and generated. A parameter with a default, or `**kwargs`, requires no column."""

    def with_defaults(completions, answer=None, **kwargs):
        return [0.0] * len(completions)

    prompts = arithmetic_prompts(8)
    with pytest.raises(
        ValueError,
        match=r"reward function 'dapo_math_reward' requires 'answer', which TRL passes from the dataset column of "
        r"that name, but train_dataset has no such column \(columns: \['prompt', 'index'\]\)",
    ):
        make_trainer(
            tiny_model,
            tmp_path,
            reward=[with_defaults, dapo_math_reward],
            dataset=prompts,
            dynamic_sampling_metric="dapo_math_reward",
        )
    with_answers = prompts.add_column("answer", ["2"] * len(prompts))
    make_trainer(
        tiny_model,
        tmp_path,
        reward=[with_defaults, dapo_math_reward],
        dataset=with_answers,
        dynamic_sampling_metric="dapo_math_reward",
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_a_bytes_prompt_is_named_before_tokenization(tiny_model, tmp_path, streaming):
    """It failed inside the tokenizer naming no row; a stream's rows are checked per batch, by position."""
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + 1?".encode() for i in range(8)]})
    where = r"prompt \d of this batch" if streaming else r"train_dataset row 0 \(and 7 more\): its prompt"
    message = rf"{where} is bytes \(b'What is \d \+ 1\?'\): decode it first"
    with pytest.raises(ValueError, match=message):
        dataset = dataset.to_iterable_dataset() if streaming else dataset
        make_trainer(tiny_model, tmp_path, dataset=dataset, max_steps=1, dynamic_sampling=False).train()


@pytest.mark.parametrize(
    ("settings", "words", "limit"),
    [
        (dict(max_prompt_length=40), 20, r"40 \(max_prompt_length\)"),
        # unset: the model's context (2,048 positions) less max_completion_length (8)
        ({}, 800, r"2040 \(the model's 2048 positions less max_completion_length 8"),
    ],
)
def test_a_prompt_longer_than_the_limit_is_named_before_generation(tiny_model, tmp_path, settings, words, limit):
    long_prompt = [{"role": "user", "content": "What is " + " + ".join(["1"] * words) + "?"}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    length = len(tokenizer.apply_chat_template(long_prompt, add_generation_prompt=True, return_dict=True)["input_ids"])
    dataset = Dataset.from_dict({"prompt": [long_prompt, *arithmetic_prompts(8)["prompt"][1:]]})
    trainer = make_trainer(tiny_model, tmp_path, dataset=dataset, max_steps=1, dynamic_sampling=False, **settings)
    with pytest.raises(ValueError, match=rf"prompt \d of this batch \('What is 1 \+ 1 \+ .* has {length} tokens, more "
                       rf"than the limit of {limit}"):  # fmt: skip
        trainer.train()


def test_an_output_dir_that_cannot_be_written_is_named_before_training(tiny_model, tmp_path):
    """It failed at the first save, after the steps before it had run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"DAPOConfig.output_dir='.*a-file/out' cannot be written: .* save_strategy"):
        make_trainer(tiny_model, blocker / "out", save_strategy="steps", save_steps=1)
