"""`DAPOTrainer`: TRL's `GRPOTrainer` with the DAPO loss, ratios against the rollout (or recomputed) policy, an exact
token-mean, dynamic sampling and padding-free training. It keeps TRL's hooks and hands their work on:

- `_prepare_inputs`: a generation batch from the collector the config chose (`collect.py`: one round, candidate
  rounds or streamed groups, each round through TRL's own method, `round.py`), dealt to micro-batches and passes
  (`passes.py`); evaluation batches stay TRL's.
- `_generate_single_turn`, `_calculate_rewards`: inside a round, generate with the paged rollout engine where it
  serves (stream mode: hand back what the stream generated and scored) and record the engine's logprobs and the raw
  rewards in the round's context, which TRL's output drops.
- `_tokenize_prompts`: TRL's, with each prompt checked first (missing, empty, longer than `max_prompt_length`;
  `prompts.py`), in every generation path, evaluation's included.
- `_get_per_token_logps_and_entropies`, `_compute_loss`: every logprob forward (packed where it applies) and each
  micro-batch's passes with the DAPO loss (`passes.py`, `loss.py`, `mismatch.py`); each training loss is handed to
  the callback that skips a step whose loss or gradient is not finite (`finite_steps.py`).
- `train`, `evaluation_loop`: padding-free, the model's attention goes through the packed dispatcher while they run
  and is set back after (the model is the caller's); `resume_from_checkpoint=True` resumes from the newest complete
  checkpoint (`checkpoint_files.py`).
- `_get_train_sampler`, `get_resumed_dataloader`: TRL's sampler, each epoch's order restored when a run resumes in a
  later epoch (`epoch_order.py`).
- `log`: `dapo/skipped_steps` and `dapo/nonfinite_steps` as the counts they are. `_save_checkpoint` /
  `_load_optimizer_and_scheduler`: the buffer's surplus, every rank's carried groups (partial rollouts), the prompt
  stream's position and the skipped-step counts; inside a generation batch, each rank's micro-batches still to train;
  written before the Trainer's files, then a manifest of every file, all synced, and only then are older checkpoints
  deleted (`checkpoint_files.py`, `checkpoint_manifest.py`); resumed weights checked finite. `_load_from_checkpoint`,
  `_issue_warnings_after_load`: weights that cannot be read or lack a tensor (a tied one is no loss) an error naming
  the file; the Trainer's other files read first, what they lack an error, a file absent a warning
  (`resume_checks.py`).
- `_run_epoch`: nothing for a run resumed at or past `max_steps`.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, ClassVar

import torch
from accelerate.utils import gather_object
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, TrainOutput, rotate_checkpoints
from trl import GRPOTrainer

from ..gguf import gguf_model_for_trainer
from ..integrity import RolloutIntegrityError, check_rewards, check_weighted_total, checked_reward_function
from ..models import ensure_float32_rotary
from ..rewards.overlong import OVERLONG_REWARD_NAME, OverlongPenalty
from ..rollout_batch import SAMPLING_STEP, RolloutBatch, num_rows
from ..sampling import DynamicSamplingBuffer, GenerationStats, filter_groups, make_prompt_stream
from .collection import (
    EngineWeights,
    FilterMetric,
    TRLRounds,
    check_vllm_server_logprobs,
    round_scores,
    select_rollout_engine,
    token_sampling,
)
from .configuration import (
    DAPOConfig,
    check_batch_prompts,
    check_prompt_ids,
    prompt_token_limit,
    quiet_trl_checkpointing_calls,
    warn_if_cpu_bf16_is_emulated,
)
from .safety import (
    SAMPLING_STATE_FILE,
    EpochOrder,
    FiniteSteps,
    MissingTensors,
    check_trainer_files,
    checkpoint_to_resume,
    full_disk_named,
    load_carried,
    load_generation_batch,
    older_checkpoints_kept,
    read_sampling_state,
    resume_files,
    sampling_state_path,
    save_checkpoint_file,
    save_generation_batch,
    set_resumed_epoch,
    trainer_files,
    untied_missing_keys,
    weights_named,
    write_manifest,
)
from .set_up import check_set_up, filter_column
from .training import (
    MicroBatch,
    TrainingPasses,
    append_metrics,
    rollout_metrics,
    set_up_padding_free,
    trained_batch_metric_names,
    trained_batch_metrics,
)
from .trl_view import collector, engine_set_up, view_of

logger = logging.getLogger(__name__)


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
        args = args.checked_copy()  # checked again (a field may have changed since), never the caller's object
        # TRL replaces hub ids by loaded models inside these lists: hand it copies, never the caller's own.
        if isinstance(reward_funcs, list):
            reward_funcs = list(reward_funcs)
        if isinstance(kwargs.get("reward_processing_classes"), list):
            kwargs["reward_processing_classes"] = list(kwargs["reward_processing_classes"])
        set_up = ("train_dataset", "eval_dataset", "tools", "rollout_func", "environment_factory")
        check_set_up(args, reward_funcs, **{name: kwargs.get(name) for name in set_up})  # before any model loads
        quiet_trl_checkpointing_calls()  # TRL calls transformers' deprecated checkpointing aliases
        built_by_trainer = isinstance(model, str)
        model, args = self._load_gguf(model, args, kwargs)
        super().__init__(model, reward_funcs, args, **kwargs)
        check_vllm_server_logprobs(args, getattr(self, "vllm_generation", None), self.accelerator)
        warn_if_cpu_bf16_is_emulated(args.bf16, self.accelerator.device)
        ensure_float32_rotary(self.model, built_by_trainer=built_by_trainer)
        positions = getattr(self.accelerator.unwrap_model(self.model).config, "max_position_embeddings", None)
        self.prompt_limit = prompt_token_limit(args.max_prompt_length, positions, args.max_completion_length)
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
        # the group filter's one injection point: the buffer holds it for the rounds and hands it to the stream
        self.sampling_buffer = DynamicSamplingBuffer(
            num_generations=self.num_generations,
            pad_token_id=self._tokenizer.pad_token_id,
            keep_groups=filter_groups,
            max_num_gen_batches=args.max_num_gen_batches,
            on_limit=args.dynamic_sampling_on_limit,
            keep_surplus=args.dynamic_sampling_keep_surplus,
            max_surplus_age=args.max_surplus_age,
            oversample=args.dynamic_sampling_oversample,
            max_oversample=args.dynamic_sampling_max_oversample,
        )
        # extra prompts: dynamic sampling's extra rounds, and the rows partial rollouts admit beyond a batch
        self.prompt_stream = (
            make_prompt_stream(self.train_dataset, seed=args.seed + 1, shuffle=self.shuffle_dataset)
            if args.dynamic_sampling or args.partial_rollouts
            else None
        )
        self.paged_engine = select_rollout_engine(engine_set_up(self))
        self.engine_weights = (
            EngineWeights(self.paged_engine, lambda: self.accelerator.unwrap_model(self.model))
            if self.paged_engine is not None
            else None
        )
        view = view_of(self)
        self.padding_free = set_up_padding_free(view)
        clips = dict(epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, clip_ratio_c=args.clip_ratio_c)
        router_aux_loss_coef = self.router_aux_loss_coef if self.aux_loss_enabled else None
        self.passes = TrainingPasses(view, self.padding_free, clips, router_aux_loss_coef, self.num_iterations)
        self.finite_steps = FiniteSteps(self.accelerator, fp16=args.fp16)
        self.add_callback(self.finite_steps)
        column = filter_column(args.dynamic_sampling_metric, self.reward_func_names, args.dynamic_sampling)
        filter_metric = FilterMetric(column, self.reward_weights)
        self.rounds = TRLRounds(
            view,
            recompute_logprobs=lambda batch: self.passes.no_grad_logprobs(batch, args.per_device_train_batch_size),
            filter_metric=filter_metric,
            trained_batch_metric_names=trained_batch_metric_names(self.reward_func_names),
        )
        self.collector = collector(self, self.rounds, filter_metric)

    @staticmethod
    def _load_gguf(model, args: DAPOConfig, kwargs: dict[str, Any]) -> tuple[Any, DAPOConfig]:
        """A GGUF model (a `.gguf` path, `model_init_kwargs["gguf_file"]`, or a model transformers loaded from one),
        which GRPOTrainer cannot load or fine-tune, loaded dense here with its tokenizer (`gguf.py`). Loaded from a
        name, the `model_init_kwargs` used here are cleared in the trainer's own copy of `args`: else TRL warns that
        they were ignored."""
        loaded = gguf_model_for_trainer(model, args, kwargs.get("processing_class"), kwargs.get("quantization_config"))
        if loaded is None:
            return model, args
        named, (model, kwargs["processing_class"]) = isinstance(model, str), loaded
        if named:
            args.model_init_kwargs = None
        return model, args

    # ----------------------------------------------------------------------------------------------- generation

    def _tokenize_prompts(self, prompts: list):
        """TRL's, with each prompt checked before anything is generated from it (`prompts.py`)."""
        check_batch_prompts(prompts)
        tokenized = super()._tokenize_prompts(prompts)
        check_prompt_ids(prompts, tokenized[0], *self.prompt_limit)
        return tokenized

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        context = self.rounds.current
        if context is None or not self.model.training:  # evaluation: TRL's own
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if context.streamed is not None:  # stream mode, a partial round: these rows are already generated
            if [list(ids) for ids in prompt_ids] != context.streamed.prompt_ids:
                raise RolloutIntegrityError(
                    "stream mode: the prompts TRL tokenized differ from the ones the stream generated for."
                )
            context.record_generation(context.streamed.logprobs)
            return context.streamed.completions, None
        if self.paged_engine is None or images is not None or multimodal_fields:
            context.record_trl_generation()  # again for each tool-calling turn
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        engine = self.engine_weights.current(self.state.global_step)
        output = engine.generate(prompt_ids, token_sampling(self.args))
        # The logprobs stay on the device for the round: as Python lists TRL would rebuild them row by row.
        context.record_generation(output.logprobs, GenerationStats.from_engine(output.stats))
        return output.completions, None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        context = self.rounds.current
        if context is None or context.streamed is None or context.streamed.rewards is None:
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        else:  # stream mode scored these rows as their groups ended: gather them as TRL gathers its own
            rewards_per_func = self.accelerator.gather(context.streamed.rewards.to(self.accelerator.device))
        # The overlong penalty shapes a score but is none: a completion the task functions all skip is unscored.
        task = slice(0, self.num_task_rewards)
        check_rewards(
            rewards_per_func[:, task], len(prompts) * self.accelerator.num_processes, self.reward_func_names[task]
        )
        check_weighted_total(rewards_per_func, self.reward_weights)
        if context is not None:  # evaluation batches stay TRL's own
            ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            context.record_scores(round_scores(rewards_per_func, completion_ids_list, ends, self.accelerator))
        return rewards_per_func

    def _collect_generation_batch(self, inputs: list[dict[str, Any]]) -> RolloutBatch:
        """The global generation batch (every rank's rows), from the collector the config chose (`collect.py`)."""
        step = self.state.global_step
        batch, sampling, generation = self.collector.collect(inputs, step)
        # the engine's counts and what partial rollouts carried; dynamic sampling's counts, and TRL's metrics for the
        # accepted groups; DAPO's rollout metrics in every mode
        values = generation.metrics() | ({} if sampling is None else sampling.metrics())
        if num_rows(batch):
            values |= rollout_metrics(batch, self.reward_func_names, step, self.num_generations)
            if sampling is not None:
                values |= trained_batch_metrics(
                    batch, self.reward_weights, self.reward_func_names, self.num_generations
                )
        append_metrics(self._metrics["train"], values)
        batch.pop(SAMPLING_STEP)  # read by the metrics only
        return batch

    # ------------------------------------------------------------------------------------------- micro-batches

    def _prepare_inputs(self, generation_batch: Any) -> MicroBatch | dict[str, torch.Tensor | Any]:
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)  # TRL's evaluation batch, scored as one pass
        if self._step % self._generate_every() == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self.passes.micro_batches(self._collect_generation_batch(generation_batch))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _get_train_sampler(self, dataset: Any = None) -> EpochOrder:
        """TRL's sampler, each epoch's order restored when a run resumes in a later epoch (`epoch_order.py`)."""
        return EpochOrder(super()._get_train_sampler(dataset))

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The Trainer's, the resumed epoch's order set first: on several processes the skipping dataloader does not
        hand `set_epoch` on to the sampler (`epoch_order.py`). Called for the resumed epoch only, inside it."""
        set_resumed_epoch(dataloader, int(self.state.epoch))
        return super().get_resumed_dataloader(dataloader, num_batches)

    def add_metrics(self, values: dict[str, float]) -> None:
        """Training metrics that join the next log, averaged with the other values since the last one (as TRL's
        are): what a callback measures between logs (`evaluation.MathAccuracyCallback`)."""
        append_metrics(self._metrics["train"], values)

    def flush_metrics(self) -> None:
        """Log the training metrics added since the last log, if any: at the end of training no later log comes."""
        if self._metrics["train"]:
            self.log({})

    def _generate_every(self) -> int:
        """Micro-steps (`training_step` calls) from one generation batch to the next."""
        return self.args.steps_per_generation * self.num_iterations

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`dapo/skipped_steps` and `dapo/nonfinite_steps` are running counts: logged as they stand, not averaged like
        TRL's per-step metrics."""
        if self.model.training and "loss" in logs:
            logs["dapo/skipped_steps"] = float(self.passes.skipped_steps)
            logs["dapo/nonfinite_steps"] = float(self.finite_steps.skipped_steps)
        super().log(logs, start_time)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """The Trainer's, with the model's attention switched for padding-free passes only while it runs.
        `resume_from_checkpoint=True` resumes from the newest complete checkpoint (the Trainer takes the highest
        number, which a killed save leaves incomplete), and starts from step 0 where there is none; both with a
        warning. A checkpoint path that is incomplete is refused with the reason (`checkpoint_files.py`)."""
        resume_from_checkpoint, warnings = checkpoint_to_resume(
            resume_from_checkpoint,
            self.args.output_dir,
            resume_files(self.args.save_only_model, self.is_deepspeed_enabled or self.is_fsdp_enabled),
        )
        for warning in warnings if self.accelerator.is_main_process else []:
            logger.warning(warning)
        with self.passes.attention():
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:
        """The Trainer's (`evaluate`, `predict`), its scoring passes packed as training's are."""
        with self.passes.attention():
            return super().evaluation_loop(*args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's, but nothing for a run resumed at or past `max_steps` (a finished job restarted): the
        Trainer would train one step more before it checks, and with `save_total_limit` delete the last checkpoint."""
        if self.state.global_step < self.state.max_steps:
            super()._run_epoch(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------------- loss

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """Every logprob forward, TRL's included: padding-free where it applies (`passes.py`)."""
        return self.passes.logprobs(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        loss = self.passes.loss(model, inputs)
        if isinstance(inputs, MicroBatch):  # a training step's: checked for a non-finite value (`finite_steps.py`)
            self.finite_steps.record_loss(loss, inputs.ends_step, self.state.global_step + 1)
        return loss

    # ------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial):
        """DAPO's files first, then the Trainer's, then the manifest of them all, each synced: only then are older
        checkpoints deleted, so none goes before the new one is complete (`checkpoint_files.py`). Never non-finite
        weights; a full disk is an error naming the checkpoint."""
        self.finite_steps.check_weights(self.model, self.state.global_step)
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):  # this step's, saved before: none of it is listed anew
            shutil.rmtree(folder)
        self.accelerator.wait_for_everyone()
        if position := self._step % self._generate_every():  # inside a generation batch
            save_generation_batch(folder, self.accelerator, position, self._buffered_inputs)
        self._save_sampling_state(folder)
        with full_disk_named(folder), older_checkpoints_kept(self):
            super()._save_checkpoint(model, trial)
        self.accelerator.wait_for_everyone()  # every rank's files are written before the manifest lists them
        if self.args.should_save:
            write_manifest(folder)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)

    def _save_sampling_state(self, folder: str) -> None:
        """The buffer's surplus, every rank's carried groups, the prompt stream's position and the skipped-step counts
        (gathered by every rank, written by the main one)."""
        carried = self.collector.carried
        every_rank = gather_object([carried.state_dict()]) if carried is not None else None
        if self.args.should_save:
            state = {
                "buffer": self.sampling_buffer.state_dict(),
                "prompt_stream": self.prompt_stream.state_dict() if self.prompt_stream is not None else None,
                "skipped_steps": self.passes.skipped_steps,
                "nonfinite_steps": self.finite_steps.skipped_steps,
                "carried": every_rank,
                "writes_manifest": True,  # this folder without its manifest is a save interrupted
            }
            os.makedirs(folder, exist_ok=True)
            save_checkpoint_file(state, os.path.join(folder, SAMPLING_STATE_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The Trainer's; weights it cannot read, or lacking a tensor, are an error naming the file."""
        with weights_named(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """The Trainer's, but a tied tensor (stored once) is not missing, and a missing one is an error."""
        missing = untied_missing_keys(self.model, load_result.missing_keys)
        if set(missing) - set(getattr(self.model, "_keys_to_ignore_on_save", None) or ()):  # the Trainer ties these
            raise MissingTensors(missing)
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _load_optimizer_and_scheduler(self, checkpoint):
        path = sampling_state_path(checkpoint, self.args.dynamic_sampling or self.args.partial_rollouts)
        if checkpoint:  # the Trainer's files read first: what cannot be used is an error, what is absent a warning
            sharded = self.is_deepspeed_enabled or self.is_fsdp_enabled
            files = trainer_files(sharded, self.lr_scheduler, self.args.world_size)
            if (fresh := check_trainer_files(checkpoint, files)) and self.accelerator.is_main_process:
                logger.warning(fresh)
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint:
            self._check_resumed(checkpoint)
        if path and os.path.exists(path):
            with read_sampling_state(path, checkpoint) as state:
                self.sampling_buffer.load_state_dict(state["buffer"], self.accelerator.device)
                if self.prompt_stream is not None and state["prompt_stream"] is not None:
                    self.prompt_stream.load_state_dict(state["prompt_stream"])
                self.passes.skipped_steps = state["skipped_steps"]
                self.finite_steps.skipped_steps = state.get("nonfinite_steps", 0)  # absent from earlier checkpoints
                load_carried(self.collector.carried, state.get("carried"), checkpoint, self.accelerator)
        inside_batch = self.state.global_step * self.args.gradient_accumulation_steps % self._generate_every() != 0
        saved = load_generation_batch(checkpoint, self.accelerator, inside_batch) if checkpoint else None
        if saved is not None:  # train the rest of the saved generation batch before the next is generated
            self._buffered_inputs, self._step = saved

    def _check_resumed(self, checkpoint: str) -> None:
        """Refuse non-finite weights now (sampling would fail on them with "probability tensor contains inf/nan"),
        and say where the resumed run is at or past `max_steps`: nothing is trained (`_run_epoch`)."""
        self.finite_steps.check_resumed_weights(self.model, checkpoint)
        if self.state.global_step >= self.state.max_steps and self.accelerator.is_main_process:
            logger.warning(
                "resume_from_checkpoint=%r is at step %d, at or past max_steps=%d: nothing is trained, and the "
                "checkpoint is kept. Raise max_steps to train further.",
                checkpoint,
                self.state.global_step,
                self.state.max_steps,
            )
