"""Real `DAPOTrainer.train()` runs on the tiny local model: generation, metrics, dynamic sampling, limits, overlong
shaping, integrity errors, PEFT, evaluation and checkpoint resume."""

import math

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer

from helpers import arithmetic_prompts, dapo_args, first_token_parity, length_reward
from trl_dapo import DAPOTrainer
from trl_dapo.integrity import RolloutIntegrityError
from trl_dapo.rewards import soft_overlong_penalty
from trl_dapo.sampling import DynamicSamplingLimitError
from trl_dapo.testing import ScriptedRollout

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


def test_dynamic_sampling_filters_then_retries(tiny_model, tmp_path):
    calls = []

    def all_equal_first(completion_ids, **kwargs):
        calls.append(len(completion_ids))
        if len(calls) == 1:
            return [1.0] * len(completion_ids)  # every group all-correct: nothing to learn from
        return [float(len(ids) % 2) for ids in completion_ids]

    trainer = make_trainer(tiny_model, tmp_path, reward=all_equal_first, scripted=True, max_steps=1)
    trainer.train()
    metrics = trainer.state.log_history[0]
    assert metrics["dapo/gen_batches"] >= 2
    assert metrics["dapo/filtered_groups_all_correct"] >= 2  # the whole first round
    assert metrics["dapo/qualified_groups"] >= 2
    assert calls[0] == 8 and len(calls) == metrics["dapo/gen_batches"]


def test_limit_raises_a_clear_error(tiny_model, tmp_path):
    trainer = make_trainer(
        tiny_model, tmp_path, reward=lambda completion_ids, **kw: [0.0] * len(completion_ids), max_num_gen_batches=3
    )
    with pytest.raises(DynamicSamplingLimitError, match=r"3 candidate generation rounds .* found 0 of the 2"):
        trainer.train()


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
    assert micro_batch["completion_ids"].size(0) == 4  # one group, not padded up to four
    assert int(micro_batch["num_items_in_batch"]) == int(micro_batch["completion_mask"].sum())


def test_overlong_penalty_enters_the_reward_before_advantages(tiny_model, tmp_path):
    trainer = make_trainer(
        tiny_model, tmp_path, scripted=True, dynamic_sampling=False, overlong_buffer_len=4, max_steps=1
    )
    trainer.train()
    (batch,) = trainer._buffered_inputs
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
    ],
)
def test_bad_rewards_stop_training_with_a_clear_error(tiny_model, tmp_path, reward, error, message):
    with pytest.raises(error, match=message):
        make_trainer(tiny_model, tmp_path, reward=reward, max_steps=1).train()


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


def test_filter_on_the_total_reward(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path, scripted=True, dynamic_sampling_metric="reward", max_steps=1)
    trainer.train()
    assert logged(trainer, "dapo/qualified_groups")[0] >= 2


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
    for key, value in straight._buffered_inputs[0].items():
        torch.testing.assert_close(resumed._buffered_inputs[0][key], value, msg=key)
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_streaming_dataset_needs_dynamic_sampling_off(tiny_model, tmp_path):
    stream = arithmetic_prompts(16).to_iterable_dataset()
    with pytest.raises(ValueError, match="train_dataset: dynamic sampling draws extra prompts by index"):
        make_trainer(tiny_model, tmp_path, dataset=stream)
    trainer = make_trainer(tiny_model, tmp_path, dataset=stream, dynamic_sampling=False, max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1
