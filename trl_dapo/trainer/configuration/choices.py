"""The values DAPO's choice fields take, and which settings work together: stream mode, partial rollouts, the old
policy and its rollout correction, FP8 rollouts, and the `GRPOConfig` fields dynamic sampling constrains. The values
are tables (`FIELD_CHOICES`, `WORDS_OR_NUMBER`, `WITH_DYNAMIC_SAMPLING`), which the reference page reads too
(`reference.py`).

`DAPOConfig` runs `check_choices` once every field's type and range hold (`field_rules.py`), before TRL's own checks.
Two fields are settled on the way: `dynamic_sampling_oversample` to its canonical string, and `partial_rollouts` to
True with `dynamic_sampling_in_flight="carry"` (stream mode's name for the same switch).
"""

from __future__ import annotations

import math
from typing import Any

from .field_rules import Rule, invalid_value

ON_LIMIT_CHOICES = ("raise", "train_on_partial")
ROLLOUT_ENGINES = ("auto", "paged", "trl")
OLD_LOGPROBS_CHOICES = ("rollout", "recompute")
ROLLOUT_PRECISIONS = ("bf16", "fp8")
SAMPLING_MODES = ("rounds", "stream")
IN_FLIGHT_CHOICES = ("finish", "drop", "carry")
CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DEFAULT_CORRECTION_MAX = 2.0
DEFAULT_MAX_IN_FLIGHT = 3.0
# The values each choice field takes, checked before any combination (the reference page's allowed values too).
FIELD_CHOICES: dict[str, tuple[object, ...]] = {
    "dynamic_sampling_on_limit": ON_LIMIT_CHOICES,
    "dynamic_sampling_mode": SAMPLING_MODES,
    "dynamic_sampling_in_flight": IN_FLIGHT_CHOICES,
    "rollout_engine": ROLLOUT_ENGINES,
    "old_logprobs": OLD_LOGPROBS_CHOICES,
    "rollout_correction": (*CORRECTION_MODES, None),
    "rollout_kv_cache_dtype": ROLLOUT_PRECISIONS,
    "rollout_weights_dtype": ROLLOUT_PRECISIONS,
}
# A field that takes these words or a number its rule holds, kept a string for argument parsers.
WORDS_OR_NUMBER: dict[str, tuple[tuple[str, ...], Rule]] = {
    "dynamic_sampling_oversample": (("auto",), Rule(float, low=1, hint="e.g. '1.0'")),
}
# `GRPOConfig` fields that dynamic sampling narrows to these values, and why.
WITH_DYNAMIC_SAMPLING: dict[str, tuple[tuple[object, ...], str]] = {
    "scale_rewards": (
        ("group", "none", True, False),
        "with dynamic sampling the advantage of a kept group must not depend on dropped groups; use 'group' (or "
        "'none'), or dynamic_sampling=False.",
    ),
    "multi_objective_aggregation": (
        ("sum_then_normalize",),
        "it whitens the summed rewards over the whole candidate round, groups that dynamic sampling drops included, "
        "so a kept group's advantage would depend on them; use 'sum_then_normalize' (the reference recipe's) or "
        "dynamic_sampling=False.",
    ),
}


def check_choices(config: Any) -> None:
    """Reject settings of a `DAPOConfig` that would silently stop it from being DAPO, naming the field and the fix;
    `epsilon_high` is set (None takes `epsilon`) before."""
    if config.epsilon_high < config.epsilon:
        raise invalid_value(
            "epsilon_high",
            config.epsilon_high,
            f"Clip-Higher needs epsilon_high >= epsilon ({config.epsilon}); DAPO uses 0.28 with 0.2.",
        )
    for name, choices in FIELD_CHOICES.items():
        value = getattr(config, name)
        if value not in choices:
            raise invalid_value(name, value, f"use {choices_text(choices)}.")
    for name, (choices, why) in WITH_DYNAMIC_SAMPLING.items():
        if config.dynamic_sampling and getattr(config, name) not in choices:
            raise invalid_value(name, getattr(config, name), why)
    for name in WORDS_OR_NUMBER:
        setattr(config, name, _parse_words_or_number(name, getattr(config, name)))
    _check_sampling_mode(config)
    _check_partial_rollouts(config)
    _check_old_policy(config)
    _check_rollout_precision(config)
    if config.padding_free_max_tokens is not None and config.padding_free is False:
        raise invalid_value(
            "padding_free_max_tokens",
            config.padding_free_max_tokens,
            "it caps padding-free passes: set padding_free=True (or None) or leave it None.",
        )


def _check_sampling_mode(config: Any) -> None:
    """Stream mode and its settings; a stream setting without stream mode would be ignored."""
    if config.dynamic_sampling_mode == "rounds":
        if config.dynamic_sampling_in_flight == "carry":
            raise invalid_value(
                "dynamic_sampling_in_flight",
                "carry",
                "it acts in stream mode only; rounds mode carries the rows in flight with partial_rollouts=True.",
            )
        _refuse_unless_default(
            config,
            {"dynamic_sampling_in_flight": "finish", "dynamic_sampling_stream_sync_every": 1},
            "it acts in stream mode only: set dynamic_sampling_mode='stream' or leave it at its default.",
        )
        return
    if not config.dynamic_sampling:
        raise invalid_value(
            "dynamic_sampling_mode",
            "stream",
            "streaming is a way of doing dynamic sampling: set dynamic_sampling=True or use 'rounds'.",
        )
    if config.dynamic_sampling_oversample != "1.0":
        raise invalid_value(
            "dynamic_sampling_oversample",
            config.dynamic_sampling_oversample,
            "it sizes candidate rounds, which stream mode does not have (it admits groups from the running "
            "efficiency as slots free): leave it at '1.0', or use dynamic_sampling_mode='rounds'.",
        )
    _check_paged_engine(config, "dynamic_sampling_mode", "stream", "dynamic_sampling_mode='rounds'")


