"""Checks of a DAPOTrainer set-up that need no model: the config, the reward functions (and their names) and the
datasets.

`DAPOTrainer.__init__` runs `check_set_up` before TRL loads any model, and a script that builds or warm-starts its
model itself (the math recipe) calls it before doing so: a typo costs seconds, not a model load. What a collection
strategy needs is its own `check` (`collection/collect.py`), called from here; it sits beside `trainer.py` because it
checks what every sub-package needs. Where the trainer resolves what these functions check, with what only the built
trainer knows (reward functions an environment adds, whether the rollout engine serves the model), it checks again.
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from datasets import IterableDataset
from torch import nn
from trl.trainer.utils import get_callable_name, get_config_model_id

from ..rewards.columns import check_reward_columns
from ..rewards.overlong import OVERLONG_REWARD_NAME, TRL_OVERLONG_REWARD_NAME
from ..text import plural
from .collection import (
    check_rollout_precision,
    check_vllm_set_up,
    collection_strategy,
    unusable_engine,
    why_settings_rule_out_engine,
)
from .configuration import DAPOConfig, check_dataset_prompts, short_repr


def reward_function_names(reward_funcs: Any, args: DAPOConfig) -> list[str]:
    """The names TRL gives `reward_funcs` (a hub id or path, a model, a callable, or a list of them), then DAPO's
    overlong penalty when it is on."""
    names = [_reward_name(function) for function in _as_list(reward_funcs)]
    return [*names, OVERLONG_REWARD_NAME] if args.overlong_buffer_len > 0 else names


def filter_column(metric: str | None, names: Sequence[str], dynamic_sampling: bool) -> int | None:
    """The reward column dynamic sampling filters on: `metric` names exactly one of `names`, or is `"reward"` for
    the weighted total (None is returned). None takes the one task reward function, the overlong penalties (DAPO's
    and TRL's) aside: DAPO filters on accuracy, not on the shaped reward; with several, which one is the task's
    accuracy is the user's to say, not a guess by order."""
    if metric is None:
        task = [name for name in names if name not in (OVERLONG_REWARD_NAME, TRL_OVERLONG_REWARD_NAME)]
        if dynamic_sampling and len(task) > 1:
            raise ValueError(
                f"DAPOConfig.dynamic_sampling_metric is None, but there are {len(task)} reward functions ({task}): "
                "say which reward dynamic sampling filters on, the task's accuracy as DAPO does (e.g. "
                f"dynamic_sampling_metric={task[-1]!r}), or 'reward' for the weighted total; or set "
                "dynamic_sampling=False to train every group as GRPO does."
            )
        return list(names).index(task[0]) if task else 0
    if metric == "reward":
        return None
    if metric not in names:
        raise ValueError(
            f"DAPOConfig.dynamic_sampling_metric={short_repr(metric)} names no reward function; use one of {list(names)} or "
            "'reward' for the weighted total."
        )
    if list(names).count(metric) > 1:
        raise ValueError(
            f"DAPOConfig.dynamic_sampling_metric={metric!r} names {list(names).count(metric)} reward functions "
            f"({list(names)}): which one to filter on is ambiguous. Give the one to filter on its own name (a `def` "
            "function, or `functools.wraps`/`__name__` on a lambda or partial) and name it here, or leave the field "
            "None to filter on the first."
        )
    return list(names).index(metric)


def check_datasets(
    args: DAPOConfig,
    train_dataset: Any,
    eval_dataset: Any,
    processes: int,
    prompts_from_environment: bool,
    reward_funcs: Sequence[tuple[str, Any]] = (),
) -> None:
    """Prompts must be there (each row's too), enough for one generation batch (the sampler yields whole generation batches only, so
    a smaller set would train 0 steps), and an evaluation set must not be empty (it would evaluate on 0 samples); the
    `(name, function)` reward functions find the columns they require (`rewards/columns.py`)."""
    named = {"train_dataset": train_dataset} if train_dataset is not None else {}
    evaluated = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    for key, dataset in evaluated:
        if dataset is None:
            continue
        name = "eval_dataset" if key is None else f"eval_dataset[{key!r}]"
        if _is_empty(dataset):
            raise ValueError(
                f"{name} is empty: evaluation would run on 0 prompts. Pass prompts to evaluate on, or leave it out "
                "(eval_dataset=None, eval_strategy='no')."
            )
        named[name] = dataset
    if not prompts_from_environment:  # an environment supplies the prompts otherwise
        for name, dataset in named.items():
            columns = _column_names(dataset)
            if columns is not None and "prompt" not in columns:
                raise ValueError(
                    f"{name} has no 'prompt' column (columns: {columns}); DAPOTrainer, like GRPOTrainer, reads "
                    "each prompt from it: rename the column holding the prompts to 'prompt'."
                )
            if columns is not None and hasattr(dataset, "__len__"):  # a stream's prompts are checked per batch
                check_dataset_prompts(name, dataset)
            if columns is not None:
                check_reward_columns(reward_funcs, name, columns)
    if train_dataset is None:
        return
    needed = args.generation_batch_size // args.num_generations
    if hasattr(train_dataset, "__len__"):
        size = len(train_dataset)
    else:
        size = sum(1 for _ in itertools.islice(train_dataset, needed))
    if size < needed:
        raise ValueError(
            f"train_dataset has {plural(size, 'prompt')}, fewer than one generation batch takes: "
            f"{plural(needed, 'prompt')} = "
            f"generation_batch_size ({args.generation_batch_size} completions = per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {processes} processes x steps_per_generation "
            f"{args.steps_per_generation}) / num_generations ({args.num_generations}). The sampler yields whole "
            "generation batches only, so training would run 0 steps: use more prompts, or lower "
            "per_device_train_batch_size, steps_per_generation or the number of processes."
        )


def check_set_up(
    args: DAPOConfig,
    reward_funcs: Any,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    tools: list[Callable] | None = None,
    rollout_func: Callable | None = None,
    environment_factory: Any = None,
) -> None:
    """Everything the config, the reward functions and the datasets decide, checked before any model is loaded;
    `DAPOTrainer`'s arguments of the same names. Raises a `ValueError` naming the field (or function) and the fix;
    with `use_vllm`, an `ImportError` without vLLM and a `ConnectionError` for a server that does not answer."""
    names = reward_function_names(reward_funcs, args)
    functions = len(_as_list(reward_funcs))
    if args.reward_weights is not None and len(args.reward_weights) != functions:
        raise ValueError(
            f"DAPOConfig.reward_weights={short_repr(args.reward_weights)} has {len(args.reward_weights)} weights for {functions} "
            f"reward functions ({names[:functions]}): give one weight per reward function (the overlong penalty "
            "weighs 1 and takes none)."
        )
    check_one_overlong_penalty(args, names[:functions])
    if environment_factory is None:  # an environment may add reward functions, named once it is built
        filter_column(args.dynamic_sampling_metric, names, args.dynamic_sampling)
    calls_tools = bool(tools) or environment_factory is not None  # an environment's methods are its tools
    if args.rollout_engine == "paged":
        reason = why_settings_rule_out_engine(args, rollout_func, calls_tools)
        if reason is not None:
            raise unusable_engine(args.rollout_engine, reason)
    check_rollout_precision(args, rollout_func, calls_tools)
    collection_strategy(args).check(args, _as_list(reward_funcs), names, rollout_func, calls_tools)
    # the overlong penalty, named last, reads no column; a rollout_func may hand the reward functions fields of its own
    functions = list(zip(names, _as_list(reward_funcs), strict=False)) if rollout_func is None else []
    check_datasets(args, train_dataset, eval_dataset, args.world_size, environment_factory is not None, functions)
    check_output_dir(args)
    check_vllm_set_up(args)  # last: it may wait up to vllm_server_timeout for a server


def check_one_overlong_penalty(args: DAPOConfig, task_names: Sequence[str]) -> None:
    """TRL's soft overlong punishment among the reward functions while DAPOConfig's own is on (its default) would
    penalise every long completion twice: a GRPO script that used TRL's would silently double it."""
    if args.overlong_buffer_len > 0 and TRL_OVERLONG_REWARD_NAME in task_names:
        raise ValueError(
            f"reward_funcs holds TRL's {TRL_OVERLONG_REWARD_NAME} (trl.rewards.get_soft_overlong_punishment) while "
            f"DAPOConfig's own overlong reward shaping is on (overlong_buffer_len={args.overlong_buffer_len}; "
            "None takes a fifth of max_completion_length), so every long completion would be penalised twice. "
            "Keep one: set overlong_buffer_len=0 to keep TRL's, or remove it from reward_funcs and set "
            "overlong_buffer_len to its soft_punish_cache (the same penalty, up to max_completion_length)."
        )


def check_output_dir(args: DAPOConfig) -> None:
    """Checkpoints can be written into `output_dir` (a write tried in it, or in the nearest folder above it that
    exists): a read-only one failed only at the first save, after the steps before it had run."""
    if args.save_strategy == "no":
        return
    folder = Path(args.output_dir).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"DAPOConfig.output_dir={args.output_dir!r} cannot be written: creating a file in {str(folder)!r} failed "
            f"({error.strerror}), so the first checkpoint would fail. Choose a writable folder, or "
            "save_strategy='no'."
        ) from error


def _as_list(reward_funcs: Any) -> list:
    if reward_funcs is None:
        return []
    return list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]


def _reward_name(function: Any) -> str:
    """As TRL names it: a reward model by its model id's last part, a callable by its name."""
    if isinstance(function, str):
        return function.split("/")[-1]
    if isinstance(function, nn.Module):
        return get_config_model_id(function.config).split("/")[-1]
    return get_callable_name(function)


def _is_empty(dataset: Any) -> bool:
    if hasattr(dataset, "__len__"):
        return len(dataset) == 0
    return next(iter(dataset), None) is None


def _column_names(dataset: Any) -> list[str] | None:
    """A dataset's columns, from its features or (a stream without known features) its first row."""
    names = getattr(dataset, "column_names", None)
    if names is None and isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        names = list(first) if isinstance(first, dict) else None
    return None if names is None else list(names)
