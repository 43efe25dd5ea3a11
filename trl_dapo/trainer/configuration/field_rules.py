"""The type and range of every number and switch `DAPOConfig` reads: DAPO's own fields, the `GRPOConfig` fields
DAPOTrainer honours (`grpo_fields.py`) and the `TrainingArguments` numbers of its batches, optimizer and schedule.

One table, checked before any other code (DAPO's checks, TRL's, transformers') compares a value: a string from a
notebook widget or an environment variable is a `TypeError` naming the field and the type it needs, not
`'<' not supported between instances of 'str' and 'int'`; NaN, which passes every `<` / `>=` range check, and a zero
batch size, which passes the whole-groups check, are a `ValueError` naming the field before any model loads.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


def invalid_value(name: str, value: object, fix: str) -> ValueError:
    return ValueError(f"DAPOConfig.{name}={value!r} is invalid: {fix}")


@dataclass(frozen=True)
class Rule:
    """A field's type (`bool`, `int`, `float`, which accepts an int, or `list`: of numbers) and range; numbers must be
    finite. `low` / `high` are included unless `low_open` / `high_open`; `optional` allows None."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    hint: str = ""

    def expected_type(self) -> str:
        names = {bool: "a bool (True or False)", int: "an int", float: "a number", list: "a list of numbers"}
        return names[self.kind] + (" or None" if self.optional else "")

    def expected_range(self) -> str:
        """The values the field takes, in words (a switch's or a list's: its type)."""
        if self.kind in (bool, list):
            return self.expected_type()
        none = " or None" if self.optional else ""
        if self.kind is int:
            if self.low == 1:
                return f"a positive integer{none}"
            if self.low == 0:
                return f"0 or a positive integer{none}"
            return f"an integer >= {self.low}{none}" if self.low is not None else f"an integer{none}"
        if self.low is not None and self.high is not None:
            bounds = f" in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            bounds = f" {'>' if self.low_open else '>='} {self.low}"
        else:
            bounds = ""
        return f"a finite number{bounds}{none}"

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return math.isfinite(value) and above and below


def _count(low: int, optional: bool = False, hint: str = "") -> Rule:
    return Rule(int, low=low, optional=optional, hint=hint)


def _number(low: float | None = None, high: float | None = None, **kwargs: Any) -> Rule:
    return Rule(float, low=low, high=high, **kwargs)


_SWITCH, _OPTIONAL_SWITCH = Rule(bool), Rule(bool, optional=True)

