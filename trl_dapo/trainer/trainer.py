"""`DAPOTrainer`: TRL's `GRPOTrainer` with the DAPO loss, rollout-policy ratios, an exact token-mean and dynamic
sampling.

Hooks overridden, and why:
- `_calculate_rewards`: check the rewards and keep the raw per-function values the group filter needs.
- `_generate_and_score_completions`: wraps TRL's (never copies it): one call per candidate round, rollout logprobs
  recorded, the global view filtered by the dynamic-sampling buffer, whole groups re-sharded to the ranks.
- `_generate_single_turn`: routes training generation to the static-cache engine when it applies.
- `_prepare_inputs`: splits a generation batch into micro-batches and gives each the global token count of its own
  optimizer step (TRL divides by the generation batch's average instead).
- `_compute_loss`: the DAPO loss of `loss.py` on rollout logprobs.
- `_save_checkpoint` / `_load_optimizer_and_scheduler`: the buffer's surplus and the prompt stream position.
"""

from __future__ import annotations

import math
import os
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict

from ..integrity import RolloutIntegrityError, check_completions, check_groups, check_rewards
from ..rewards.overlong import OVERLONG_REWARD_NAME, OverlongPenalty
from ..rollout import sampling_settings, select_rollout_engine
from ..sampling import DynamicSamplingBuffer, PromptStream, SamplingStats, plan_round_groups
from ..sampling.rollout_batch import (
    ROLLOUT_KEYS,
    RolloutBatch,
    count_loss_tokens,
    gather_rollout,
    num_rows,
    select_rows,
    shard_rows,
    trim_padding,
)
from .config import DAPOConfig
from .loss import dapo_policy_loss

