"""The type and range of every number and switch `DAPOConfig` reads: DAPO's own fields, the `GRPOConfig` fields
DAPOTrainer honours (`grpo_fields.py`) and the `TrainingArguments` numbers of its batches, optimizer, schedule,
logging and saving; every other field typed as a number (the Trainer's, TRL's, any a later version adds) is held to its
type and, as a number, to being finite.

One table, checked before any other code (DAPO's checks, TRL's, transformers') compares a value: a string from a
notebook widget or an environment variable is a `TypeError` naming the field and the type it needs, not
`'<' not supported between instances of 'str' and 'int'`; NaN, which passes every `<` / `>=` range check (a NaN
`save_steps` saved nothing, a NaN `logging_steps` logged nothing), and a zero batch size, which passes the
whole-groups check, are a `ValueError` naming the field before any model loads. Errors show a shortened repr of the
value: a value read from a file can be large.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import reprlib
import types
import typing
from dataclasses import dataclass
from typing import Any

MAX_REPR = 160  # characters of a value an error message shows
_REPR = reprlib.Repr()  # its limits are attributes (keyword arguments from Python 3.12 only)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 5


def short_repr(value: object) -> str:
    """`repr(value)`, elided past a few items, levels and `MAX_REPR` characters, computed without the full repr."""
    text = _REPR.repr(value)
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


def invalid_value(name: str, value: object, fix: str, owner: str = "DAPOConfig") -> ValueError:
    return ValueError(f"{owner}.{name}={short_repr(value)} is invalid: {fix}")


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
    also: tuple[int, ...] = ()  # values allowed outside the range (max_steps=-1: train by epochs)

    def expected_type(self) -> str:
        names = {bool: "a bool (True or False)", int: "an int", float: "a number", list: "a list of numbers"}
        return names[self.kind] + (" or None" if self.optional else "")

    def expected_range(self) -> str:
        """The values the field takes, in words (a switch's or a list's: its type)."""
        if self.kind in (bool, list):
            return self.expected_type()
        none = "".join(f" or {value}" for value in self.also) + (" or None" if self.optional else "")
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
        if value in self.also:
            return True
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return _finite(value) and above and below


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float's range
        return False


def _count(low: int, optional: bool = False, hint: str = "") -> Rule:
    return Rule(int, low=low, optional=optional, hint=hint)


def _number(low: float | None = None, high: float | None = None, **kwargs: Any) -> Rule:
    return Rule(float, low=low, high=high, **kwargs)


_SWITCH, _OPTIONAL_SWITCH = Rule(bool), Rule(bool, optional=True)
_STEPS = "a number of optimizer steps, or below 1 a share of the run's steps"

FIELD_RULES: dict[str, Rule] = {
    # TrainingArguments: batches, optimizer, schedule, logging, saving
    "per_device_train_batch_size": _count(1),
    "per_device_eval_batch_size": _count(1),
    "gradient_accumulation_steps": _count(1),
    "max_steps": Rule(
        int,
        low=1,
        also=(-1,),
        hint="a number of optimizer steps; -1, the default, trains num_train_epochs epochs instead, as transformers "
        "would read any value <= 0",
    ),
    "seed": Rule(int),
    "num_train_epochs": _number(0),
    "learning_rate": _number(0),
    "weight_decay": _number(0),
    "adam_beta1": _number(0, 1, high_open=True),
    "adam_beta2": _number(0, 1, high_open=True),
    "adam_epsilon": _number(0, low_open=True),
    "max_grad_norm": _number(0, hint="0 turns clipping off"),
    "warmup_steps": _number(0, hint="a number of steps, or below 1 a share of them"),
    "logging_steps": _number(0, low_open=True, hint=_STEPS),
    "save_steps": _number(0, low_open=True, hint=_STEPS),
    "eval_steps": _number(0, low_open=True, optional=True, hint=_STEPS + "; None takes logging_steps"),
    "eval_delay": _number(0, hint="a number of steps or epochs, as eval_strategy counts"),
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


def wrong_type(name: str, value: object, rule: Rule, owner: str = "DAPOConfig") -> TypeError:
    meant = _as_kind(value, rule.kind) if isinstance(value, str) else None
    if rule.kind is int and isinstance(value, float) and value.is_integer():
        meant = int(value)  # 2.0 from arithmetic or a YAML file: the count it was meant to be
    fix = f": pass {name}={short_repr(meant)}" if meant is not None else ""
    from_text = meant is not None and isinstance(value, str)
    source = " (a widget, an environment variable or a file gives strings: convert them)" if from_text else ""
    return TypeError(
        f"{owner}.{name}={short_repr(value)} is a {type(value).__name__}, not {rule.expected_type()}{fix}{source}."
    )


def check_rules(target: object, rules: dict[str, Rule], owner: str = "DAPOConfig") -> None:
    """Each field of `rules` has its type and range, else an error naming `owner`, the field, its value and what it
    takes. An int where a number is asked is stored as a float: transformers' sampling refuses an int temperature
    or repetition penalty, at the first generation."""
    for name, rule in rules.items():
        value = getattr(target, name)
        if value is None and rule.optional:
            continue
        if not _is_kind(value, rule.kind):
            raise wrong_type(name, value, rule, owner)
        hint = f" ({rule.hint})" if rule.hint else ""
        if rule.kind is list:
            if not all(_is_kind(item, float) and _finite(item) for item in value):
                raise invalid_value(name, value, f"every weight must be a finite number{hint}.", owner)
        elif rule.kind is not bool and not rule.holds(value):
            raise invalid_value(name, value, f"use {rule.expected_range()}{hint}.", owner)
        if rule.kind is float and not isinstance(value, float):
            setattr(target, name, float(value))


def check_field_rules(config: object) -> None:
    """The fields of `FIELD_RULES`, in `check_rules`'s way."""
    check_rules(config, FIELD_RULES)


