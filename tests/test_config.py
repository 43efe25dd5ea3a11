"""DAPOConfig defaults and every validation error (each names the field)."""

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from transformers import TrainingArguments
from trl import GRPOConfig

from trl_dapo import DAPOConfig
from trl_dapo.trainer.configuration import grpo_fields
from trl_dapo.trainer.configuration.field_rules import FIELD_RULES
from trl_dapo.trainer.configuration.grpo_fields import (
    GENERIC_REASON,
    HONOURED_FIELDS,
    REASONS,
    grpo_only_fields,
    unhonoured_settings,
)

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
    assert config.dynamic_sampling_on_limit == "train_on_partial"
    assert config.partial_rollouts is False  # off until the ablation measures its effect on learning


def test_the_bare_config_works_on_one_process():
    """`DAPOConfig(output_dir=...)` as the README prints it: 16 completions per device = one group of 16."""
    config = DAPOConfig(output_dir="unused")
    assert (config.num_generations, config.per_device_train_batch_size) == (16, 16)
    assert (config.generation_batch_size, config.steps_per_generation) == (16, 1)


def test_a_batch_of_partial_groups_names_the_fields_to_change():
    with pytest.raises(
        ValueError, match=r"DAPOConfig.per_device_train_batch_size=8 is invalid: .* = 8 completions"
    ) as error:
        make(per_device_train_batch_size=8)
    message = str(error.value)
    assert "per_device_train_batch_size to a multiple of 16" in message
    assert "steps_per_generation to a multiple of 2" in message  # 8 x 1 x 2 = 16
    assert make(per_device_train_batch_size=8, steps_per_generation=2).generation_batch_size == 16
    with pytest.raises(
        ValueError, match=r"DAPOConfig.generation_batch_size=24 is invalid: use a multiple of .* \(16\)"
    ):
        make(per_device_train_batch_size=8, generation_batch_size=24)
    with pytest.raises(ValueError, match=r"DAPOConfig.per_device_eval_batch_size=8 is invalid: .* multiple of 16"):
        make(per_device_eval_batch_size=8, eval_strategy="steps")


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
        (dict(delta=2.0), "delta="),
        (dict(vllm_importance_sampling_correction=True), "vllm_importance_sampling_correction="),
        (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation="),
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
        (dict(rollout_engine="vllm"), "rollout_engine="),
        (dict(rollout_memory_fraction=0.0), "rollout_memory_fraction="),
        (dict(rollout_memory_fraction=1.5), "rollout_memory_fraction="),
        (dict(rollout_max_rows=0), "rollout_max_rows="),
        (
            dict(gradient_accumulation_steps=2, steps_per_generation=3, per_device_train_batch_size=16),
            "steps_per_generation=",
        ),
        (dict(old_logprobs="training"), "old_logprobs="),
        (dict(dynamic_sampling_mode="streaming"), "dynamic_sampling_mode="),
        (dict(dynamic_sampling_mode="stream", rollout_engine="trl"), "dynamic_sampling_mode='stream'"),
        (dict(dynamic_sampling_mode="stream", dynamic_sampling=False), "dynamic_sampling_mode='stream'"),
        (
            dict(dynamic_sampling_mode="stream", dynamic_sampling_oversample="auto"),
            "dynamic_sampling_oversample='auto'",
        ),
        (dict(dynamic_sampling_in_flight="drop"), "dynamic_sampling_in_flight='drop'"),  # rounds mode: ignored
        (dict(dynamic_sampling_stream_sync_every=4), "dynamic_sampling_stream_sync_every=4"),
        (dict(dynamic_sampling_mode="stream", dynamic_sampling_in_flight="wait"), "dynamic_sampling_in_flight="),
        (dict(dynamic_sampling_mode="stream", dynamic_sampling_stream_sync_every=0), "dynamic_sampling_stream_sync"),
        (dict(partial_rollouts=True, partial_rollout_max_in_flight=1.0), "partial_rollout_max_in_flight=1.0"),
        (dict(partial_rollout_max_age=2), "partial_rollout_max_age=2"),  # without partial rollouts: ignored
        (dict(partial_rollout_max_in_flight=2.0), "partial_rollout_max_in_flight=2.0"),
        (dict(partial_rollout_keep_cache=0.05), "partial_rollout_keep_cache=0.05"),  # without partial rollouts
        (
            dict(partial_rollouts=True, rollout_engine="paged", partial_rollout_keep_cache=1.0),
            "partial_rollout_keep_c",
        ),
        (
            dict(partial_rollouts=True, rollout_engine="paged", partial_rollout_keep_cache=-0.1),
            "partial_rollout_keep_c",
        ),
        (dict(partial_rollouts=True, rollout_engine="trl"), "partial_rollouts=True"),
        (dict(partial_rollouts=True, use_vllm=True), "partial_rollouts=True"),
        (dict(dynamic_sampling_in_flight="carry"), "dynamic_sampling_in_flight='carry'"),  # rounds mode
        (
            dict(partial_rollouts=True, dynamic_sampling_mode="stream", dynamic_sampling_in_flight="drop"),
            "dynamic_sampling_in_flight='drop'",
        ),
        (dict(old_logprobs="recompute", rollout_correction="geometric_mask"), "rollout_correction="),
        (
            dict(old_logprobs="recompute", rollout_correction="token_mask", rollout_correction_max=0.9),
            "rollout_correction_max=",
        ),
        (
            dict(old_logprobs="recompute", rollout_correction="token_mask", rollout_correction_min=1.5),
            "rollout_correction_min=",
        ),
    ],
)
def test_invalid_settings_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"DAPOConfig.{field}"):
        make(**overrides)