SAMPLING_STATE_FILE = "dapo_sampling_state.pt"
# Keys TRL may return that carry nothing DAPO needs once the rollout logprobs are recorded.
DROPPED_KEYS = ("num_items_in_batch", "sampling_per_token_logps", "importance_sampling_ratio")


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
        super().__init__(model, reward_funcs, args, **kwargs)
        self.num_task_rewards = len(self.reward_funcs)
        if args.overlong_buffer_len > 0:
            self.reward_funcs.append(
                OverlongPenalty(args.max_completion_length, args.overlong_buffer_len, args.overlong_penalty_factor)
            )
            self.reward_func_names.append(OVERLONG_REWARD_NAME)
            self.reward_processing_classes.append(None)
            self.reward_weights = torch.cat([self.reward_weights, torch.ones(1)])
        self.filter_column = self._resolve_filter_column(args.dynamic_sampling_metric)
        self.sampling_buffer = DynamicSamplingBuffer(
            num_generations=self.num_generations,
            pad_token_id=self._tokenizer.pad_token_id,
            max_num_gen_batches=args.max_num_gen_batches,
            on_limit=args.dynamic_sampling_on_limit,
            keep_surplus=args.dynamic_sampling_keep_surplus,
            max_surplus_age=args.max_surplus_age,
        )
        self.prompt_stream = self._make_prompt_stream(args)
        self.rollout_engine = select_rollout_engine(self)
        self._engine_weights_step: int | None = None
        self._engine_logprobs: torch.Tensor | None = None
        self._last_rewards_per_func: torch.Tensor | None = None

    def _make_prompt_stream(self, args: DAPOConfig) -> PromptStream | None:
        """Extra candidate rounds draw prompts by index, which a streaming dataset cannot give."""
        if not args.dynamic_sampling:
            return None
        if not hasattr(self.train_dataset, "__len__"):
            raise ValueError(
                "train_dataset: dynamic sampling draws extra prompts by index, which an IterableDataset cannot "
                "provide; pass a map-style Dataset or set DAPOConfig.dynamic_sampling=False."
            )
        return PromptStream(len(self.train_dataset), seed=args.seed + 1, shuffle=self.shuffle_dataset)

    def _resolve_filter_column(self, metric: str | None) -> int | None:
        """Column of the per-function rewards the filter reads; `None` means the weighted total."""
        if metric is None:
            return 0
        if metric == "reward":
            return None
        if metric not in self.reward_func_names:
            raise ValueError(
                f"DAPOConfig.dynamic_sampling_metric={metric!r} names no reward function; use one of "
                f"{self.reward_func_names} or 'reward' for the weighted total."
            )
        return self.reward_func_names.index(metric)

    # ----------------------------------------------------------------------------------------------- generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.rollout_engine is None or not self.model.training or images is not None or multimodal_fields:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if self._engine_weights_step != self.state.global_step:  # weights change once per optimizer step at most
            self.rollout_engine.sync_weights(self.accelerator.unwrap_model(self.model))
            self._engine_weights_step = self.state.global_step
        output = self.rollout_engine.generate(prompt_ids, sampling_settings(self.args))
        completions, self._engine_logprobs = output[0], output[1]
        # The logprobs stay on the device for `_rollout_logprobs`: as Python lists TRL would rebuild them row by row.
        return completions, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # The overlong penalty shapes a score but is none: a completion the task functions all skip is unscored.
        task = slice(0, self.num_task_rewards)
        check_rewards(
            rewards_per_func[:, task], len(prompts) * self.accelerator.num_processes, self.reward_func_names[task]
        )
        self._last_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if not self.args.dynamic_sampling:
            batch, _ = self._rollout_round(inputs)
            return shard_rows(batch, rank, world)

        dataloader_rows = [inputs]
        base_groups = self.args.generation_batch_size // self.num_generations
        group_multiple = world // math.gcd(self.num_generations, world)
        cap = math.ceil(self.args.dynamic_sampling_max_oversample * base_groups)

        def generate_round(missing: int) -> tuple[RolloutBatch, torch.Tensor]:
            first = bool(dataloader_rows)
            groups = plan_round_groups(
                missing,
                self.sampling_buffer.efficiency,
                self.args.dynamic_sampling_oversample,
                cap=max(cap, base_groups),
                multiple=group_multiple,
                minimum=base_groups if first else 0,
            )
            rows = gather_object(dataloader_rows.pop()) if first else []
            rows += self._stream_rows(groups - len(rows) // self.num_generations)
            share = len(rows) // world
            return self._rollout_round(rows[rank * share : (rank + 1) * share])

        batch, stats = self.sampling_buffer.fill(
            base_groups, generate_round, step=self.state.global_step, group_multiple=group_multiple
        )
        self._log_sampling(stats)
        return shard_rows(batch, rank, world)

    def _stream_rows(self, groups: int) -> list[dict[str, Any]]:
        """Rows (each prompt repeated `num_generations` times) of the next `groups` prompts of the extra stream."""
        if groups <= 0:
            return []
        indices = self.prompt_stream.take(groups)
        return [self.train_dataset[i] for i in indices for _ in range(self.num_generations)]

    def _rollout_round(self, local_inputs: list[dict[str, Any]]) -> tuple[RolloutBatch, torch.Tensor]:
        """Generate and score one candidate round with TRL; return the checked global batch and its filter metric."""
        output = super()._generate_and_score_completions(local_inputs)
        unknown = set(output) - set(ROLLOUT_KEYS) - set(DROPPED_KEYS)
        if unknown:
            raise NotImplementedError(
                f"DAPOTrainer handles text rollouts; TRL returned {sorted(unknown)} (multimodal inputs are not "
                "supported yet)."
            )
        output["old_per_token_logps"] = self._rollout_logprobs(output)
        local = {key: output[key] for key in ROLLOUT_KEYS if key in output}
        batch = gather_rollout(local, self.accelerator, self._tokenizer.pad_token_id)
        check_groups(batch["prompt_ids"], batch["prompt_mask"], self.num_generations)
        check_completions(batch["completion_ids"], batch["completion_mask"], batch["old_per_token_logps"])
        rewards = self._last_rewards_per_func
        if rewards.size(0) != num_rows(batch):
            raise RolloutIntegrityError(
                f"rewards: {rewards.size(0)} rows for {num_rows(batch)} completions; each completion needs one reward."
            )
        self._log_rollout(batch, rewards)
        if self.filter_column is None:
            metric = (rewards * self.reward_weights.to(rewards.device)).nansum(dim=1)
        else:
            metric = rewards[:, self.filter_column]
        return batch, metric

    def _rollout_logprobs(self, output: dict[str, Any]) -> torch.Tensor:
        """Logprobs of the sampled tokens under the policy that sampled them: the old policy of every later ratio.

        From the generation engine when it returns them (vLLM, the static engine); otherwise one no-grad forward
        pass now, before any optimizer step changes the weights.
        """
        if self._engine_logprobs is not None:
            logprobs, self._engine_logprobs = self._engine_logprobs, None
            width = output["completion_ids"].size(1)
            return F.pad(logprobs[:, :width], (0, max(0, width - logprobs.size(1))))
        if "sampling_per_token_logps" in output:
            return output["sampling_per_token_logps"]
        if "old_per_token_logps" in output:  # TRL already ran that forward pass (steps misaligned with generation)
            return output["old_per_token_logps"]
        prompt_completion_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                prompt_completion_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logps

    def _log_rollout(self, batch: RolloutBatch, rewards: torch.Tensor) -> None:
        """Rollout metrics of one candidate round, read back in one host synchronisation."""
        mask = batch["completion_mask"]
        lengths = mask.sum(dim=1)
        last_ids = batch["completion_ids"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        ends_with_eos = torch.isin(last_ids, torch.tensor(self.eos_token_ids, device=last_ids.device))
        named = {
            "rollout_logprobs_mean": (batch["old_per_token_logps"] * mask).sum() / lengths.sum().clamp(min=1),
            "dapo/truncated_ratio": ((lengths > 0) & ~ends_with_eos).float().mean(),
        }
        if OVERLONG_REWARD_NAME in self.reward_func_names:
            named["dapo/overlong_penalty_mean"] = rewards[:, self.reward_func_names.index(OVERLONG_REWARD_NAME)].mean()
        self._append_metrics("train", list(named), torch.stack([v.float().to(mask.device) for v in named.values()]))

    def _append_metrics(self, mode: str, names: list[str], values: torch.Tensor) -> None:
        """Log device scalars with one host synchronisation (each `.item()` would be one)."""
        for name, value in zip(names, values.tolist(), strict=True):
            self._metrics[mode][name].append(value)

    def _log_sampling(self, stats: SamplingStats) -> None:
        for name, value in stats.metrics().items():
            self._metrics["train"][name].append(float(value))

    # ------------------------------------------------------------------------------------------- micro-batches

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, torch.Tensor | Any]:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = shuffle_sequence_dict(self._generate_and_score_completions(generation_batch))
            self._buffered_inputs = self._split_into_micro_batches(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _split_into_micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Cut the local generation batch into `steps_per_generation` micro-batches (sizes may differ by one row when
        dynamic sampling trained on a partial batch) and attach to each the global token count of its optimizer step.
        """
        steps = self.args.steps_per_generation
        rows = num_rows(batch)
        if rows < steps:
            raise ValueError(
                f"Only {rows} rollout rows on this rank for steps_per_generation={steps} micro-batches; with "
                "dynamic_sampling_on_limit='train_on_partial' too few informative groups were found. Raise "
                "max_num_gen_batches or lower steps_per_generation."
            )
        # slices, not index tensors: indexing device tensors with a host index tensor copies it over and waits
        bounds = [(int(idx[0]), int(idx[-1]) + 1) for idx in torch.arange(rows).tensor_split(steps)]
        micro_batches = trim_padding([select_rows(batch, slice(start, stop)) for start, stop in bounds])
        local_counts = torch.stack([count_loss_tokens(mb) for mb in micro_batches]).float()
        global_counts = self.accelerator.reduce(local_counts, reduction="sum")
        accumulation = self.args.gradient_accumulation_steps
        step_counts = global_counts.view(-1, accumulation).sum(dim=1).repeat_interleave(accumulation)
        for micro_batch, count in zip(micro_batches, step_counts, strict=True):
            micro_batch["num_items_in_batch"] = count
        return micro_batches

    # ---------------------------------------------------------------------------------------------------- loss

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
        )
        old_per_token_logps = inputs.get("old_per_token_logps")
        if old_per_token_logps is None:  # evaluation batches are scored on-policy
            old_per_token_logps = per_token_logps.detach()
        # Each rank divides by its share of the step's global count; DDP's gradient average then gives the
        # exact global token-mean.
        num_tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        loss, stats = dapo_policy_loss(
            per_token_logps,
            old_per_token_logps,
            inputs["advantages"],
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            num_tokens=num_tokens,
            clip_ratio_c=self.args.clip_ratio_c,
        )
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        self._log_loss_stats(mode, stats, mask, per_token_logps, old_per_token_logps, entropies)
        return loss

    def _log_loss_stats(self, mode, stats, mask, per_token_logps, old_per_token_logps, entropies) -> None:
        """Token-weighted means over all ranks (a rank's mean weighs by its token count), and the largest
        train/rollout logprob gap; masked sums keep it to one host synchronisation per micro-batch."""
        count = stats.pop("num_active_tokens")
        active = mask.to(per_token_logps.dtype)
        per_token_logps = per_token_logps.detach()

        def active_mean(values: torch.Tensor) -> torch.Tensor:
            return (values * active).sum() / count.clamp(min=1)

        named = {
            **stats,
            "train_logprobs_mean": active_mean(per_token_logps),
            "entropy": active_mean(entropies.detach()),
        }
        weighted = torch.stack([value.float() * count for value in named.values()] + [count])
        totals = self.accelerator.reduce(weighted, reduction="sum")
        gap_max = self.accelerator.reduce(((per_token_logps - old_per_token_logps).abs() * active).max(), "max")
        values = torch.cat([totals[:-1] / totals[-1].clamp(min=1), gap_max.float().view(1)])
        self._append_metrics(mode, [*named, "logprob_gap_max"], values)

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            torch.save(
                {
                    "buffer": _to_cpu(self.sampling_buffer.state_dict()),
                    "prompt_stream": self.prompt_stream.state_dict() if self.prompt_stream is not None else None,
                },
                os.path.join(folder, SAMPLING_STATE_FILE),
            )

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, SAMPLING_STATE_FILE) if checkpoint else None
        if path and os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=False)
            buffer_state = state["buffer"]
            if buffer_state["surplus"] is not None:
                device = self.accelerator.device
                buffer_state["surplus"] = {k: v.to(device) for k, v in buffer_state["surplus"].items()}
            self.sampling_buffer.load_state_dict(buffer_state)
            if self.prompt_stream is not None and state["prompt_stream"] is not None:
                self.prompt_stream.load_state_dict(state["prompt_stream"])


def _to_cpu(state: dict) -> dict:
    surplus = state["surplus"]
    return {**state, "surplus": None if surplus is None else {k: v.cpu() for k, v in surplus.items()}}
