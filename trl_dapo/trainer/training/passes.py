"""The training side of `DAPOTrainer`: a generation batch's micro-batches and passes, each pass's forward (packed or
padded), the old policy's recomputation, and each pass's DAPO loss, backward and metrics.

The trainer's hooks hand their work here: `_prepare_inputs` the collected batch (`micro_batches`),
`_get_per_token_logps_and_entropies` every logprob forward (`logprobs`), `_compute_loss` a micro-batch or an
evaluation batch (`loss`). Padding-free passes are `docs/design.md`'s "Padding-free training".
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from accelerate.utils import DistributedType
from trl.models.utils import disable_gradient_checkpointing

from ...rollout_batch import OLD_LOGPROBS_STEP, RolloutBatch, count_loss_tokens, loss_mask
from .batch_metrics import append_metrics
from .deepspeed_skip import skip_next_update
from .loss import active_mean, dapo_policy_loss
from .micro_batches import MicroBatch, split_generation_batch
from .mismatch import RolloutCorrection, mismatch_metrics, rollout_correction
from .packed_attention import attention_for_packing, forward_packed, why_model_cannot_pack
from .packing import pack_rows, unpack_scores
from .step_metrics import StepMetrics

if TYPE_CHECKING:
    from ..configuration import TRLView

logger = logging.getLogger(__name__)


def set_up_padding_free(view: TRLView) -> bool:
    """Whether the training passes run packed (`padding_free`; None: where flash attention runs); where the model
    cannot, say why once. The model's attention is switched only while the trainer runs (`TrainingPasses.attention`)."""
    args, accelerator = view.args, view.accelerator
    model = view.base_model()
    half = args.bf16 or args.fp16 or model.dtype in (torch.bfloat16, torch.float16)
    reason = why_model_cannot_pack(model, view.is_vlm)
    if args.use_transformers_continuous_batching:
        reason = "transformers' continuous batching generates through the model's own attention implementation"
    if args.padding_free is None and not (accelerator.device.type == "cuda" and half):
        reason = "padding_free=None packs where flash attention runs (CUDA with bf16 or fp16)"
    if reason is None and args.padding_free is not False:
        return True
    if args.padding_free is not False and accelerator.is_main_process:
        cap = args.padding_free_max_tokens
        unused = (
            f" DAPOConfig.padding_free_max_tokens={cap} does not apply: it caps padding-free passes." if cap else ""
        )
        # on a GPU padded passes take several times as long at DAPO's lengths (docs/performance.md): a warning there
        expected = args.padding_free is None and accelerator.device.type != "cuda" and not cap
        logger.log(logging.INFO if expected else logging.WARNING, "Training passes are padded: %s.%s", reason, unused)
    return False


