"""The dataset columns a reward function reads, checked before any model loads.

TRL calls each reward function with keywords: `prompts`, `completions`, `completion_ids`, `trainer_state`, `log_extra`,
`log_metric`, then one per dataset column but `prompt`, `completion` and `completion_ids` (and `environments` with an
environment, whose prompts come from it, and the fields a `rollout_func` returns: neither is checked here). A function
with a required parameter none of them fills (`dapo_math_reward`'s `answer` on a dataset without an `answer` column)
failed at its first call, after the model had loaded and generated, with a bare `TypeError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

PASSED_BY_TRL = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
COLUMNS_NOT_PASSED = ("prompt", "completion", "completion_ids")


def required_parameters(function: Callable) -> list[str]:
    """The parameters a keyword call of `function` must fill (none when its signature cannot be read)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some built-in callables have no signature
        return []
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in keyword and p.default is inspect.Parameter.empty]


def check_reward_columns(functions: Sequence[tuple[str, Any]], dataset_name: str, columns: Sequence[str]) -> None:
    """Each reward function (`(name, function)`; a reward model, or its hub id, reads text) gets every parameter it
    requires from TRL or from a column of the dataset `dataset_name`, else a `ValueError` naming the function, the
    parameter and the columns there are."""
    given = {*PASSED_BY_TRL, *(set(columns) - set(COLUMNS_NOT_PASSED))}
    for name, function in functions:
        if isinstance(function, str | nn.Module):
            continue
        missing = [parameter for parameter in required_parameters(function) if parameter not in given]
        if missing:
            raise ValueError(
                f"reward function {name!r} requires {missing[0]!r}, which TRL passes from the dataset column of that "
                f"name, but {dataset_name} has no such column (columns: {list(columns)}): add it (the ground truth "
                f"for each prompt, e.g. `dataset.add_column({missing[0]!r}, ...)`), rename the column holding it, or "
                "give the parameter a default."
            )