def _check_partial_rollouts(config: Any) -> None:
    """Partial rollouts and their settings. Stream mode's `dynamic_sampling_in_flight="carry"` is the same switch:
    either turns both on; a partial-rollout setting without partial rollouts would be ignored."""
    if config.dynamic_sampling_in_flight == "carry":
        config.partial_rollouts = True
    if not config.partial_rollouts:
        _refuse_unless_default(
            config,
            {
                "partial_rollout_max_in_flight": DEFAULT_MAX_IN_FLIGHT,
                "partial_rollout_max_age": None,
                "partial_rollout_keep_cache": 0.0,
            },
            "it acts with partial_rollouts=True only: set that, or leave this at its default.",
        )
        return
    if config.dynamic_sampling_mode == "stream":
        if config.dynamic_sampling_in_flight == "drop":
            raise invalid_value(
                "dynamic_sampling_in_flight",
                "drop",
                "partial_rollouts=True carries the rows in flight when the batch is full, which 'drop' abandons: "
                "leave dynamic_sampling_in_flight at its default, or set partial_rollouts=False.",
            )
        config.dynamic_sampling_in_flight = "carry"
    _check_paged_engine(config, "partial_rollouts", True, "partial_rollouts=False")


def _refuse_unless_default(config: Any, defaults: dict[str, object], why: str) -> None:
    """Each field named in `defaults` at its default: it would be ignored here, which `why` says."""
    for name, default in defaults.items():
        if getattr(config, name) != default:
            raise invalid_value(name, getattr(config, name), why)


def _check_paged_engine(config: Any, name: str, value: object, otherwise: str) -> None:
    """`name` (at `value`) needs trl-dapo's paged engine: an engine choice that rules it out is an error here,
    before any model loads (what only the built trainer knows is checked at set-up, `set_up.py`)."""
    if config.rollout_engine == "trl" or config.use_vllm:
        engine, fix = (
            ("use_vllm=True", "use_vllm=False and rollout_engine='paged' (or 'auto' on CUDA)")
            if config.use_vllm
            else (f"rollout_engine={config.rollout_engine!r}", "rollout_engine='paged' (or 'auto' on CUDA)")
        )
        raise invalid_value(
            name,
            value,
            f"it needs trl-dapo's paged engine (it keeps rows decoding across the engine's calls and refills its "
            f"decode slots), which {engine} does not use: set {fix}, or {otherwise}.",
        )


def _check_old_policy(config: Any) -> None:
    """The rollout correction; a threshold without a correction would be ignored."""
    if config.rollout_correction is None:
        if config.rollout_correction_max != DEFAULT_CORRECTION_MAX or config.rollout_correction_min is not None:
            name = "rollout_correction_max" if config.rollout_correction_min is None else "rollout_correction_min"
            raise invalid_value(
                name,
                getattr(config, name),
                "it only acts with a rollout_correction: set one (e.g. 'token_truncate') or leave it at its default.",
            )
        return
    if config.old_logprobs != "recompute":
        raise invalid_value(
            "rollout_correction",
            config.rollout_correction,
            "it weighs tokens by π_old / π_rollout, which needs a recomputed old policy: set "
            "old_logprobs='recompute' (with the rollout logprobs as the old policy every weight would be 1).",
        )


def _check_rollout_precision(config: Any) -> None:
    """FP8 rollouts: the paged engine generates, and the loss corrects for the policy FP8 samples from (off the
    training model's by its rounding) with a recomputed old policy and a rollout correction."""
    for name in ("rollout_kv_cache_dtype", "rollout_weights_dtype"):
        value = getattr(config, name)
        if value != "fp8":
            continue
        _check_paged_engine(config, name, value, f"{name}='bf16'")
        if config.old_logprobs != "recompute" or config.rollout_correction is None:
            raise invalid_value(
                name,
                value,
                "FP8 rollouts sample from a policy off the training model's (its rounding), which the loss must "
                "correct for: set old_logprobs='recompute' and rollout_correction='token_mask' (tokens whose "
                "π_old / π_rollout leaves [1/rollout_correction_max, rollout_correction_max] are masked), or "
                f"{name}='bf16'.",
            )


def choices_text(choices: tuple[object, ...]) -> str:
    """`one of ('a', 'b')`, with `or None` after them where None is one."""
    named = tuple(choice for choice in choices if choice is not None)
    return f"one of {named}" + (" or None" if None in choices else "")


def words_or_number_text(name: str) -> str:
    """What a `WORDS_OR_NUMBER` field takes: `'auto' or a finite number >= 1`."""
    words, rule = WORDS_OR_NUMBER[name]
    return " or ".join([*map(repr, words), rule.expected_range()])


def _parse_words_or_number(name: str, value: str | float) -> str:
    """Keep the field a string for argument parsers, but check it names one of its words or a number in range."""
    words, rule = WORDS_OR_NUMBER[name]
    if str(value).strip().lower() in words:
        return str(value).strip().lower()
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not rule.holds(number):
        hint = f" ({rule.hint})" if rule.hint else ""
        raise invalid_value(name, value, f"use {words_or_number_text(name)}{hint}.")
    return str(number)
