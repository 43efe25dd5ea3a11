"""The batch sizes of a `DAPOConfig` on this number of processes: each generation batch (and each evaluation batch)
holds whole groups of `num_generations`, and a generation batch given in completions splits into whole optimizer
steps. TRL's own errors for either name neither the field to change nor the values that work; these do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from transformers import TrainingArguments

from .field_rules import invalid_value


@dataclass
class GenerationBatchCheck(TrainingArguments):
    """Runs between `TrainingArguments.__post_init__` (which sets up the processes, so the world size is known) and
    the rest of `GRPOConfig.__post_init__` (which derives `generation_batch_size` and, when it holds no whole number
    of groups, raises an error naming neither field to change). In `DAPOConfig`'s method resolution order this class
    sits between `GRPOConfig` and `TrainingArguments`, so GRPOConfig's `super().__post_init__()` lands here."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_whole_groups(self)


def check_whole_groups(config: Any) -> None:
    """Each generation batch (and each evaluation batch) must hold whole groups of `num_generations`: say which
    field to change, with values that work on this number of processes."""
    groups, world = config.num_generations, config.world_size
    step_rows = config.per_device_train_batch_size * world
    if config.generation_batch_size is not None and config.steps_per_generation is None:
        if config.generation_batch_size % groups:
            raise invalid_value(
                "generation_batch_size",
                config.generation_batch_size,
                f"use a multiple of num_generations ({groups}).",
            )
        _check_optimizer_steps_fit(config)
    else:
        steps = config.steps_per_generation or config.gradient_accumulation_steps
        if step_rows * steps % groups:
            rows_multiple = groups // math.gcd(groups, world * steps)
            steps_multiple = math.lcm(config.gradient_accumulation_steps, groups // math.gcd(groups, step_rows))
            raise invalid_value(
                "per_device_train_batch_size",
                config.per_device_train_batch_size,
                f"a generation batch holds per_device_train_batch_size ({config.per_device_train_batch_size}) x "
                f"processes ({world}) x steps_per_generation ({steps}) = {step_rows * steps} completions, not "
                f"whole groups of num_generations={groups}. Set per_device_train_batch_size to a multiple of "
                f"{rows_multiple} (the default 16 always works with num_generations=16), or steps_per_generation "
                f"to a multiple of {steps_multiple}, or num_generations to a divisor of {step_rows * steps}.",
            )
    eval_groups = config.num_generations_eval or groups
    eval_rows = config.per_device_eval_batch_size * world
    if config.do_eval and config.eval_strategy != "no" and eval_rows % eval_groups:
        raise invalid_value(
            "per_device_eval_batch_size",
            config.per_device_eval_batch_size,
            f"an evaluation batch holds per_device_eval_batch_size x processes ({world}) = {eval_rows} "
            f"completions, not whole groups of {eval_groups} (num_generations_eval, else num_generations); use a "
            f"multiple of {eval_groups // math.gcd(eval_groups, world)}.",
        )


def _check_optimizer_steps_fit(config: Any) -> None:
    """A generation batch given in completions must split into whole optimizer steps on this number of processes
    (TRL's own error names neither the field to change nor the process counts that work)."""
    rows, world = config.generation_batch_size, config.world_size
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
    if rows % (per_step * world) == 0:
        return
    fixes = [
        f"generation_batch_size to a multiple of {math.lcm(per_step * world, config.num_generations)}",
    ]
    split = world * config.gradient_accumulation_steps
    if rows % split == 0:
        fixes.append(f"per_device_train_batch_size to a divisor of {rows // split}")
    elif rows >= math.lcm(split, config.num_generations):  # no micro-batch size splits it: the nearest batch that does
        near = rows // math.lcm(split, config.num_generations) * math.lcm(split, config.num_generations)
        fixes.append(f"generation_batch_size={near} with per_device_train_batch_size a divisor of {near // split}")
    steps_per_process = rows // per_step if rows % per_step == 0 else 0
    counts = [count for count in range(1, steps_per_process + 1) if steps_per_process % count == 0]
    runs_on = f"; unchanged, these settings run on {_joined(counts)} processes" if counts else ""
    raise invalid_value(
        "generation_batch_size",
        rows,
        f"its {rows} completions must split into whole optimizer steps of per_device_train_batch_size "
        f"({config.per_device_train_batch_size}) x gradient_accumulation_steps ({config.gradient_accumulation_steps}) "
        f"x processes ({world}) = {per_step * world} completions. On {world} processes set {' or '.join(fixes)}"
        f"{runs_on}.",
    )


def check_steps_per_generation(config: Any) -> None:
    """Once TRL derived `steps_per_generation`: a whole number of optimizer steps per generation batch."""
    if config.steps_per_generation % config.gradient_accumulation_steps != 0:
        raise invalid_value(
            "steps_per_generation",
            config.steps_per_generation,
            f"it must be a multiple of gradient_accumulation_steps ({config.gradient_accumulation_steps}) so every "
            "optimizer step draws its micro-batches from one generation batch and its token count is known.",
        )


def check_batch_unchanged(config: Any) -> None:
    """`generation_batch_size`, which TRL derived when the config was built, still matches the batch fields (a
    notebook may have changed one since)."""
    rows = config.per_device_train_batch_size * config.world_size * config.steps_per_generation
    if config.generation_batch_size != rows:
        raise invalid_value(
            "generation_batch_size",
            config.generation_batch_size,
            f"TRL derived it when the config was built, and per_device_train_batch_size "
            f"({config.per_device_train_batch_size}) x processes ({config.world_size}) x steps_per_generation "
            f"({config.steps_per_generation}) = {rows} now: a batch field changed since. Build a new DAPOConfig "
            "with the batch sizes you want.",
        )


def _joined(counts: list[int]) -> str:
    """1, 2 or 4."""
    names = [str(count) for count in counts]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
