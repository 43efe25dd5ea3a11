"""The trainer as trl-dapo's parts see it: plain values and callables, read from a built `DAPOTrainer` here.

TRL changes its private attributes and methods between minor versions. Besides `trainer.py` (the hooks TRL calls),
this is the one module that reads them (`tests/test_trl_boundary.py` keeps it so, and lists the names read): the
training passes and the rounds take a `TRLView` (defined below them, in `configuration/view.py`), the engine choice
an `EngineSetUp`, the collectors and the stream's scorer their values, so each can be built and tested without a
trainer, and a TRL upgrade is audited in these two files.
"""

from __future__ import annotations

import functools

from trl import GRPOTrainer

from ..models import base_model
from ..rollout.sharded import parameter_gather
from .collection import (
    CandidateRounds,
    Collector,
    EngineSetUp,
    FilterMetric,
    GroupScorer,
    OneRound,
    PartialCandidateRounds,
    PartialRoundRunner,
    PartialRounds,
    StreamedGroups,
    TRLRounds,
    collection_strategy,
)
from .configuration import TRLView


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