FLOAT_FIELDS = [name for name, rule in FIELD_RULES.items() if rule.kind is float]
BOUNDED_COUNTS = [name for name, rule in FIELD_RULES.items() if rule.kind is int and rule.low is not None]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_a_number_that_is_not_finite_is_refused_naming_the_field(name, value):
    """NaN passes every `<` / `>=` range check: an epsilon of NaN gave a NaN loss, logged as 0.0, every step."""
    with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}={value!r} is invalid: use a finite number"):
        make(**{name: value})


@pytest.mark.parametrize("name", BOUNDED_COUNTS)
def test_a_count_below_its_least_value_is_refused_naming_the_field(name):
    least = FIELD_RULES[name].low
    with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}={least - 1} is invalid: use (a positive|0 or|an int)"):
        make(**{name: least - 1})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(epsilon=float("nan"), epsilon_high=float("nan")),
            "epsilon=nan is invalid: use a finite number in [0, 1)",
        ),
        (dict(clip_ratio_c=float("nan")), "clip_ratio_c=nan is invalid: use a finite number > 1 or None"),
        (
            dict(overlong_penalty_factor=float("nan")),
            "overlong_penalty_factor=nan is invalid: use a finite number >= 0",
        ),
        (
            dict(reward_weights=[1.0, float("nan")]),
            "reward_weights=[1.0, nan] is invalid: every weight must be a finite number",
        ),
        (dict(learning_rate=float("nan")), "learning_rate=nan is invalid"),
        (dict(temperature=float("inf")), "temperature=inf is invalid: use a finite number > 0"),
        (dict(top_p=float("nan")), "top_p=nan is invalid: use a finite number in (0, 1]"),
        (dict(dynamic_sampling_oversample="nan"), "dynamic_sampling_oversample='nan' is invalid"),
        (dict(dynamic_sampling_oversample=float("inf")), "dynamic_sampling_oversample=inf is invalid"),
        (dict(per_device_train_batch_size=0), "per_device_train_batch_size=0 is invalid: use a positive integer"),
        (dict(generation_batch_size=0), "generation_batch_size=0 is invalid: use a positive integer"),
        (dict(steps_per_generation=0), "steps_per_generation=0 is invalid: use a positive integer"),
        (dict(num_iterations=0), "num_iterations=0 is invalid: use a positive integer"),
        (dict(padding_free_max_tokens=0), "padding_free_max_tokens=0 is invalid: use a positive integer"),
        (
            dict(max_num_gen_batches=-1),
            "max_num_gen_batches=-1 is invalid: use 0 or a positive integer (0 = unlimited)",
        ),
    ],
)
def test_the_new_users_bad_numbers_are_refused_naming_the_field(overrides, message):
    """The settings a new user passed that trained on NaN or failed after the model loaded, naming no field."""
    with pytest.raises(ValueError, match="^DAPOConfig." + re.escape(message)):
        make(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(max_num_gen_batches="3"), "max_num_gen_batches='3' is a str, not an int: pass max_num_gen_batches=3 ("),
        (dict(num_generations="4"), "num_generations='4' is a str, not an int: pass num_generations=4 ("),
        (dict(learning_rate="3e-5"), "learning_rate='3e-5' is a str, not a number: pass learning_rate=3e-05 ("),
        (dict(dynamic_sampling="False"), "dynamic_sampling='False' is a str, not a bool (True or False): pass "),
        (
            dict(per_device_train_batch_size=16.0),
            "per_device_train_batch_size=16.0 is a float, not an int: pass per_device_train_batch_size=16.",
        ),
        (dict(max_steps=2.0), "max_steps=2.0 is a float, not an int: pass max_steps=2."),
        (dict(max_steps=2.5), "max_steps=2.5 is a float, not an int."),
        (dict(max_num_gen_batches=True), "max_num_gen_batches=True is a bool, not an int."),
        (dict(reward_weights="1.0"), "reward_weights='1.0' is a str, not a list of numbers or None."),
        (dict(reward_weights=["1.0"]), "reward_weights=['1.0'] is invalid: every weight must be a finite number"),
        (dict(max_surplus_age="two"), "max_surplus_age='two' is a str, not an int or None."),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_field_and_both_types(overrides, message):
    """Before any comparison (DAPO's, TRL's or transformers'), which would raise TypeError naming no field."""
    with pytest.raises((TypeError, ValueError), match="^DAPOConfig." + re.escape(message)):
        make(**overrides)