def _union_members(annotation: object) -> set[object]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}


@functools.cache
def numeric_field_rules(config_class: type) -> dict[str, Rule]:
    """A rule for each field of `config_class` typed as a number (int or float, or None) that `FIELD_RULES` does not
    name: the Trainer's (`save_total_limit`, `label_smoothing_factor`...), TRL's and any field a later version adds
    keep their type and, as numbers, are finite."""
    try:
        hints = typing.get_type_hints(config_class)
    except (NameError, TypeError):  # a subclass's annotation names what only type checkers import: read each alone
        hints = {}
    rules = {}
    for field in dataclasses.fields(config_class):
        members = _union_members(hints.get(field.name, field.type))
        kinds = members - {type(None)}
        if field.name not in FIELD_RULES and kinds and kinds <= {int, float}:
            rules[field.name] = Rule(float if float in kinds else int, optional=type(None) in members)
    return rules


def check_numeric_fields(config: object) -> None:
    """Every field typed as a number that `FIELD_RULES` does not name: its type, and finite."""
    check_rules(config, numeric_field_rules(type(config)))


# `generation_kwargs` keys that stand in for a checked field: TRL merges them over its own generation settings and the
# paged engine reads them (`collection/engine_choice.py`), so a value there skips the field's check unless held to it.
GENERATION_KWARGS_RULES: dict[str, Rule] = {
    "temperature": FIELD_RULES["temperature"],
    "top_p": FIELD_RULES["top_p"],
    "top_k": FIELD_RULES["top_k"],
    "min_p": FIELD_RULES["min_p"],
    "repetition_penalty": FIELD_RULES["repetition_penalty"],
    "max_new_tokens": FIELD_RULES["max_completion_length"],
    "min_new_tokens": _count(0),
}


def check_generation_kwargs(config: Any) -> None:
    """`generation_kwargs` (a dict once TRL's `__post_init__` has read a JSON string) holds the sampling settings it
    overrides to the rules of the fields they stand in for: `{"temperature": 0}` failed at the first generation."""
    kwargs = config.generation_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise invalid_value("generation_kwargs", kwargs, "use a dict of generate() arguments, or None.")
    present = {name: rule for name, rule in GENERATION_KWARGS_RULES.items() if name in kwargs}
    values = types.SimpleNamespace(**{name: kwargs[name] for name in present})
    check_rules(values, present, owner="DAPOConfig.generation_kwargs")
    kwargs.update(vars(values))  # ints stored as floats, as for the fields
