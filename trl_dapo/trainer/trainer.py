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
import copy
import dataclasses
import itertools
import logging
import math
import os
from typing import Any, ClassVar

import torch
from accelerate.utils import DistributedType, gather_object
from torch import nn
from tqdm.auto import tqdm
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing

from ..integrity import RolloutIntegrityError, check_rewards, checked_reward_function
from ..rewards.overlong import OVERLONG_REWARD_NAME, OverlongPenalty
from ..rollout import PagedRolloutEngine, select_rollout_engine, token_sampling
from ..sampling import (
    DynamicSamplingBuffer,
    DynamicSamplingLimitError,
    SamplingStats,
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
from ..sampling.stream import GroupStream, StreamedGroup
from .batch_metrics import trained_batch_metric_names, trained_batch_metrics
from .config import DAPOConfig
from .loss import active_mean, dapo_policy_loss
from .micro_batches import MicroBatch, split_generation_batch
from .mismatch import mismatch_metrics, rollout_correction
from .packed_attention import enable_packed_attention, forward_packed, why_model_cannot_pack
from .packing import pack_rows, unpack_scores
from .round import StreamedRows, TRLRounds, log_device_metrics, round_scores
from .set_up import check_set_up, check_stream_reward_functions, filter_column, stream_without_engine
from .step_metrics import StepMetrics

logger = logging.getLogger(__name__)

SAMPLING_STATE_FILE = "dapo_sampling_state.pt"
# Admissions of one streamed generation batch with unlimited rounds and a stream of unknown size, in batches of groups.
UNKNOWN_SIZE_STREAM_BATCHES = 16


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
        self.padding_free = self._set_up_padding_free()
        self._engine_weights_step: int | None = None
        if args.dynamic_sampling_mode == "stream":
            self._check_stream_set_up()
        self._trained_batch_metric_names = trained_batch_metric_names(self.reward_func_names)
        self.rounds = TRLRounds(
            self,
            recompute_logprobs=lambda batch: self._no_grad_logprobs(batch, args.per_device_train_batch_size),
            filter_metric=self._filter_metric,
            trained_batch_metric_names=self._trained_batch_metric_names,
        )
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
        if self._engine_weights_step != self.state.global_step:  # weights change once per optimizer step at most
            self.rollout_engine.sync_weights(self.accelerator.unwrap_model(self.model))
            self._engine_weights_step = self.state.global_step
        output = self.rollout_engine.generate(prompt_ids, token_sampling(self.args))
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
        """The global generation batch (every rank's rows): one round, or dynamic sampling's kept groups."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if not self.args.dynamic_sampling:
            return self.rounds.run(inputs, trained_as_generated=True).batch
        target = self.args.generation_batch_size // self.num_generations
        group_multiple = world // math.gcd(self.num_generations, world)
        if self.args.dynamic_sampling_mode == "stream":
            batch, stats = self.sampling_buffer.fill_stream(
                target,
                lambda missing: self._stream_groups(inputs, missing, target, group_multiple),
                step=self.state.global_step,
                group_multiple=group_multiple,
            )
        else:
            counts = torch.zeros(3, dtype=torch.long)  # the engine's busy and all decode slot-steps, prefilled tokens

            def generate_round(groups: int, round_index: int) -> tuple[RolloutBatch, torch.Tensor]:
                rows = gather_object(inputs) if round_index == 0 else []  # the first round is the dataloader's batch
                rows += self._stream_rows(groups - len(rows) // self.num_generations)
                share = len(rows) // world
                candidates = self.rounds.run(rows[rank * share : (rank + 1) * share], trained_as_generated=False)
                counts.add_(torch.tensor(candidates.engine_counts))
                return candidates.batch, candidates.metric

            with _RoundProgress(enabled=self.accelerator.is_main_process and not self.args.disable_tqdm) as progress:
                batch, stats = self.sampling_buffer.fill(
                    target,
                    generate_round,
                    step=self.state.global_step,
                    group_multiple=group_multiple,
                    dataset_prompts=lambda: self.prompt_stream.num_prompts,
                    report=progress,
                )
            busy, pool, prefill = self.accelerator.reduce(counts.to(self.accelerator.device), reduction="sum").tolist()
            stats.busy_slot_steps, stats.pool_slot_steps, stats.prefill_tokens = int(busy), int(pool), int(prefill)
        self._log_metrics("train", stats.metrics())
        if num_rows(batch):
            self._log_trained_batch(batch)
        return batch

    def _stream_groups(
        self, inputs: list[dict[str, Any]], missing: int, target: int, group_multiple: int
    ) -> tuple[RolloutBatch | None, SamplingStats]:
        """Stream mode: each rank streams its prompts (its share of the dataloader batch's prompts, then every
        `world`-th prompt of the extra stream) through one call of the paged engine until the kept groups of all
        ranks cover `missing`; then the kept groups are gathered, in rank then finish order, and go through TRL's
        method as rows already generated and scored. Returns the global batch of kept groups and the counts."""
        rank, world, args = self.accelerator.process_index, self.accelerator.num_processes, self.args
        G = self.num_generations
        firsts = gather_object(inputs)[::G]  # the dataloader batch repeats each prompt G times
        own = iter(firsts[rank::world])
        blocks = 0  # extra-stream blocks of `world` prompts this rank drew (one prompt of each is its own)

        def next_prompt() -> tuple[dict[str, Any], list[int]]:
            nonlocal blocks
            row = next(own, None)
            if row is None:
                row, blocks = self.prompt_stream.take(world)[rank], blocks + 1
            prompt_ids = self._tokenize_prompts(copy.deepcopy([row["prompt"]]))[0][0]
            return row, list(prompt_ids)

        if self._engine_weights_step != self.state.global_step:
            self.rollout_engine.sync_weights(self.accelerator.unwrap_model(self.model))
            self._engine_weights_step = self.state.global_step
        settings = token_sampling(args)
        stream = GroupStream(
            start=lambda prompts, resumed: self.rollout_engine.stream(prompts, settings, resumed),
            next_prompt=next_prompt,
            score=self._score_group,
            agree=self._sum_over_ranks,
            num_generations=G,
            world=world,
            sync_every=args.dynamic_sampling_stream_sync_every,
            in_flight=args.dynamic_sampling_in_flight,
            prior=(self.sampling_buffer.qualified_weight, self.sampling_buffer.generated_weight),
            fill_rows=self.rollout_engine.max_rows if args.dynamic_sampling_in_flight == "carry" else 0,
        )
        dataset_prompts = self.prompt_stream.num_prompts
        if args.max_num_gen_batches:
            budget = math.ceil(args.max_num_gen_batches * args.dynamic_sampling_max_oversample * target)
        else:
            budget = dataset_prompts if dataset_prompts is not None else UNKNOWN_SIZE_STREAM_BATCHES * target
        # in flight at once: the most one candidate round may hold (the same memory cap as in rounds)
        max_in_flight = max(math.ceil(args.dynamic_sampling_max_oversample * target), missing)
        # this rank's groups carried in flight from the last batch, unless older than max_surplus_age
        step, buffer = self.state.global_step, self.sampling_buffer
        carried = [group for group in buffer.carried if step - group.birth <= args.max_surplus_age]
        aged_tokens = sum(group.earlier_tokens for group in buffer.carried) - sum(g.earlier_tokens for g in carried)
        outcome = stream.run(missing, max(budget, missing), max_in_flight, carried)
        buffer.carried = [
            group if group.birth >= 0 else dataclasses.replace(group, birth=step) for group in outcome.carried
        ]
        # every rank's extra stream ends at the same position: the furthest any rank drew
        furthest = int(self.accelerator.reduce(torch.tensor(blocks, device=self.accelerator.device), "max"))
        if furthest > blocks:
            self.prompt_stream.take(world * (furthest - blocks))
        shared = {
            "kept": [_to_host(group) for group in outcome.kept],
            "counts": [
                outcome.generated_groups, outcome.qualified_groups, outcome.filtered_all_correct,
                outcome.filtered_all_wrong, outcome.solved_prompts, outcome.generated_tokens, outcome.filtered_tokens,
                outcome.busy_slot_steps, outcome.pool_slot_steps, outcome.carried_tokens, aged_tokens, outcome.prefill_tokens,
            ],
        }  # fmt: skip
        everyone = gather_object([shared])
        totals = [sum(values) for values in zip(*(rank_share["counts"] for rank_share in everyone), strict=True)]
        stats = SamplingStats(
            generated_groups=int(totals[0]), qualified_groups=int(totals[1]), filtered_all_correct=int(totals[2]),
            filtered_all_wrong=int(totals[3]), solved_prompts=float(totals[4]), generated_tokens=int(totals[5]),
            filtered_tokens=int(totals[6]), busy_slot_steps=int(totals[7]), pool_slot_steps=int(totals[8]),
            surplus_tokens=int(totals[9]),  # the carried groups' tokens of this batch, kept for the next
            prefill_tokens=int(totals[11]),
        )  # fmt: skip
        dataset_prompts = self.prompt_stream.num_prompts  # a stream's size may have become known while it ran
        if not args.max_num_gen_batches and dataset_prompts is not None and not stats.qualified_groups:
            raise DynamicSamplingLimitError(self.sampling_buffer._full_pass_message(stats, dataset_prompts))
        kept = [group for rank_share in everyone for group in rank_share["kept"]]
        usable = len(kept) - len(kept) % group_multiple  # the rows must share equally over the ranks
        stats.discarded_qualified_groups = len(kept) - usable
        kept = kept[:usable]
        kept_tokens = sum(group.fresh_tokens for group in kept)
        # tokens of this batch neither filtered nor kept nor carried: rows dropped in flight, groups cut for the ranks'
        # shares; and carried groups that aged out
        stats.untrained_tokens = (
            stats.generated_tokens - stats.filtered_tokens - kept_tokens - stats.surplus_tokens + int(totals[10])
        )
        if not kept:
            return self._empty_rollout(), stats
        rows = [(group, index) for group in kept for index in range(G)]
        share = len(rows) // world
        mine = rows[rank * share : (rank + 1) * share]
        streamed = StreamedRows(
            prompt_ids=[group.prompt_ids for group, _ in mine],
            completions=[group.completions[index] for group, index in mine],
            logprobs=torch.stack([group.logprobs[index] for group, index in mine]).to(self.accelerator.device),
            rewards=torch.stack([group.rewards[index] for group, index in mine]),
        )
        kept_round = self.rounds.run([group.rows[index] for group, index in mine], False, streamed)
        batch, metric = kept_round.batch, kept_round.metric
        if not bool(filter_groups(metric.cpu(), G).all()):
            raise RolloutIntegrityError(
                "stream mode: a kept group is not informative once gathered; a rank lost rows."
            )
        return batch, stats

    def _empty_rollout(self) -> RolloutBatch:
        """A global batch of no rows with the keys a round's batch has (a stream that kept nothing)."""
        device = self.accelerator.device
        empty = torch.zeros(0, 0, dtype=torch.long, device=device)
        batch = {key: empty for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        batch["old_per_token_logps"] = torch.zeros(0, 0, device=device)
        if self.args.old_logprobs == "recompute":
            batch["sampling_per_token_logps"] = torch.zeros(0, 0, device=device)
            batch[OLD_LOGPROBS_STEP] = torch.zeros(0, dtype=torch.long, device=device)
        batch["advantages"] = torch.zeros(0, device=device)
        batch["rewards"] = torch.zeros(0, len(self.reward_funcs), device=device)
        batch["truncated"] = torch.zeros(0, dtype=torch.bool, device=device)
        batch["completion_lengths"] = torch.zeros(0, dtype=torch.long, device=device)
        return batch

    def _score_group(
        self, rows: list[dict[str, Any]], prompt_ids: list[int], completion_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One finished group's rewards on this rank, with TRL's arguments to each reward function (its dataset
        columns, `trainer_state`, `log_metric`; `log_extra` columns are not kept in stream mode), and its filter
        metric. No collective: ranks finish groups at different times."""
        prompts = [row["prompt"] for row in rows]
        texts = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": prompts[0]}):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = texts
        columns = {
            key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")
        }
        extra = dict(trainer_state=self.state, log_extra=lambda *args: None, log_metric=self._log_metric)
        rewards = torch.full((len(rows), len(self.reward_funcs)), torch.nan)
        for column, function in enumerate(self.reward_funcs):
            values = function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra
            )
            if len(values) != len(rows):
                raise RolloutIntegrityError(
                    f"reward function {self.reward_func_names[column]!r} returned {len(values)} rewards for "
                    f"{len(rows)} completions; each completion needs one."
                )
            rewards[:, column] = torch.tensor([torch.nan if v is None else float(v) for v in values])
        task = slice(0, self.num_task_rewards)
        check_rewards(rewards[:, task], len(rows), self.reward_func_names[task])
        return rewards, self._filter_metric(rewards)

    def _filter_metric(self, rewards: torch.Tensor) -> torch.Tensor:
        """What dynamic sampling filters groups on: one reward function's column, or the weighted total."""
        if self.filter_column is None:
            return (rewards * self.reward_weights.to(rewards.device)).nansum(dim=1)
        return rewards[:, self.filter_column]

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.accelerator.num_processes == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.accelerator.device)
        return self.accelerator.reduce(tensor, reduction="sum").tolist()

    def _stream_rows(self, groups: int) -> list[dict[str, Any]]:
        """Rows (each prompt repeated `num_generations` times) of the next `groups` prompts of the extra stream."""
        if groups <= 0:
            return []
        return [row for row in self.prompt_stream.take(groups) for _ in range(self.num_generations)]

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


def _to_host(group: StreamedGroup) -> StreamedGroup:
    """A kept group with its tensors on the CPU, to be gathered to every rank."""
    return dataclasses.replace(group, logprobs=group.logprobs.cpu(), rewards=group.rewards.cpu())


class _RoundProgress:
    """Makes every extra candidate round visible: a log line each, and a progress bar of the informative groups
    found (main process, unless `disable_tqdm`), closed when the generation batch is full."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None

    def __call__(self, round_index: int, groups: int, have: int, target: int) -> None:
        logger.info(
            "Dynamic sampling round %d: %d of %d informative groups found so far, generating %d candidate groups.",
            round_index + 1,
            have,
            target,
            groups,
        )
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = tqdm(total=target, desc="dynamic sampling", unit="group", leave=False)
        self.bar.n = have
        self.bar.set_postfix(round=round_index + 1)

    def __enter__(self) -> _RoundProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.bar is not None:
            self.bar.close()