def _plain_types(annotation) -> set[str]:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return {part.strip() for part in text.split("|")} - {"None"}


def test_every_number_and_switch_dapo_reads_has_a_rule():
    """DAPO's own fields and the GRPOConfig fields it honours: one typed as numbers or bools is in the table, so a new
    field cannot miss its type and range check."""
    own = {f.name for f in dataclasses.fields(DAPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    annotations = {f.name: f.type for f in dataclasses.fields(DAPOConfig)}
    scalar = {"int", "float", "bool", "list[float]"}
    read = [name for name in sorted(own | HONOURED_FIELDS) if _plain_types(annotations[name]) <= scalar]
    assert len(read) >= 50 and [name for name in read if name not in FIELD_RULES] == []
    assert make(top_k=0, max_grad_norm=0.0, learning_rate=1, rollout_correction_min=None).learning_rate == 1


def test_a_completion_length_below_one_is_blamed_on_itself():
    """Not on `overlong_buffer_len`, whose default follows it, with the rejected value as the fix."""
    with pytest.raises(ValueError, match=r"DAPOConfig.max_completion_length=0 is invalid: use a positive integer"):
        make(max_completion_length=0)


def test_a_rollout_correction_needs_the_recomputed_old_policy():
    with pytest.raises(
        ValueError, match=r"rollout_correction='token_truncate' is invalid: .* old_logprobs='recompute'"
    ):
        make(rollout_correction="token_truncate")
    config = make(old_logprobs="recompute", rollout_correction="token_mask", rollout_correction_min=0.5)
    assert (config.rollout_correction, config.rollout_correction_max, config.rollout_correction_min) == (
        "token_mask",
        2.0,
        0.5,
    )


def test_the_rollout_engine_choices_are_auto_paged_and_trl():
    """The removed static engine's name is refused, with the choices left, by the config and by its CLI parser."""
    with pytest.raises(
        ValueError, match=r"^DAPOConfig.rollout_engine='static' is invalid: use one of \('auto', 'paged', 'trl'\)\.$"
    ):
        make(rollout_engine="static")
    assert [make(rollout_engine=choice).rollout_engine for choice in ("auto", "paged", "trl")] == [
        "auto",
        "paged",
        "trl",
    ]
    (field,) = [f for f in dataclasses.fields(DAPOConfig) if f.name == "rollout_engine"]
    assert field.metadata["choices"] == ("auto", "paged", "trl")


@pytest.mark.parametrize("threshold", [dict(rollout_correction_max=5.0), dict(rollout_correction_min=0.5)])
def test_a_correction_threshold_without_a_correction_is_not_ignored(threshold):
    (name,) = threshold
    with pytest.raises(ValueError, match=rf"DAPOConfig.{name}=.* it only acts with a rollout_correction"):
        make(old_logprobs="recompute", **threshold)


def test_trls_vllm_correction_fields_point_at_dapos_own():
    with pytest.raises(
        ValueError, match=r"vllm_importance_sampling_mode=.*old_logprobs='recompute' with rollout_corr"
    ):
        make(vllm_importance_sampling_mode="token_truncate")


def test_batch_scaled_rewards_are_fine_without_dynamic_sampling():
    assert make(scale_rewards="batch", dynamic_sampling=False).scale_rewards == "batch"


def test_normalize_then_sum_is_fine_without_dynamic_sampling():
    config = make(multi_objective_aggregation="normalize_then_sum", dynamic_sampling=False)
    assert config.multi_objective_aggregation == "normalize_then_sum"


def a_value_other_than(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 0.5 if isinstance(default, float) else default + 1
    if isinstance(default, str):
        return default + "_other"
    return 0.5  # None


UNHONOURED = [name for name in grpo_only_fields() if name not in HONOURED_FIELDS]


@pytest.mark.parametrize("name", UNHONOURED)
def test_every_grpo_field_dapo_does_not_honour_is_rejected_when_set(name):
    default = {f.name: f.default for f in dataclasses.fields(DAPOConfig)}[name]
    with pytest.raises(ValueError, match=rf"DAPOConfig.{name}=.* is invalid: .*; leave it at its default"):
        make(**{name: a_value_other_than(default)})


def test_the_field_lists_name_real_grpo_fields():
    fields = set(grpo_only_fields())
    assert fields >= HONOURED_FIELDS and set(REASONS) <= fields
    assert len(UNHONOURED) >= 25  # KL, entropy, other losses' parameters, vLLM's IS correction, delta


def test_a_field_a_later_trl_adds_is_rejected_until_it_is_reviewed(monkeypatch):
    @dataclasses.dataclass
    class LaterGRPOConfig(GRPOConfig):
        new_knob: float = 0.0

    monkeypatch.setattr(grpo_fields, "GRPOConfig", LaterGRPOConfig)
    config = LaterGRPOConfig(output_dir="unused", use_cpu=True, report_to=[], new_knob=1.0)
    assert unhonoured_settings(config) == [("new_knob", 1.0, 0.0, GENERIC_REASON)]
    assert unhonoured_settings(LaterGRPOConfig(output_dir="unused", use_cpu=True, report_to=[])) == []


@pytest.mark.parametrize("world", [1, 2, 8])
def test_defaults_hold_whole_groups_of_16_on_any_number_of_processes(world, monkeypatch):
    """The world size as TrainingArguments reports it after setting up the processes (faked here: one CPU)."""
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: world))
    config = make(per_device_train_batch_size=16)
    assert config.num_generations == 16 and config.generation_batch_size == 16 * world
    if world == 1:
        with pytest.raises(ValueError, match=r"DAPOConfig\.per_device_train_batch_size=8"):
            make(per_device_train_batch_size=8)
    else:  # 8 completions per process already make whole groups of 16 across processes
        assert make(per_device_train_batch_size=8).generation_batch_size == 8 * world


DEMO = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "configs" / "tiny_cpu.yaml").read_text())


