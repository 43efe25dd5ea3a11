"""An optimizer step whose loss or gradient is not finite is skipped: parameters and optimizer state unchanged, counted
in `dapo/nonfinite_steps`, said in a warning naming the step. The step counter advances, and so does the learning-rate
schedule (but under DeepSpeed, which holds it back on an overflow), as for a step skipped without rows. So a NaN never
reaches the weights, nor a checkpoint; and a save finding non-finite weights all the same (a finite update that
overflowed) stops with an error rather than write them.

A callback, not a Trainer hook: `on_pre_optimizer_step` runs once the step's gradients are complete (reduced across
ranks, clipped) and before `optimizer.step()`. Every rank decides alike (the flags are reduced: a loss is per rank, an
FSDP gradient a shard), and drops every `.grad`, which torch's optimizers then leave alone, AdamW's weight decay and
moments included. Where another component already skips such a step, it keeps that role:

- DeepSpeed steps inside the step's last backward, and its overflow check skips a step whose gradient norm is not
  finite (counted here after it); a non-finite loss suspends its update before that backward (`deepspeed_skip.py`).
- fp16's gradient scaler skips a step with non-finite gradients and lowers its scale (its calibration, not counted);
  it cannot step without gradients, so a non-finite loss with finite gradients stops training with an error.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import TrainerCallback

from ..training import skip_next_update

logger = logging.getLogger(__name__)


class FiniteSteps(TrainerCallback):
    """Skips the optimizer steps whose loss or gradient is not finite; `skipped_steps` counts them."""

    def __init__(self, accelerator: Accelerator, fp16: bool) -> None:
        self.accelerator = accelerator
        self.fp16 = fp16
        self.skipped_steps = 0
        self._loss_not_finite: torch.Tensor | None = None  # this rank's, since the step began

    def record_loss(self, loss: torch.Tensor, ends_step: bool, step: int) -> None:
        """A micro-batch's training loss (every pass's), kept for its optimizer step's check without a host
        synchronisation. Under DeepSpeed the step's last one is checked now, before the backward that steps."""
        bad = ~torch.isfinite(loss.detach())
        self._loss_not_finite = bad if self._loss_not_finite is None else self._loss_not_finite | bad
        deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if ends_step and deepspeed and self._any_rank(self._take_loss_flag())[0]:
            skip_next_update(self.accelerator.deepspeed_engine_wrapped.engine)
            self._skipped(step, "loss")

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs: Any) -> None:
        step = state.global_step + 1
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:  # its step is taken: was it skipped?
            if not self.fp16 and not self.accelerator.deepspeed_engine_wrapped.engine.was_step_applied():
                self._skipped(step, "gradient")
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # an FSDP gradient: this shard
        grad_finite = torch.stack([g.isfinite().all() for g in local]).all() if local else torch.tensor(True)
        loss_bad, grad_bad = self._any_rank(self._take_loss_flag(), ~grad_finite)
        if not (loss_bad or grad_bad):
            return
        if self.accelerator.scaler is not None:
            if grad_bad:
                return  # the scaler skips it and lowers its scale
            raise FloatingPointError(
                f"Optimizer step {step}: the loss is not finite while the gradients are, and fp16's gradient scaler "
                "cannot skip a step without gradients. Use bf16, or find what made the loss non-finite (the "
                "rewards, the rollout logprobs) in the step's logs."
            )
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None
        self._skipped(step, "loss" if loss_bad else "gradient")

    def check_weights(self, model: torch.nn.Module, step: int) -> None:
        """Before a checkpoint is written: every weight finite (on every rank), or an error naming the step."""
        if name := self._nonfinite_weight(model):
            raise FloatingPointError(
                f"After optimizer step {step} the weights hold non-finite values ({name}; an update overflowed): no "
                "checkpoint is written. Resume from the last checkpoint with a lower learning_rate, or with "
                "max_grad_norm set."
            )

    def check_resumed_weights(self, model: torch.nn.Module, checkpoint: str) -> None:
        """Once a resumed checkpoint is loaded: every weight finite, or an error naming the checkpoint, before
        sampling fails on them with "probability tensor contains inf/nan"."""
        if name := self._nonfinite_weight(model):
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} holds non-finite weights ({name}): the checkpoint is damaged "
                "or was written by a run whose update overflowed. Resume from an earlier checkpoint."
            )

    def _nonfinite_weight(self, model: torch.nn.Module) -> str | None:
        """A weight holding NaN or inf on any rank: this rank's first such parameter by name (another rank's: "a
        parameter on another rank"), or None where every weight is finite."""
        local = [(n, p.detach()) for n, p in model.named_parameters() if p.numel()]
        local = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in local]
        finite = torch.stack([p.isfinite().all() for _, p in local]).all() if local else torch.tensor(True)
        if not self._any_rank(~finite)[0]:
            return None
        return next((n for n, p in local if not p.isfinite().all()), "a parameter on another rank")

    def _take_loss_flag(self) -> torch.Tensor:
        flag = self._loss_not_finite if self._loss_not_finite is not None else torch.tensor(False)
        self._loss_not_finite = None
        return flag

    def _any_rank(self, *flags: torch.Tensor) -> list[bool]:
        """Each flag, True where it is on any rank (one reduction, one host synchronisation)."""
        local = torch.stack([flag.to(self.accelerator.device) for flag in flags]).int()
        if self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local, reduction="max")
        return [bool(value) for value in local.tolist()]

    def _skipped(self, step: int, what: str) -> None:
        self.skipped_steps += 1
        if self.accelerator.is_main_process:
            logger.warning(
                "Optimizer step %d: the %s is not finite; the step is skipped (parameters and optimizer state "
                "unchanged, the step counted). %d such steps so far, logged as dapo/nonfinite_steps.",
                step,
                what,
                self.skipped_steps,
            )
