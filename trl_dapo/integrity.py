"""Checks that stop a bad rollout batch before it reaches an optimizer step.

Each failure raises `RolloutIntegrityError` naming the field that is wrong and what to change: a silently dropped or
misaligned sample would bias the token-mean and the group advantages without any visible symptom.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import torch
from trl.trainer.utils import is_async_callable

from .text import and_more

# The group's standard deviation squares the rewards in float32 (largest 3.4e38): beyond this they overflow to inf and
# every advantage becomes 0, a step that trains nothing.
MAX_ABS_REWARD = 1e15


class RolloutIntegrityError(ValueError):
    """A rollout batch violates an invariant the DAPO loss relies on."""


def _infinite_reward(name: str, value: float, row: int) -> RolloutIntegrityError:
    return RolloutIntegrityError(
        f"rewards: reward function '{name}' returned {value} for completion {row}; return a finite number (or None "
        "when the function does not apply)."
    )


def _too_large_reward(name: str, value: str, row: int) -> RolloutIntegrityError:
    return RolloutIntegrityError(
        f"rewards: reward function '{name}' returned {value} for completion {row}; rewards beyond "
        f"±{MAX_ABS_REWARD:.0e} overflow the group's standard deviation (float32), which makes every advantage 0: "
        "scale the reward down (e.g. to [-1, 1])."
    )


def check_rewards(rewards_per_func: torch.Tensor, num_completions: int, reward_func_names: Sequence[str]) -> None:
    """One finite reward (at most `MAX_ABS_REWARD` in size) per completion from at least one reward function (NaN =
    "this function does not apply")."""
    if rewards_per_func.shape != (num_completions, len(reward_func_names)):
        raise RolloutIntegrityError(
            f"rewards: got shape {tuple(rewards_per_func.shape)} for {num_completions} completions and reward "
            f"functions {list(reward_func_names)}; every reward function must return one value per completion."
        )
    infinite = torch.isinf(rewards_per_func)
    if infinite.any():
        row, col = (int(i) for i in infinite.nonzero()[0])
        raise _infinite_reward(reward_func_names[col], rewards_per_func[row, col].item(), row)
    huge = rewards_per_func.abs() > MAX_ABS_REWARD
    if huge.any():
        row, col = (int(i) for i in huge.nonzero()[0])
        raise _too_large_reward(reward_func_names[col], f"{rewards_per_func[row, col].item():.3g}", row)
    unscored = torch.isnan(rewards_per_func).all(dim=1)
    if unscored.any():
        row = int(unscored.nonzero()[0])
        raise RolloutIntegrityError(
            f"rewards: completion {row}{and_more(int(unscored.sum()))} got no reward: every reward function "
            f"{list(reward_func_names)} returned None/NaN; at least one must score each completion: return a "
            "number for it (e.g. 0.0 where a task's function does not apply), or drop its prompt from the dataset "
            "(TRL's accuracy_reward returns None where it cannot parse the gold solution). GRPOTrainer would train "
            "it with zero advantage."
        )


def check_weighted_total(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor) -> None:
    """The weighted sum each advantage is taken of stays within `MAX_ABS_REWARD` too: a large weight on a fine
    reward overflows the group's standard deviation just the same."""
    totals = (rewards_per_func * reward_weights.to(rewards_per_func.device)).nansum(dim=1)
    huge = totals.abs() > MAX_ABS_REWARD
    if huge.any():
        row = int(huge.nonzero()[0])
        raise RolloutIntegrityError(
            f"rewards: completion {row}'s weighted reward {totals[row].item():.3g} is beyond ±{MAX_ABS_REWARD:.0e}, "
            "which overflows the group's standard deviation (float32) and makes every advantage 0: lower "
            "reward_weights or scale the rewards down."
        )