@pytest.mark.parametrize(
    ("world", "fix"),
    [
        # no micro-batch size splits 128 completions over 3 processes: the nearest generation batch that does
        (
            3,
            "generation_batch_size to a multiple of 192 or generation_batch_size=120 with per_device_train_batch_size "
            "a divisor of 40;",
        ),
        (4, "generation_batch_size to a multiple of 256 or per_device_train_batch_size to a divisor of 32;"),
    ],
)
def test_the_demo_batch_on_other_process_counts_names_the_fields_and_the_counts_that_work(world, fix, monkeypatch):
    """The demo's 128 completions per generation batch in micro-batches of 64: whole optimizer steps on 1 or 2
    processes only. On others the error names the fields to change, with values that work there."""
    batch = {name: DEMO[name] for name in ("num_generations", "per_device_train_batch_size", "generation_batch_size")}
    assert batch == {"num_generations": 8, "per_device_train_batch_size": 64, "generation_batch_size": 128}
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: world))
    with pytest.raises(ValueError, match=r"DAPOConfig.generation_batch_size=128 is invalid") as error:
        make(**batch)
    assert f"On {world} processes set {fix} unchanged, these settings run on 1 or 2 processes." in str(error.value)
    assert make(**{**batch, "generation_batch_size": 64 * world}).steps_per_generation == 1  # the fixes named work
    if world == 4:
        assert make(**{**batch, "per_device_train_batch_size": 32}).steps_per_generation == 1
    if world == 3:
        assert (
            make(**{**batch, "generation_batch_size": 120, "per_device_train_batch_size": 40}).steps_per_generation
            == 1
        )
    for works in (1, 2):
        monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self, count=works: count))
        assert make(**batch).steps_per_generation == 2 // works