FIELD_RULES: dict[str, Rule] = {
    # TrainingArguments: batches, optimizer, schedule
    "per_device_train_batch_size": _count(1),
    "per_device_eval_batch_size": _count(1),
    "gradient_accumulation_steps": _count(1),
    "max_steps": Rule(int, hint="-1 trains num_train_epochs"),
    "seed": Rule(int),
    "num_train_epochs": _number(0),
    "learning_rate": _number(0),
    "weight_decay": _number(0),
    "adam_beta1": _number(0, 1, high_open=True),
    "adam_beta2": _number(0, 1, high_open=True),
    "adam_epsilon": _number(0, low_open=True),
    "max_grad_norm": _number(0, hint="0 turns clipping off"),
    "warmup_steps": _number(0, hint="a number of steps, or below 1 a share of them"),
    "bf16": _OPTIONAL_SWITCH,
    # GRPOConfig fields DAPOTrainer honours
    "num_generations": _count(2, hint="group advantages need at least 2 samples per prompt"),
    "num_generations_eval": _count(1, optional=True),
    "generation_batch_size": _count(1, optional=True, hint="completions per generation batch"),
    "steps_per_generation": _count(1, optional=True),
    "num_iterations": _count(1),
    "max_completion_length": _count(1, hint="a number of tokens, e.g. 1024"),
    "max_tool_calling_iterations": _count(0, optional=True),
    "num_completions_to_print": _count(0, optional=True),
    "temperature": _number(0, low_open=True),
    "top_p": _number(0, 1, low_open=True),
    "top_k": _count(0, hint="0 turns it off"),
    "min_p": _number(0, 1, optional=True),
    "repetition_penalty": _number(0, low_open=True),
    "reward_weights": Rule(list, optional=True, hint="one per reward function"),
    "epsilon": _number(0, 1, high_open=True, hint="DAPO: 0.2"),
    "epsilon_high": _number(0, optional=True, hint="DAPO: 0.28; None takes epsilon"),
    "router_aux_loss_coef": _number(optional=True),
    "vllm_gpu_memory_utilization": _number(0, 1, low_open=True),
    "vllm_server_timeout": _number(0, low_open=True),
    "vllm_server_port": Rule(int),
    "vllm_group_port": Rule(int),
    "vllm_tensor_parallel_size": _count(1),
    "vllm_max_model_length": _count(1, optional=True),
    "cast_lm_head_to_fp32": _SWITCH,
    "disable_dropout": _SWITCH,
    "ds3_gather_for_generation": _SWITCH,
    "log_completions": _SWITCH,
    "log_multimodal": _SWITCH,
    "log_unique_prompts": _SWITCH,
    "mask_truncated_completions": _SWITCH,
    "shuffle_dataset": _OPTIONAL_SWITCH,
    "trust_remote_code": _SWITCH,
    "use_transformers_continuous_batching": _SWITCH,
    "use_transformers_paged": _SWITCH,
    "use_vllm": _SWITCH,
    "vllm_enable_sleep_mode": _SWITCH,
    # DAPO's own
    "clip_ratio_c": _number(
        1, low_open=True, optional=True, hint="the dual-clip bound (DAPO: 10.0); None turns it off"
    ),
    "dynamic_sampling": _SWITCH,
    "max_num_gen_batches": _count(0, hint="0 = unlimited"),
    "dynamic_sampling_keep_surplus": _SWITCH,
    "max_surplus_age": _count(0, optional=True, hint="a number of optimizer steps"),
    "dynamic_sampling_max_oversample": _number(1),
    "dynamic_sampling_stream_sync_every": _count(1),
    "partial_rollouts": _SWITCH,
    "partial_rollout_max_in_flight": _number(
        1,
        low_open=True,
        hint="generation batches' worth of groups in flight, e.g. 3.0; at 1 nothing would ever be carried",
    ),
    "partial_rollout_max_age": _count(0, optional=True, hint="a number of optimizer steps"),
    "partial_rollout_keep_cache": _number(
        0, 1, high_open=True, hint="a share of the device's memory, e.g. 0.05; 0 prefills carried rows again"
    ),
    "overlong_buffer_len": _count(0, optional=True, hint="0 turns it off"),
    "overlong_penalty_factor": _number(0, hint="DAPO: 1.0"),
    "rollout_memory_fraction": _number(0, 1, low_open=True, hint="a share of the device's memory, e.g. 0.85"),
    "rollout_max_rows": _count(1, hint="a number of rows, e.g. 1024"),
    "rollout_correction_max": _number(
        1,
        hint="the cap or the band's upper end; a token both engines agree on has weight 1 (verl's default cap is "
        "2.0, IcePop's band ends at 5.0)",
    ),
    "rollout_correction_min": _number(0, 1, optional=True, hint="IcePop: 0.5"),
    "padding_free": _OPTIONAL_SWITCH,
    "padding_free_max_tokens": _count(1, optional=True, hint="a number of tokens per pass"),
    "max_prompt_length": _count(1, optional=True, hint="a number of tokens, e.g. 2048"),
}


def _is_kind(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # a bool is an int to Python, never a count or a rate here
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, list | tuple)


def _as_kind(text: str, kind: type) -> object | None:
    """What a string from a widget or an environment variable was meant to be, for the error's fix; None if unclear."""
    if kind is bool:
        return {"true": True, "false": False}.get(text.strip().lower())
    try:
        return kind(text) if kind in (int, float) else None
    except ValueError:
        return None


def wrong_type(name: str, value: object, rule: Rule) -> TypeError:
    meant = _as_kind(value, rule.kind) if isinstance(value, str) else None
    if rule.kind is int and isinstance(value, float) and value.is_integer():
        meant = int(value)  # 2.0 from arithmetic or a YAML file: the count it was meant to be
    fix = f": pass {name}={meant!r}" if meant is not None else ""
    from_text = meant is not None and isinstance(value, str)
    source = " (a widget, an environment variable or a file gives strings: convert them)" if from_text else ""
    return TypeError(
        f"DAPOConfig.{name}={value!r} is a {type(value).__name__}, not {rule.expected_type()}{fix}{source}."
    )


def check_field_rules(config: object) -> None:
    """Each field of `FIELD_RULES` has its type and range, else an error naming it, its value and what it takes."""
    for name, rule in FIELD_RULES.items():
        value = getattr(config, name)
        if value is None and rule.optional:
            continue
        if not _is_kind(value, rule.kind):
            raise wrong_type(name, value, rule)
        hint = f" ({rule.hint})" if rule.hint else ""
        if rule.kind is list:
            if not all(_is_kind(item, float) and math.isfinite(item) for item in value):
                raise invalid_value(name, value, f"every weight must be a finite number{hint}.")
        elif rule.kind is not bool and not rule.holds(value):
            raise invalid_value(name, value, f"use {rule.expected_range()}{hint}.")