def check_reward_values(values: Any, name: str) -> None:
    """A reward function returns a sequence of numbers (None where it does not apply), each finite and within
    `MAX_ABS_REWARD`: anything else would reach TRL as an error that does not name the function (`too many dimensions
    'str'`, `'NoneType' object is not iterable`, `OverflowError` for `10**400`). The size is compared before TRL's
    float32 cast, which rounds rewards up to about 1.00000002e15 down to 1e15 itself."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray | torch.Tensor):
        raise TypeError(
            f"reward function {name!r} returned {type(values).__name__} {values!r:.60}; return a list with one float "
            "per completion (None where the function does not apply)."
        )
    for index, value in enumerate(values):
        if not (value is None or isinstance(value, numbers.Real | np.bool_) or _is_real_scalar_tensor(value)):
            raise TypeError(
                f"reward function {name!r} returned {type(value).__name__} {value!r:.60} for completion {index}; "
                "return a float per completion (None where the function does not apply)."
            )
        number = value.item() if isinstance(value, torch.Tensor) else value
        if number is not None and abs(number) == math.inf:
            raise _infinite_reward(name, float(number), index)
        if number is not None and abs(number) > MAX_ABS_REWARD:  # exact for any int; NaN (does not apply) is not
            raise _too_large_reward(name, _as_text(number), index)


def _as_text(number: numbers.Real) -> str:
    """A reward as returned, told apart from the bound (`1000000010000000.0`, not `1e+15`; an int past float64's range:
    `1.000e+400`)."""
    if isinstance(number, numbers.Integral):
        return str(int(number)) if abs(number) < 10**20 else f"{Decimal(int(number)):.3e}"
    return repr(float(number))


def _is_real_scalar_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()


def checked_reward_function(function: Callable, name: str) -> Callable:
    """`function` (sync or async, kept so) with its output checked by `check_reward_values`."""
    if is_async_callable(function):

        @functools.wraps(function)
        async def checked_async(*args: Any, **kwargs: Any) -> Any:
            values = await function(*args, **kwargs)
            check_reward_values(values, name)
            return values

        return checked_async

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        values = function(*args, **kwargs)
        check_reward_values(values, name)
        return values

    return checked


def check_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int) -> None:
    """Rows come in consecutive groups of exactly `num_generations` samples of one prompt."""
    rows = prompt_ids.size(0)
    if rows % num_generations != 0:
        raise RolloutIntegrityError(
            f"prompt_ids: {rows} rows is not a whole number of groups of num_generations={num_generations}; each "
            "prompt must be sampled exactly num_generations times."
        )
    masked = prompt_ids.masked_fill(prompt_mask == 0, -1).view(rows // num_generations, num_generations, -1)
    differs = (masked != masked[:, :1]).any(dim=2).any(dim=1)
    if differs.any():
        group = int(differs.nonzero()[0])
        raise RolloutIntegrityError(
            f"prompt_ids: group {group} mixes prompts; each block of num_generations={num_generations} consecutive "
            "rows must hold samples of one prompt (check the sampler and any custom rollout_func)."
        )


def check_completions(
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    name: str = "old_per_token_logps",
) -> None:
    """Completion ids, mask and rollout logprobs (`name` in the batch) align token for token; logprobs are finite
    wherever they count (`loss_mask`, default the completion mask: tool or environment tokens were not sampled and
    carry none)."""
    if completion_mask.shape != completion_ids.shape:
        raise RolloutIntegrityError(
            f"completion_mask: shape {tuple(completion_mask.shape)} differs from completion_ids "
            f"{tuple(completion_ids.shape)}; the mask needs one entry per completion token."
        )
    if logprobs.shape != completion_ids.shape:
        raise RolloutIntegrityError(
            f"{name}: shape {tuple(logprobs.shape)} differs from completion_ids "
            f"{tuple(completion_ids.shape)}; the rollout must return one logprob per generated token."
        )
    mask = completion_mask.bool()
    holes = (mask[:, 1:] & ~mask[:, :-1]).any(dim=1)
    if holes.any():
        row = int(holes.nonzero()[0])
        raise RolloutIntegrityError(
            f"completion_mask: row {row} has active tokens after padding; completions must be right-padded."
        )
    counted = mask if loss_mask is None else loss_mask.bool()
    bad = counted & ~torch.isfinite(logprobs)
    if bad.any():
        row, col = (int(i) for i in bad.nonzero()[0])
        raise RolloutIntegrityError(
            f"{name}: value {logprobs[row, col].item()} at completion {row}, token {col} is "
            "not finite; the rollout engine must return a logprob for every sampled token (for vLLM, request "
            "logprobs of the sampled tokens)."
        )