def trainer_with(tiny_model, config):
    from helpers import arithmetic_prompts, length_reward
    from trl_dapo import DAPOTrainer

    return DAPOTrainer(model=tiny_model, reward_funcs=length_reward, args=config, train_dataset=arithmetic_prompts(8))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("beta", 0.5, r"DAPOConfig.beta=0.5 is invalid"),
        ("epsilon_high", 0.1, r"DAPOConfig.epsilon_high=0.1 is invalid: Clip-Higher needs epsilon_high >= epsilon"),
        ("max_completion_length", "8", r"DAPOConfig.max_completion_length='8' is a str, not an int"),
        ("max_steps", 2.0, r"DAPOConfig.max_steps=2.0 is a float, not an int"),
        ("per_device_train_batch_size", 8, r"DAPOConfig.generation_batch_size=4 is invalid: .* = 8 now"),
    ],
)
def test_a_field_changed_after_construction_is_checked_when_the_trainer_is_built(tiny_model, field, value, message):
    config = make(per_device_train_batch_size=4, num_generations=4, max_completion_length=8)
    setattr(config, field, value)
    with pytest.raises((ValueError, TypeError), match=message):
        trainer_with(tiny_model, config)


def test_a_derived_field_follows_its_changed_base_and_the_callers_config_is_left_alone(tiny_model):
    config = make(per_device_train_batch_size=4, num_generations=4, max_completion_length=20, epsilon_high=None)
    assert (config.overlong_buffer_len, config.epsilon_high) == (4, 0.2)
    config.max_completion_length, config.epsilon = 8, 0.25
    trainer = trainer_with(tiny_model, config)
    # not set by the caller: derived again from the changed fields, on the trainer's own copy
    assert (trainer.args.overlong_buffer_len, trainer.args.epsilon_high) == (1, 0.25)
    assert trainer.args is not config
    assert (config.overlong_buffer_len, config.epsilon_high, config.max_completion_length) == (4, 0.2, 8)


def test_a_field_the_caller_set_is_checked_against_its_changed_base(tiny_model):
    config = make(per_device_train_batch_size=4, num_generations=4, max_completion_length=20, overlong_buffer_len=6)
    config.max_completion_length = 6
    with pytest.raises(
        ValueError, match=r"DAPOConfig.overlong_buffer_len=6 is invalid: use 0 \(off\) or a value below"
    ):
        trainer_with(tiny_model, config)


def _numeric_fields() -> dict[str, type]:
    """Every field of DAPOConfig typed as a number (or None), read from the dataclass, not from the rule table."""
    hints = typing.get_type_hints(DAPOConfig)
    found = {}
    for field in dataclasses.fields(DAPOConfig):
        annotation = hints[field.name]
        members = (
            set(typing.get_args(annotation)) if typing.get_origin(annotation) is types.UnionType else {annotation}
        )
        if members - {type(None)} and members - {type(None)} <= {int, float}:
            found[field.name] = float if float in members else int
    return found


NUMERIC_FIELDS = _numeric_fields()