class TrainingPasses:
    """What the trainer trains on and how: built once from the trainer's view (its arguments, accelerator, model,
    TRL's padded logprob pass, its metrics), DAPO's clip bounds (`clips`: `epsilon_low`, `epsilon_high`,
    `clip_ratio_c`) and TRL's router loss coefficient (None: no router term); `skipped_steps` counts the optimizer
    steps that had no rows."""

    def __init__(
        self,
        view: TRLView,
        padding_free: bool,
        clips: dict[str, float | None],
        router_aux_loss_coef: float | None,
        num_iterations: int,
    ) -> None:
        self.padding_free = padding_free
        self.args, self.accelerator, self.metrics = view.args, view.accelerator, view.metrics
        self.pad_token_id = view.pad_token_id
        self.padded_logprobs = view.padded_logprobs
        self.model = view.model  # the module, for no-grad passes (not a DDP or DeepSpeed wrapper)
        self.base_model = view.base_model
        self.step = view.step
        self.clips = clips
        self.router_aux_loss_coef = router_aux_loss_coef
        self.num_iterations = num_iterations
        self.defer_fsdp_reduction = view.defer_fsdp_reduction
        self.skipped_steps = 0

    def attention(self) -> contextlib.AbstractContextManager:
        """What training and evaluation run under: padding-free, the model's attention through the packed dispatcher,
        set back when they end (the model is the caller's)."""
        return attention_for_packing(self.base_model()) if self.padding_free else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------- micro-batches

    def micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """Deal the global generation batch's rows to this rank's micro-batches and passes (`micro_batches.py`):
        padding-free by tokens, else by rows; then the old policy where it is recomputed.

        An optimizer step with no rows at all (dynamic sampling trained on a partial batch), or whose rows have no
        loss token (every completion masked: truncated under `mask_truncated_completions`), is skipped: no gradient
        reaches the parameters (`.grad` stays None), so torch's optimizers leave them and their state alone (a zero
        gradient would not: AdamW's weight decay and momentum); it is counted in `dapo/skipped_steps` (under
        DeepSpeed, whose optimizers would step zero gradients, its update is suspended for that step:
        `deepspeed_skip.py`). fp16's gradient scaler cannot skip one and refuses it."""
        args, accumulation = self.args, self.args.gradient_accumulation_steps
        optimizer_steps = args.steps_per_generation // accumulation
        # each row's loss tokens and (padding-free: its cost) its tokens, in one host synchronisation
        counts = [loss_mask(batch).sum(dim=1)]
        if self.padding_free:
            counts.append(batch["prompt_mask"].sum(dim=1) + batch["completion_mask"].sum(dim=1))
        loss_tokens, *costs = torch.stack([count.long() for count in counts]).tolist()
        micro_batches = split_generation_batch(
            batch,
            rank=self.accelerator.process_index,
            world=self.accelerator.num_processes,
            optimizer_steps=optimizer_steps,
            micro_batches=accumulation,
            costs=costs[0] if costs else None,
            loss_tokens=loss_tokens,
            max_tokens=args.padding_free_max_tokens if self.padding_free else None,
            generator=torch.Generator().manual_seed(args.seed + self.step()),
        )
        self._with_old_policy(micro_batches)
        empty_steps = self.num_iterations * sum(
            not any(mb.passes for mb in micro_batches[start : start + accumulation])
            for start in range(0, len(micro_batches), accumulation)
        )
        if empty_steps and self.accelerator.scaler is not None:
            raise ValueError(
                "An optimizer step of this generation batch has no rollout row (dynamic sampling found no informative "
                "group) or no loss token (every completion masked) and is skipped, but fp16's gradient scaler cannot "
                "step without gradients. Use bf16, or dynamic_sampling_on_limit='raise'."
            )
        if empty_steps and self.accelerator.is_main_process:
            rowless = self.num_iterations * max(0, optimizer_steps - batch["completion_ids"].size(0))
            self._warn_skipped(rowless, empty_steps - rowless, optimizer_steps * self.num_iterations)
        return micro_batches

    def _warn_skipped(self, rowless: int, tokenless: int, steps: int) -> None:
        """Say which optimizer steps of a generation batch (`steps` of them) are skipped, and why."""
        unchanged = (
            "are skipped (parameters and optimizer state unchanged; the step counter and learning-rate schedule "
            "advance). %d skipped before, logged as dapo/skipped_steps."
        )
        if rowless:
            logger.warning(
                "Dynamic sampling found too few informative groups within max_num_gen_batches=%d rounds: %d of the %d "
                "optimizer steps of this generation batch have no rollout rows and " + unchanged,
                self.args.max_num_gen_batches,
                rowless,
                steps,
                self.skipped_steps,
            )
        if tokenless:
            logger.warning(
                "%d of the %d optimizer steps of this generation batch have rows but no loss token (every completion "
                "masked: truncated under mask_truncated_completions=True, or tool output only) and " + unchanged,
                tokenless,
                steps,
                self.skipped_steps,
            )

    def _with_old_policy(self, micro_batches: list[MicroBatch]) -> None:
        """With `old_logprobs="recompute"`, this rank's rows get the training model's logprobs under the current
        weights as their old policy, before any update of the generation batch. Rows whose logprobs a pass of this
        step's rounds already computed keep them (never computed twice); the others (engine, vLLM or rollout_func
        rounds, surplus groups of an earlier step) get a no-grad forward over the training passes that hold them.

        A pass is run where any rank's pass holds such a row, by every rank (every rank has as many passes): a
        sharded model (ZeRO-3, FSDP) gathers its weights in each forward, with every rank taking part."""
        if self.args.old_logprobs != "recompute":
            return
        passes = [rows for micro_batch in micro_batches for rows in micro_batch.passes]
        stale = [rows.pop(OLD_LOGPROBS_STEP) != self.step() for rows in passes]
        if not passes:  # no rank has a pass: the generation batch is empty everywhere
            return
        local = torch.stack([row_stale.any() for row_stale in stale]).int()
        needed = self.accelerator.reduce(local, reduction="max").bool().tolist()
        for rows, row_stale, run in zip(passes, stale, needed, strict=True):
            if run:
                old = rows["old_per_token_logps"]
                logps = self.no_grad_logprobs(rows, batch_size=None).to(old.dtype)
                rows["old_per_token_logps"] = torch.where(loss_mask(rows).bool() & row_stale.unsqueeze(1), logps, old)

    def no_grad_logprobs(self, batch: RolloutBatch, batch_size: int | None) -> torch.Tensor:
        """The training model's logprobs of the completion tokens: no-grad forwards of at most `batch_size` rows
        (padding-free: `padding_free_max_tokens` tokens when set; None: one forward, for a planned pass)."""
        model = self.model()
        input_ids, attention_mask, width = forward_inputs(batch)
        with torch.no_grad(), disable_gradient_checkpointing(model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self.logprobs(model, input_ids, attention_mask, width, batch_size=batch_size)
        return logps

    # ------------------------------------------------------------------------------------------------ forwards

    def logprobs(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's per-token logprobs and entropies of the last `logits_to_keep` columns; padding-free, the rows of
        each forward are packed (`packing.py`) and the values come back in TRL's padded layout. Forwards hold
        `batch_size` rows (`padding_free_max_tokens` tokens when set; None: all rows in one)."""
        if not self.padding_free or any(value is not None for value in multimodal.values()):
            return self.padded_logprobs(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        logps, entropies, aux_losses = [], [], []
        for rows in self._packed_chunks(attention_mask, batch_size):
            if rows is None:  # another rank runs one more forward
                self._packed_forward(model, *forward_inputs(self._empty_pass()), compute_aux_loss)
                continue
            chunk_logps, chunk_entropies, aux_loss = self._packed_forward(
                model, input_ids[rows], attention_mask[rows], logits_to_keep, compute_aux_loss
            )
            logps.append(chunk_logps)
            entropies.append(chunk_entropies)
            aux_losses.append(aux_loss)
        return (
            torch.cat(logps),
            torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,
        )

    def _packed_chunks(self, attention_mask: torch.Tensor, batch_size: int | None) -> list[slice | None]:
        """The rows of each packed forward, in order. `batch_size` None: one forward (a pass the step's plan sized).
        Else `batch_size` rows a forward, as TRL's passes over a round's rows, whose counts match on every rank; with
        `padding_free_max_tokens`, forwards cut by tokens instead, and None for an empty forward that keeps this
        rank's forward count equal to the other ranks'."""
        rows, cap = attention_mask.size(0), self.args.padding_free_max_tokens
        if batch_size is None:
            return [slice(0, rows)]
        if cap is None:
            return [slice(start, min(start + batch_size, rows)) for start in range(0, rows, batch_size)]
        bounds, tokens = [0], 0
        for row, length in enumerate(attention_mask.sum(dim=1).tolist()):
            if tokens and tokens + length > cap:
                bounds.append(row)
                tokens = 0
            tokens += length
        bounds.append(rows)
        chunks: list[slice | None] = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        if self.accelerator.num_processes > 1:
            most = int(self.accelerator.reduce(torch.tensor(len(chunks), device=attention_mask.device), "max"))
            chunks += [None] * (most - len(chunks))
        return chunks

    def _packed_forward(self, model, input_ids, attention_mask, logits_to_keep, compute_aux_loss):
        """One packed forward through TRL's fused head (log-probabilities and entropy in chunks of tokens, never the
        full-vocabulary logits; its temperature and `cast_lm_head_to_fp32`)."""
        packed = pack_rows(input_ids, attention_mask, logits_to_keep)
        router = {"output_router_logits": True} if compute_aux_loss else {}
        with self.accelerator.autocast():
            outputs = forward_packed(model, packed, **router)
        return (
            unpack_scores(outputs.log_probs, packed, logits_to_keep),
            unpack_scores(outputs.entropy, packed, logits_to_keep),
            outputs.aux_loss,
        )

    def _empty_pass(self) -> RolloutBatch:
        """One row of a pad token prompt and a pad token completion, nothing counted: the forward a rank runs when
        another rank has one more pass, trained (with zero weight) where DeepSpeed needs a backward."""
        pad = torch.full((1, 1), self.pad_token_id, device=self.accelerator.device)
        ones = torch.ones_like(pad)
        advantages = torch.zeros(1, device=self.accelerator.device)
        rows = {"prompt_ids": pad, "prompt_mask": ones, "completion_ids": pad, "completion_mask": ones}
        return {**rows, "advantages": advantages}

    # ---------------------------------------------------------------------------------------------------- loss

    def loss(self, model, inputs: MicroBatch | RolloutBatch) -> torch.Tensor:
        """A micro-batch's loss: every pass but the last has its backward here (the Trainer's backward takes the
        last); its step's metrics are logged after the step's last micro-batch. An evaluation batch (TRL's) is its
        own step, one pass."""
        if not isinstance(inputs, MicroBatch):
            metrics = StepMetrics()
            step_tokens = self.accelerator.reduce(count_loss_tokens(inputs).float(), "sum")
            loss = self._pass_loss(model, inputs, step_tokens, metrics, weight=1.0, aux_weight=1.0, mode="eval")
            append_metrics(self.metrics["eval"], metrics.flush(self.accelerator))
            return loss
        if not inputs.passes and self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # A micro-batch no rank has rows for. DeepSpeed reduces gradients in every backward and needs some: a
            # zero-weight stand-in pass gives every parameter its zero gradient (on every rank: a ZeRO-3 forward is a
            # collective); a step made only of these has its update suspended below.
            loss = self._pass_loss(model, self._empty_pass(), inputs.step_tokens, inputs.metrics, 0.0, 0.0)
        elif not inputs.passes:
            # No forward pass and no gradient reaching the parameters: an optimizer step made only of these leaves
            # `.grad` None, so torch's optimizers leave the parameters and their state as they were.
            loss = torch.zeros((), device=self.accelerator.device, requires_grad=True)
        else:
            earlier = torch.zeros((), device=self.accelerator.device)
            for index, (rows, empty) in enumerate(zip(inputs.passes, inputs.empty, strict=True)):
                last = index == len(inputs.passes) - 1
                with contextlib.nullcontext() if last else self._deferred_gradient_sync(model):
                    weight = 0.0 if empty else 1.0
                    aux_weight = weight / inputs.step_passes
                    loss = self._pass_loss(model, rows, inputs.step_tokens, inputs.metrics, weight, aux_weight)
                    if not last:
                        self.accelerator.backward(loss, **self._backward_kwargs())
                        earlier = earlier + loss.detach()
            loss = loss + earlier  # the Trainer's backward reaches the last pass only; its log sees them all
        if inputs.ends_step and inputs.step_passes:
            append_metrics(self.metrics["train"], inputs.metrics.flush(self.accelerator))
        elif inputs.ends_step:
            self.skipped_steps += 1
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                skip_next_update(self.accelerator.deepspeed_engine_wrapped.engine)
        return loss

    @contextlib.contextmanager
    def _deferred_gradient_sync(self, model) -> Iterator[None]:
        """Run a pass as the Trainer runs a micro-batch that is not its optimizer step's last: gradients accumulate
        on each rank (DDP / FSDP2 `no_sync`; DeepSpeed: no accumulation boundary, no optimizer step)."""
        state = self.accelerator.gradient_state
        if not state.sync_gradients:  # the Trainer already defers this micro-batch
            yield
            return
        state._set_sync_gradients(False)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            deferred = contextlib.nullcontext()
        elif self.defer_fsdp_reduction is not None and _sharded_at_load(self.model()):
            deferred = self.defer_fsdp_reduction()
        else:
            deferred = self.accelerator.no_sync(model)
        try:
            with deferred:
                yield
        finally:
            state._set_sync_gradients(True)

    def _backward_kwargs(self) -> dict[str, Any]:
        """What the Trainer passes to `accelerator.backward` (its loss carries its own normalisation)."""
        return {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}

    def _pass_loss(
        self,
        model,
        rows: RolloutBatch,
        step_tokens: torch.Tensor,
        metrics: StepMetrics,
        weight: float,
        aux_weight: float,
        mode: str = "train",
    ) -> torch.Tensor:
        """The DAPO loss of one pass's rows against the old policy, normalised by the step's token count, and its
        metrics added to `metrics`, both times `weight` (0: an empty pass's stand-in row, whose forward and backward
        only keep this rank in step with the others)."""
        mask = loss_mask(rows)
        per_token_logps, entropies, aux_loss = self.logprobs(
            model, *forward_inputs(rows), compute_entropy=True, compute_aux_loss=self.router_aux_loss_coef is not None
        )
        policy = self._old_policy(rows, per_token_logps, mask, mode)
        # Each rank divides by its share of the step's global count; DDP's gradient average then gives the
        # exact global token-mean.
        loss, stats = dapo_policy_loss(
            per_token_logps,
            policy.old,
            rows["advantages"],
            mask,
            num_tokens=step_tokens.clamp(min=1.0) / self.accelerator.num_processes,
            token_weights=None if policy.correction is None else policy.correction.weights,
            **self.clips,
        )
        if self.router_aux_loss_coef is not None:
            # TRL's router load-balancing term, averaged over the optimizer step's passes
            aux_loss = aux_loss * aux_weight
            loss = loss + self.router_aux_loss_coef * aux_loss
        mismatch = mismatch_metrics(
            per_token_logps.detach(),
            policy.old,
            policy.sampled,
            rows["advantages"],
            mask,
            recomputed=policy.recomputed,
            correction=policy.correction,
            **self.clips,
        )
        active = mask.bool()
        metrics.add(
            token_means={
                **{name: value for name, value in stats.items() if name != "num_active_tokens"},
                **mismatch.token_means,
                "train_logprobs_mean": active_mean(per_token_logps.detach(), active),
                "entropy": active_mean(entropies.detach(), active),
            },
            tokens=stats["num_active_tokens"] * weight,
            sequence_means=mismatch.sequence_means,
            sequences=mismatch.sequences * weight,
            maxima={name: value * weight for name, value in mismatch.maxima.items()},
            aux_loss=aux_loss.detach() if self.router_aux_loss_coef is not None else None,
        )
        return loss * weight

    def _old_policy(
        self, rows: RolloutBatch, per_token_logps: torch.Tensor, mask: torch.Tensor, mode: str
    ) -> OldPolicy:
        """A pass's old policy (the ratio's denominator), the policy that sampled its tokens, and the rollout
        correction's weights where the old policy was recomputed and a correction is set."""
        args = self.args
        old = rows.get("old_per_token_logps")
        if old is None:  # evaluation batches are scored on-policy
            old = per_token_logps.detach()
        # old_logprobs="recompute": the rollout's logprobs are kept apart (evaluation batches are TRL's own)
        recomputed = mode == "train" and "sampling_per_token_logps" in rows
        sampled = rows["sampling_per_token_logps"] if recomputed else old
        correction = None
        if recomputed and args.rollout_correction is not None:
            correction = rollout_correction(
                old, sampled, mask, args.rollout_correction, args.rollout_correction_max, args.rollout_correction_min
            )
        return OldPolicy(old, sampled, recomputed, correction)


class OldPolicy(NamedTuple):
    """What a pass's loss is taken against: the old policy's logprobs, the sampling policy's (the same tensor unless
    the old policy was recomputed) and the rollout correction, where there is one."""

    old: torch.Tensor
    sampled: torch.Tensor
    recomputed: bool
    correction: RolloutCorrection | None


def _sharded_at_load(model) -> bool:
    """Whether transformers sharded the model with FSDP when loading it (transformers >= 5.2x; accelerate's `no_sync`
    does not reach such a model)."""
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:
        return False
    return is_fsdp_managed_module(model)


def forward_inputs(rows: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(input_ids, attention_mask, completion width)` of rows, as TRL's logprob passes take them."""
    input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    return input_ids, attention_mask, rows["completion_ids"].size(1)
