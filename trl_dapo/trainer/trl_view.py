"""The trainer as trl-dapo's parts see it: plain values and callables, read from a built `DAPOTrainer` here.

TRL changes its private attributes and methods between minor versions. Besides `trainer.py` (the hooks TRL calls),
this is the one module that reads them (`tests/test_trl_boundary.py` keeps it so, and lists the names read): the
training passes and the rounds take a `TRLView`, the engine choice an `EngineSetUp`, the collectors and the stream's
scorer their values, so each can be built and tested without a trainer, and a TRL upgrade is audited in these two
files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from transformers import TrainerState
from trl import GRPOTrainer

from ..models import base_model
from ..rollout.sharded import parameter_gather
from .collect import CandidateRounds, Collector, OneRound
from .engine_choice import EngineSetUp
from .partial import PartialCandidateRounds, PartialRoundRunner, PartialRounds
from .round import TRLRounds
from .scoring import FilterMetric, GroupScorer
from .set_up import collection_strategy
from .streamed import StreamedGroups


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


def view_of(trainer: GRPOTrainer) -> TRLView:
    sharded_at_load = getattr(trainer, "is_distributed_loading_by_transformers", False)
    return TRLView(
        args=trainer.args,
        accelerator=trainer.accelerator,
        num_generations=trainer.num_generations,
        pad_token_id=trainer._tokenizer.pad_token_id,
        metrics=trainer._metrics,
        model=lambda: trainer.model,
        base_model=lambda: base_model(trainer.accelerator.unwrap_model(trainer.model)),
        state=lambda: trainer.state,
        generate_and_score=trainer._generate_and_score_completions,
        padded_logprobs=functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer),
        is_vlm=trainer._is_vlm,
        defer_fsdp_reduction=trainer._defer_fsdp_gradient_reduction if sharded_at_load else None,
    )


def engine_set_up(trainer: GRPOTrainer) -> EngineSetUp:
    """What the engine choice reads of the built trainer (`engine_choice.select_rollout_engine`)."""
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    model = trainer.accelerator.unwrap_model(trainer.model)
    return EngineSetUp(
        args=trainer.args,
        model=model,
        device=trainer.accelerator.device,
        eos_token_ids=trainer.eos_token_ids,
        pad_token_id=trainer._tokenizer.pad_token_id,
        is_vlm=trainer._is_vlm,
        rollout_func=trainer.rollout_func,
        calls_tools=bool(trainer.tools),
        zero3=zero3,
        fsdp1=trainer.is_fsdp_enabled and not trainer.accelerator.is_fsdp2,
        gather=parameter_gather(zero3, trainer.is_fsdp_enabled, model),
        show_progress=trainer.accelerator.is_main_process and not trainer.args.disable_tqdm,
    )


def collector(trainer: GRPOTrainer, rounds: TRLRounds, filter_metric: FilterMetric) -> Collector:
    """The collector `dynamic_sampling`, `dynamic_sampling_mode` and `partial_rollouts` ask for, with its
    collaborators; which groups are kept is the buffer's `keep_groups`, in rounds and in the stream."""
    args, strategy, accelerator = trainer.args, collection_strategy(trainer.args), trainer.accelerator
    if strategy is OneRound:
        return OneRound(rounds, accelerator)
    G = trainer.num_generations
    target = args.generation_batch_size // G
    progress = accelerator.is_main_process and not args.disable_tqdm
    if strategy in (PartialRounds, PartialCandidateRounds):
        runner = PartialRoundRunner(
            rounds, trainer.engine_weights, trainer.prompt_stream, trainer._tokenize_prompts, accelerator, args,
            target, G,
        )  # fmt: skip
        if strategy is PartialRounds:
            return PartialRounds(runner, accelerator, target, G)
        return PartialCandidateRounds(runner, trainer.sampling_buffer, trainer.prompt_stream, accelerator, target,
                                      progress)  # fmt: skip
    common = (rounds, trainer.sampling_buffer, trainer.prompt_stream, accelerator)
    if strategy is CandidateRounds:
        return CandidateRounds(*common, target, progress)
    names = trainer.reward_func_names
    StreamedGroups.check_built(args, trainer.engine_weights, trainer.reward_funcs, names, trainer._tokenizer)
    scorer = GroupScorer(
        trainer.reward_funcs,
        names,
        trainer.num_task_rewards,
        trainer.processing_class.batch_decode,
        trainer._log_metric,
        lambda: trainer.state,
        filter_metric,
    )
    return StreamedGroups(*common, trainer.engine_weights, scorer, trainer._tokenize_prompts, args, target)
