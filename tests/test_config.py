"""DAPOConfig defaults and every validation error (each names the field)."""

import pytest
from trl import GRPOConfig

from trl_dapo import DAPOConfig

BASE = dict(output_dir="unused", use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=16)


def make(**overrides) -> DAPOConfig:
    return DAPOConfig(**{**BASE, **overrides})


def test_dapo_defaults():
    config = make(max_completion_length=20480)
    assert isinstance(config, GRPOConfig)
    assert (config.epsilon, config.epsilon_high, config.beta, config.loss_type) == (0.2, 0.28, 0.0, "dapo")
    assert config.num_generations == 16 and config.clip_ratio_c == 10.0
    assert config.dynamic_sampling and config.max_num_gen_batches == 10
    assert config.overlong_buffer_len == 4096 and config.overlong_penalty_factor == 1.0
    assert config.mask_truncated_completions is False
    assert config.max_surplus_age == 1  # one generation batch = one optimizer step by default


def test_surplus_age_defaults_to_one_generation_batch():
    config = make(per_device_train_batch_size=16, gradient_accumulation_steps=2, steps_per_generation=8)
    assert config.max_surplus_age == 4


def test_oversample_accepts_auto_and_numbers():
    assert make(dynamic_sampling_oversample="AUTO").dynamic_sampling_oversample == "auto"
    assert make(dynamic_sampling_oversample=2).dynamic_sampling_oversample == "2.0"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(epsilon=-0.1), "epsilon="),
        (dict(epsilon=1.0), "epsilon="),
        (dict(epsilon_high=-0.1), "epsilon_high="),
        (dict(epsilon_high=0.1), "epsilon_high="),
        (dict(num_generations=1), "num_generations="),
        (dict(loss_type="grpo"), "loss_type="),
        (dict(beta=0.04), "beta="),
        (dict(clip_ratio_c=1.0), "clip_ratio_c="),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level="),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile="),
        (dict(entropy_coef=0.01), "entropy_coef="),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold="),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy="),
        (dict(max_num_gen_batches=-1), "max_num_gen_batches="),
        (dict(dynamic_sampling_on_limit="skip"), "dynamic_sampling_on_limit="),
        (dict(max_surplus_age=-1), "max_surplus_age="),
        (dict(scale_rewards="batch"), "scale_rewards="),
        (dict(dynamic_sampling_oversample="lots"), "dynamic_sampling_oversample="),
        (dict(dynamic_sampling_oversample="0.5"), "dynamic_sampling_oversample="),
        (dict(dynamic_sampling_max_oversample=0.5), "dynamic_sampling_max_oversample="),
        (dict(overlong_penalty_factor=-1.0), "overlong_penalty_factor="),
        (dict(overlong_buffer_len=512, max_completion_length=512), "overlong_buffer_len="),
        (dict(overlong_buffer_len=-1), "overlong_buffer_len="),
        (
            dict(gradient_accumulation_steps=2, steps_per_generation=3, per_device_train_batch_size=16),
            "steps_per_generation=",
        ),
    ],
)
def test_invalid_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"DAPOConfig.{field}"):
        make(**overrides)


def test_batch_scaled_rewards_are_fine_without_dynamic_sampling():
    assert make(scale_rewards="batch", dynamic_sampling=False).scale_rewards == "batch"
