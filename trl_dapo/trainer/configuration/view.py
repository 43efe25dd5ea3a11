"""`TRLView`: the built trainer as the rounds and the training passes see it, plain values and callables.

`trl_view.view_of` fills it in from a `DAPOTrainer` (the one place besides `trainer.py` that reads TRL's private
names); it lives here, below both of its readers, so that they are built and tested without a trainer and never
import the trainer's side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from transformers import TrainerState


@dataclass(frozen=True)
class TRLView:
    """What the training passes and the rounds read of the trainer. Callables where the Trainer replaces the object
    while it runs (it wraps the model and rebuilds its state when training starts)."""

    args: Any  # the DAPOConfig
    accelerator: Accelerator
    num_generations: int
    pad_token_id: int  # TRL's tokenizer's (`_tokenizer`: the processing class's own tokenizer)
    metrics: dict[str, dict[str, list[float]]]  # TRL's `_metrics`: per mode, the values its next `log` averages
    model: Callable[[], torch.nn.Module]  # the training module (not a DDP or DeepSpeed wrapper)
    base_model: Callable[[], torch.nn.Module]  # the transformers model: no DDP, DeepSpeed or PEFT wrapper
    state: Callable[[], TrainerState]
    generate_and_score: Callable[[list[dict[str, Any]]], dict[str, Any]]  # TRL's `_generate_and_score_completions`
    padded_logprobs: Callable[..., tuple]  # GRPOTrainer's own `_get_per_token_logps_and_entropies`, not the override
    is_vlm: bool  # TRL's `_is_vlm`
    # the Trainer's own deferral of gradient reduction, for a model transformers sharded with FSDP at load; else None
    defer_fsdp_reduction: Callable[[], Any] | None

    def step(self) -> int:
        """Optimizer steps taken: the weights in force are those after this many updates."""
        return self.state().global_step
