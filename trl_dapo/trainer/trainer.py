"""`DAPOTrainer`: TRL's `GRPOTrainer` with the DAPO loss, ratios against the rollout (or recomputed) policy, an exact
token-mean and dynamic sampling.

Hooks overridden, and why:
- `_calculate_rewards`: check the rewards and hand the raw per-function values (with each completion's length and
  truncation) to the group filter and the trained-batch metrics; in stream mode, gather the stream's own scores.
- `_generate_and_score_completions`: wraps TRL's (never copies it): one call per candidate round, rollout logprobs
  recorded, the global view filtered by the dynamic-sampling buffer, whole groups re-sharded to the ranks, and with
  `old_logprobs="recompute"` the old policy recomputed where no pass has computed it yet.
- `_generate_single_turn`: routes training generation to the paged rollout engine when it applies; in stream mode,
  hands back the completions the stream generated.
- `_prepare_inputs`: splits a generation batch into micro-batches and gives each the global token count of its own
  optimizer step (TRL divides by the generation batch's average instead).
- `_compute_loss`: the DAPO loss of `loss.py` against the old policy (the rollout logprobs, or the training model's
  recomputation with an optional rollout correction, `mismatch.py`), and the train/rollout mismatch metrics.
- `_save_checkpoint` / `_load_optimizer_and_scheduler`: the buffer's surplus and the prompt stream position.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from typing import Any, ClassVar

import torch
from accelerate.utils import DistributedType
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from ..integrity import RolloutIntegrityError, check_rewards, checked_reward_function
from ..rewards.overlong import OVERLONG_REWARD_NAME, OverlongPenalty
from ..rollout import PagedRolloutEngine, select_rollout_engine, token_sampling
from ..sampling import (
    DynamicSamplingBuffer,
    filter_groups,
    make_prompt_stream,
)
from ..sampling.rollout_batch import (
    OLD_LOGPROBS_STEP,
    RolloutBatch,
    count_loss_tokens,
    loss_mask,
    num_rows,
)
from .batch_metrics import trained_batch_metric_names, trained_batch_metrics
from .collect import EngineWeights, FilterMetric, make_collector
from .config import DAPOConfig
from .loss import active_mean, dapo_policy_loss
from .micro_batches import MicroBatch, split_generation_batch
from .mismatch import mismatch_metrics, rollout_correction
from .packed_attention import enable_packed_attention, forward_packed, why_model_cannot_pack
from .packing import pack_rows, unpack_scores
from .round import TRLRounds, log_device_metrics, round_scores
from .set_up import check_set_up, check_stream_reward_functions, filter_column, stream_without_engine
from .step_metrics import StepMetrics

logger = logging.getLogger(__name__)

SAMPLING_STATE_FILE = "dapo_sampling_state.pt"


class DAPOTrainer(GRPOTrainer):
    """GRPOTrainer with DAPO: Clip-Higher, rollout-policy ratios, token-level loss, dynamic sampling, overlong shaping.

    Takes exactly `GRPOTrainer`'s arguments; `args` must be a [`DAPOConfig`].
    """

    _tag_names: ClassVar[list[str]] = ["trl", "dapo"]
    _name = "DAPO"

    def __init__(self, model, reward_funcs=None, args: DAPOConfig | None = None, **kwargs: Any) -> None:
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DAPOConfig(output_dir=f"{str(name).split('/')[-1]}-DAPO")
        if not isinstance(args, DAPOConfig):
            raise TypeError(f"DAPOTrainer needs args=DAPOConfig(...), got {type(args).__name__}.")
        # TRL replaces hub ids by loaded models inside these lists: hand it copies, never the caller's own.
        if isinstance(reward_funcs, list):
            reward_funcs = list(reward_funcs)
        if isinstance(kwargs.get("reward_processing_classes"), list):
            kwargs["reward_processing_classes"] = list(kwargs["reward_processing_classes"])
        set_up = ("train_dataset", "eval_dataset", "tools", "rollout_func", "environment_factory")
        check_set_up(args, reward_funcs, **{name: kwargs.get(name) for name in set_up})  # before any model loads
        super().__init__(model, reward_funcs, args, **kwargs)
        self.reward_funcs = [
            function if isinstance(function, nn.Module) else checked_reward_function(function, name)
            for function, name in zip(self.reward_funcs, self.reward_func_names, strict=True)
        ]
        self.num_task_rewards = len(self.reward_funcs)
        if args.overlong_buffer_len > 0:
            penalty = OverlongPenalty(
                args.max_completion_length, args.overlong_buffer_len, args.overlong_penalty_factor
            )
            self.reward_funcs = [*self.reward_funcs, penalty]
            self.reward_func_names = [*self.reward_func_names, OVERLONG_REWARD_NAME]
            self.reward_processing_classes = [*self.reward_processing_classes, None]
            self.reward_weights = torch.cat([self.reward_weights, torch.ones(1)])
        self.filter_column = filter_column(args.dynamic_sampling_metric, self.reward_func_names)
        self.sampling_buffer = DynamicSamplingBuffer(
            num_generations=self.num_generations,
            pad_token_id=self._tokenizer.pad_token_id,
            max_num_gen_batches=args.max_num_gen_batches,
            on_limit=args.dynamic_sampling_on_limit,
            keep_surplus=args.dynamic_sampling_keep_surplus,
            max_surplus_age=args.max_surplus_age,
            oversample=args.dynamic_sampling_oversample,
            max_oversample=args.dynamic_sampling_max_oversample,
        )
        self.prompt_stream = (
            make_prompt_stream(self.train_dataset, seed=args.seed + 1, shuffle=self.shuffle_dataset)
            if args.dynamic_sampling
            else None
        )
        self.rollout_engine = select_rollout_engine(self)
        self.engine_weights = (
            EngineWeights(self.rollout_engine, lambda: self.accelerator.unwrap_model(self.model))
            if self.rollout_engine is not None
            else None
        )
        self.padding_free = self._set_up_padding_free()
        if args.dynamic_sampling_mode == "stream":
            self._check_stream_set_up()
        self._trained_batch_metric_names = trained_batch_metric_names(self.reward_func_names)
        filter_metric = FilterMetric(self.filter_column, self.reward_weights)
        self.rounds = TRLRounds(
            self,
            recompute_logprobs=lambda batch: self._no_grad_logprobs(batch, args.per_device_train_batch_size),
            filter_metric=filter_metric,
            trained_batch_metric_names=self._trained_batch_metric_names,
        )
        self.collector = make_collector(self, self.rounds, filter_metric, keep_groups=filter_groups)
        self._skipped_steps = 0

    def _set_up_padding_free(self) -> bool:
        """Whether the training passes run packed (`padding_free`; None: where flash attention runs); where the
        model cannot, say why once."""
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        half = args.bf16 or args.fp16 or model.dtype in (torch.bfloat16, torch.float16)
        reason = why_model_cannot_pack(model, self._is_vlm)
        if args.use_transformers_continuous_batching:
            reason = "transformers' continuous batching generates through the model's own attention implementation"
        if args.padding_free is None and not (self.accelerator.device.type == "cuda" and half):
            reason = "padding_free=None packs where flash attention runs (CUDA with bf16 or fp16)"
        if reason is None and args.padding_free is not False:
            enable_packed_attention(model)
            return True
        if args.padding_free is not False:
            cap = " (padding_free_max_tokens does not apply)" if args.padding_free_max_tokens else ""
            level = logging.INFO if args.padding_free is None and not cap else logging.WARNING
            logger.log(level, "Training passes are padded%s: %s.", cap, reason)
        return False

    def _check_stream_set_up(self) -> None:
        """Stream mode scores groups on the host while the paged engine decodes: say what is missing now that the
        model and every reward function (an environment's too) are known."""
        if not isinstance(self.rollout_engine, PagedRolloutEngine):
            raise stream_without_engine(self.args, "on this set-up TRL's path generates, see the log for why")
        check_stream_reward_functions(self.reward_funcs, self.reward_func_names)

    # ----------------------------------------------------------------------------------------------- generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        context = self.rounds.current
        if context is None or not self.model.training:  # evaluation: TRL's own
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if context.streamed is not None:  # stream mode: these rows are already generated
            if [list(ids) for ids in prompt_ids] != context.streamed.prompt_ids:
                raise RolloutIntegrityError(
                    "stream mode: the prompts TRL tokenized differ from the ones the stream generated for."
                )
            context.record_generation(context.streamed.logprobs)
            return context.streamed.completions, None
        if self.rollout_engine is None or images is not None or multimodal_fields:
            context.record_generation()
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        engine = self.engine_weights.current(self.state.global_step)
        output = engine.generate(prompt_ids, token_sampling(self.args))
        # The logprobs stay on the device for the round: as Python lists TRL would rebuild them row by row.
        stats = output.stats
        context.record_generation(
            output.logprobs, (stats.busy_slot_steps, stats.pool_slot_steps, stats.prefill_tokens)
        )
        return output.completions, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        context = self.rounds.current
        if context is None or context.streamed is None:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        else:  # stream mode scored these rows as their groups ended: gather them as TRL gathers its own
            rewards_per_func = self.accelerator.gather(context.streamed.rewards.to(self.accelerator.device))
        # The overlong penalty shapes a score but is none: a completion the task functions all skip is unscored.
        task = slice(0, self.num_task_rewards)
        check_rewards(
            rewards_per_func[:, task], len(prompts) * self.accelerator.num_processes, self.reward_func_names[task]
        )
        if context is not None:  # evaluation batches stay TRL's own
            ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            context.record_scores(round_scores(rewards_per_func, completion_ids_list, ends, self.accelerator))
        return rewards_per_func

    def _collect_generation_batch(self, inputs: list[dict[str, Any]]) -> RolloutBatch:
        """The global generation batch (every rank's rows), from the collector the config chose (`collect.py`)."""
        batch, stats = self.collector.collect(inputs, self.state.global_step)
        if stats is not None:  # dynamic sampling: its counts, and TRL's metrics for the accepted groups
            self._log_metrics("train", stats.metrics())
            if num_rows(batch):
                self._log_trained_batch(batch)
        return batch

    def _no_grad_logprobs(self, batch: RolloutBatch, batch_size: int | None) -> torch.Tensor:
        """The training model's logprobs of the completion tokens: no-grad forwards of at most `batch_size` rows
        (padding-free: `padding_free_max_tokens` tokens when set; None: one forward, for a planned pass)."""
        input_ids, attention_mask, width = _forward_inputs(batch)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, width, batch_size=batch_size
            )
        return logps

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
        stale = [rows.pop(OLD_LOGPROBS_STEP) != self.state.global_step for rows in passes]
        if not passes:  # no rank has a pass: the generation batch is empty everywhere
            return
        local = torch.stack([row_stale.any() for row_stale in stale]).int()
        needed = self.accelerator.reduce(local, reduction="max").bool().tolist()
        for rows, row_stale, run in zip(passes, stale, needed, strict=True):
            if run:
                old = rows["old_per_token_logps"]
                logps = self._no_grad_logprobs(rows, batch_size=None).to(old.dtype)
                rows["old_per_token_logps"] = torch.where(loss_mask(rows).bool() & row_stale.unsqueeze(1), logps, old)

    # ------------------------------------------------------------------------------------------------- metrics

    def _log_trained_batch(self, batch: RolloutBatch) -> None:
        """TRL's completion and reward metrics, for the accepted groups of this generation batch."""
        metrics = trained_batch_metrics(batch, self.reward_weights, self.reward_func_names, self.num_generations)
        log_device_metrics(self._metrics["train"], metrics)

    def _log_metrics(self, mode: str, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._metrics[mode][name].append(float(value))

    # ------------------------------------------------------------------------------------------- micro-batches

    def _prepare_inputs(self, generation_batch: Any) -> MicroBatch | dict[str, torch.Tensor | Any]:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # TRL's evaluation batch, scored as one pass
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._micro_batches(self._collect_generation_batch(generation_batch))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """Deal the global generation batch's rows to this rank's micro-batches and passes (`micro_batches.py`):
        padding-free by tokens, else by rows; then the old policy where it is recomputed.

        An optimizer step with no rows at all (dynamic sampling trained on a partial batch) is skipped: no gradient,
        so the optimizer leaves parameters and state alone; it is counted in `dapo/skipped_steps`."""
        accumulation = self.args.gradient_accumulation_steps
        optimizer_steps = self.args.steps_per_generation // accumulation
        costs = None
        if self.padding_free:
            costs = (batch["prompt_mask"].sum(dim=1) + batch["completion_mask"].sum(dim=1)).tolist()
        micro_batches = split_generation_batch(
            batch,
            rank=self.accelerator.process_index,
            world=self.accelerator.num_processes,
            optimizer_steps=optimizer_steps,
            micro_batches=accumulation,
            costs=costs,
            max_tokens=self.args.padding_free_max_tokens if self.padding_free else None,
            generator=torch.Generator().manual_seed(self.args.seed + self.state.global_step),
        )
        self._with_old_policy(micro_batches)
        empty_steps = self.num_iterations * sum(
            not any(mb.passes for mb in micro_batches[start : start + accumulation])
            for start in range(0, len(micro_batches), accumulation)
        )
        if empty_steps and self.accelerator.scaler is not None:
            raise ValueError(
                "Dynamic sampling found no informative group for an optimizer step, which is then skipped, but fp16's "
                "gradient scaler cannot step without gradients. Use bf16, or dynamic_sampling_on_limit='raise'."
            )
        if empty_steps and self.accelerator.is_main_process:
            logger.warning(
                "Dynamic sampling found too few informative groups within max_num_gen_batches=%d rounds: %d of the %d "
                "optimizer steps of this generation batch have no rollout rows and are skipped (parameters and "
                "optimizer state unchanged; the step counter and learning-rate schedule advance). %d skipped before, "
                "logged as dapo/skipped_steps.",
                self.args.max_num_gen_batches,
                empty_steps,
                optimizer_steps * self.num_iterations,
                self._skipped_steps,
            )
        return micro_batches

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`dapo/skipped_steps` is a running count: logged as it stands, not averaged like TRL's per-step metrics."""
        if self.model.training and "loss" in logs:
            logs["dapo/skipped_steps"] = float(self._skipped_steps)
        super().log(logs, start_time)

    # ---------------------------------------------------------------------------------------------------- loss

    def _get_per_token_logps_and_entropies(
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
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        chunks = self._packed_chunks(attention_mask, batch_size)
        logps, entropies, aux_losses = [], [], []
        for rows in chunks:
            if rows is None:  # another rank runs one more forward
                empty = _forward_inputs(self._empty_pass())
                self._packed_forward(model, *empty, compute_aux_loss)
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
        another rank has one more pass."""
        pad = torch.full((1, 1), self._tokenizer.pad_token_id, device=self.accelerator.device)
        ones = torch.ones_like(pad)
        return {"prompt_ids": pad, "prompt_mask": ones, "completion_ids": pad, "completion_mask": ones}

    def _compute_loss(self, model, inputs):
        if not isinstance(inputs, MicroBatch):  # an evaluation batch (TRL's): its own step, one pass
            metrics = StepMetrics()
            step_tokens = self.accelerator.reduce(count_loss_tokens(inputs).float(), "sum")
            loss = self._pass_loss(model, inputs, step_tokens, metrics, weight=1.0, aux_weight=1.0, mode="eval")
            self._log_metrics("eval", metrics.flush(self.accelerator))
            return loss
        if not inputs.passes:
            # No forward pass and no gradient reaching the parameters (a micro-batch no rank has rows for): an
            # optimizer step made only of these leaves the parameters and the optimizer state as they were.
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
            self._log_metrics("train", inputs.metrics.flush(self.accelerator))
        elif inputs.ends_step:
            self._skipped_steps += 1
        return loss

    @contextlib.contextmanager
    def _deferred_gradient_sync(self, model):
        """Run a pass as the Trainer runs a micro-batch that is not its optimizer step's last: gradients accumulate
        on each rank (DDP / FSDP2 `no_sync`; DeepSpeed: no accumulation boundary, no optimizer step)."""
        state = self.accelerator.gradient_state
        if not state.sync_gradients:  # the Trainer already defers this micro-batch
            yield
            return
        state._set_sync_gradients(False)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            deferred = contextlib.nullcontext()
        elif getattr(self, "is_distributed_loading_by_transformers", False) and _sharded_at_load(self.model):
            deferred = self._defer_fsdp_gradient_reduction()  # the Trainer's own, for a model sharded at load
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
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, *_forward_inputs(rows), compute_entropy=True, compute_aux_loss=self.aux_loss_enabled
        )
        old_per_token_logps = rows.get("old_per_token_logps")
        if old_per_token_logps is None:  # evaluation batches are scored on-policy
            old_per_token_logps = per_token_logps.detach()
        # old_logprobs="recompute": the rollout's logprobs are kept apart (evaluation batches are TRL's own)
        recomputed = mode == "train" and "sampling_per_token_logps" in rows
        sampled = rows["sampling_per_token_logps"] if recomputed else old_per_token_logps
        correction = None
        if recomputed and self.args.rollout_correction is not None:
            correction = rollout_correction(
                old_per_token_logps,
                sampled,
                mask,
                self.args.rollout_correction,
                self.args.rollout_correction_max,
                self.args.rollout_correction_min,
            )
        # Each rank divides by its share of the step's global count; DDP's gradient average then gives the
        # exact global token-mean.
        clips = dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, clip_ratio_c=self.args.clip_ratio_c)
        loss, stats = dapo_policy_loss(
            per_token_logps,
            old_per_token_logps,
            rows["advantages"],
            mask,
            num_tokens=step_tokens.clamp(min=1.0) / self.accelerator.num_processes,
            token_weights=None if correction is None else correction.weights,
            **clips,
        )
        mismatch = mismatch_metrics(
            per_token_logps.detach(),
            old_per_token_logps,
            sampled,
            rows["advantages"],
            mask,
            recomputed=recomputed,
            correction=correction,
            **clips,
        )
        if self.aux_loss_enabled:
            # TRL's router load-balancing term, averaged over the optimizer step's passes
            aux_loss = aux_loss * aux_weight
            loss = loss + self.router_aux_loss_coef * aux_loss
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
            aux_loss=aux_loss.detach() if self.aux_loss_enabled else None,
        )
        return loss * weight

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            state = {
                "buffer": self.sampling_buffer.state_dict(),
                "prompt_stream": self.prompt_stream.state_dict() if self.prompt_stream is not None else None,
                "skipped_steps": self._skipped_steps,
            }
            torch.save(state, os.path.join(folder, SAMPLING_STATE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, SAMPLING_STATE_FILE) if checkpoint else None
        if path and os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            self.sampling_buffer.load_state_dict(state["buffer"], self.accelerator.device)
            if self.prompt_stream is not None and state["prompt_stream"] is not None:
                self.prompt_stream.load_state_dict(state["prompt_stream"])
            self._skipped_steps = state["skipped_steps"]


def _sharded_at_load(model) -> bool:
    """Whether transformers sharded the model with FSDP when loading it (transformers >= 5.2x; accelerate's `no_sync`
    does not reach such a model)."""
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:
        return False
    return is_fsdp_managed_module(model)


def _forward_inputs(rows: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(input_ids, attention_mask, completion width)` of rows, as TRL's logprob passes take them."""
    input_ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
    attention_mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
    return input_ids, attention_mask, rows["completion_ids"].size(1)