@pytest.mark.parametrize("name", sorted(name for name, kind in NUMERIC_FIELDS.items() if kind is float))
def test_every_number_field_of_the_config_refuses_nan_naming_it(name):
    """The Trainer's and TRL's fields too: a NaN `save_steps` saved no checkpoint, a NaN `logging_steps` logged no
    loss. A field DAPO does not honour names its own reason instead of the range."""
    with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}=nan is invalid: "):
        make(**{name: float("nan")})


def test_the_number_fields_are_the_trainers_and_trls_too():
    assert {"save_steps", "logging_steps", "eval_steps", "warmup_steps", "eval_delay"} <= set(NUMERIC_FIELDS)
    assert {"save_total_limit", "label_smoothing_factor", "torch_empty_cache_steps"} <= set(NUMERIC_FIELDS)
    assert len(NUMERIC_FIELDS) >= 70


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(save_steps=float("inf"), save_strategy="steps"), "save_steps=inf is invalid: use a finite number > 0"),
        (dict(logging_steps=-5), "logging_steps=-5 is invalid: use a finite number > 0"),
        (dict(eval_steps=0), "eval_steps=0 is invalid: use a finite number > 0 or None"),
        (dict(warmup_steps=float("nan")), "warmup_steps=nan is invalid: use a finite number >= 0"),
        (dict(label_smoothing_factor=float("inf")), "label_smoothing_factor=inf is invalid: use a finite number."),
        (dict(save_total_limit=2.5), "save_total_limit=2.5 is a float, not an int or None."),
        (dict(save_steps="500"), "save_steps='500' is a str, not a number: pass save_steps=500.0 ("),
        (
            dict(max_steps=-5),
            "max_steps=-5 is invalid: use a positive integer or -1 (a number of optimizer steps; -1, the default, "
            "trains num_train_epochs epochs instead, as transformers would read any value <= 0).",
        ),
        (dict(max_steps=0), "max_steps=0 is invalid: use a positive integer or -1"),
        (dict(generation_kwargs={"temperature": 0}), "generation_kwargs.temperature=0 is invalid: use a finite num"),
        (dict(generation_kwargs={"top_p": 2.0}), "generation_kwargs.top_p=2.0 is invalid: use a finite number in (0"),
        (dict(generation_kwargs='{"top_k": -1}'), "generation_kwargs.top_k=-1 is invalid: use 0 or a positive int"),
        (dict(generation_kwargs={"max_new_tokens": 0}), "generation_kwargs.max_new_tokens=0 is invalid: use a pos"),
    ],
)
def test_step_counts_and_generation_kwargs_are_refused_naming_the_field(overrides, message):
    with pytest.raises((TypeError, ValueError), match="^DAPOConfig." + re.escape(message)):
        make(**overrides)


def test_minus_one_steps_still_means_epochs():
    assert make(max_steps=-1).max_steps == -1 and make(max_steps=3).max_steps == 3


def test_an_error_shows_a_large_value_shortened():
    """A value read from a file can be large: a YAML alias bomb of 9^7 numbers made a 39 MB message."""
    bomb = [1.0]
    for _ in range(7):
        bomb = [bomb] * 9
    with pytest.raises(ValueError, match=r"^DAPOConfig\.reward_weights=\[\[\[\[\.\.\.\], ") as error:
        make(reward_weights=bomb)
    assert len(str(error.value)) < 300
    with pytest.raises(TypeError) as error:
        make(learning_rate="x" * 10**6)
    assert len(str(error.value)) < 300


def test_an_int_sampling_setting_trains_as_a_float(tiny_model, tmp_path):
    """transformers' sampling refuses an int temperature or repetition penalty, at the first generation, after the
    model loaded: the config stores them as floats, in `generation_kwargs` too."""
    config = make(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        max_steps=1, temperature=2, repetition_penalty=2, generation_kwargs={"top_p": 1}, save_strategy="no",
    )  # fmt: skip
    assert (config.temperature, config.repetition_penalty, config.generation_kwargs) == (2.0, 2.0, {"top_p": 1.0})
    assert isinstance(config.temperature, float) and isinstance(config.generation_kwargs["top_p"], float)
    trainer = trainer_with(tiny_model, config)
    trainer.train()
    assert trainer.state.global_step == 1
