"""Which generation path a DAPOTrainer takes: trl-dapo's paged engine where it serves the set-up, TRL's path
otherwise (logging why), the engine's sampling settings from the config, and its weights kept in step with the
training model's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...models import base_model
from ...rollout import PagedRolloutEngine, TokenSampling
from ...rollout.architectures import unsupported_reason
from ...rollout.fp8 import fp8_unsupported_reason
from ...rollout.sharded import Gather

logger = logging.getLogger(__name__)

# generation_kwargs the engine honours; any other key sends generation back to TRL's path.
SUPPORTED_GENERATION_KWARGS = {"min_new_tokens", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k"}


def token_sampling(args) -> TokenSampling:
    """The engine's sampling settings from a `DAPOConfig`; the head's logits take the precision the training forward's
    do (`cast_lm_head_to_fp32`), so the two compute the same logprobs up to the layers' rounding."""
    kwargs = args.generation_kwargs or {}
    return TokenSampling(
        max_new_tokens=kwargs.get("max_new_tokens", args.max_completion_length),
        temperature=kwargs.get("temperature", args.temperature),
        top_p=kwargs.get("top_p", args.top_p) or 1.0,
        top_k=kwargs.get("top_k", args.top_k) or 0,
        min_new_tokens=kwargs.get("min_new_tokens", 0),
        greedy=kwargs.get("do_sample", True) is False,
        fp32_logits=args.cast_lm_head_to_fp32,
    )


def why_settings_rule_out_engine(args, rollout_func, calls_tools: bool) -> str | None:
    """Why the rollout engine cannot serve these settings whatever the model, or None: known before a model loads."""
    checks = [
        (args.use_vllm, "use_vllm=True: vLLM generates"),
        (rollout_func is not None, "a rollout_func generates"),
        (calls_tools, "tool calling needs TRL's multi-turn loop"),
        (args.use_transformers_continuous_batching, "continuous batching was asked for"),
        (args.min_p is not None or args.repetition_penalty != 1.0, "min_p / repetition_penalty"),
        (bool(set(args.generation_kwargs or {}) - SUPPORTED_GENERATION_KWARGS), "unsupported generation_kwargs"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def unusable_engine(choice: str, reason: str) -> ValueError:
    return ValueError(f"DAPOConfig.rollout_engine={choice!r} cannot be used here: {reason}.")


def check_paged_engine_settings(args, rollout_func, calls_tools: bool, asks: str, otherwise: str) -> None:
    """A setting that needs the paged engine to generate (`asks`, e.g. "partial_rollouts=True"; `otherwise`: the
    way out without it): the settings must let it, as far as they tell before any model loads."""
    if args.rollout_engine == "auto" and args.device.type != "cuda":
        raise paged_engine_needed(args, asks, "without a CUDA device TRL's path generates", otherwise)
    reason = why_settings_rule_out_engine(args, rollout_func, calls_tools)
    if reason is not None:
        raise paged_engine_needed(args, asks, reason, otherwise)


def paged_engine_needed(args, asks: str, reason: str, otherwise: str) -> ValueError:
    """`asks` on a set-up where the paged engine does not generate, and why."""
    return ValueError(
        f"DAPOConfig.{asks} needs trl-dapo's paged engine, which this trainer would not generate with "
        f"(rollout_engine={args.rollout_engine!r}: {reason}). Set rollout_engine='paged' (its CPU path works for "
        f"tests), or {otherwise}."
    )


def fp8_settings(args) -> list[str]:
    """The FP8 rollout fields set to "fp8"."""
    return [name for name in ("rollout_kv_cache_dtype", "rollout_weights_dtype") if getattr(args, name) == "fp8"]


def check_rollout_precision(args, rollout_func, calls_tools: bool) -> None:
    """FP8 rollouts on a device that runs them (FP8 weights: CUDA of compute capability 8.9 or more; an FP8 cache
    also on the CPU, by the reference attention) and by the paged engine, known before any model loads."""
    for name in fp8_settings(args):
        reason = fp8_unsupported_reason(args.device)
        if reason is not None and not (name == "rollout_kv_cache_dtype" and args.device.type == "cpu"):
            raise ValueError(f"DAPOConfig.{name}='fp8' cannot run here: {reason}. Set {name}='bf16'.")
        check_paged_engine_settings(args, rollout_func, calls_tools, f"{name}='fp8'", f"{name}='bf16'")


@dataclass(frozen=True)
class EngineSetUp:
    """What the engine choice reads of a built trainer (`trl_view.engine_set_up`)."""

    args: Any  # the DAPOConfig
    model: torch.nn.Module  # the training model as the engine reads it: no DDP or DeepSpeed wrapper (PEFT's kept)
    device: torch.device
    eos_token_ids: list[int]
    pad_token_id: int
    is_vlm: bool
    rollout_func: Callable | None
    calls_tools: bool
    zero3: bool  # DeepSpeed ZeRO-3 shards the weights
    fsdp1: bool  # FSDP version 1 shards the weights
    gather: Gather  # how the sharded weights are read (`rollout/sharded.py`)
    show_progress: bool


def why_engine_cannot_serve(set_up: EngineSetUp) -> str | None:
    """Why the rollout engine cannot serve this trainer's set-up, or None when it can."""
    args = set_up.args
    settings = why_settings_rule_out_engine(args, set_up.rollout_func, set_up.calls_tools)
    if settings is not None:
        return settings
    architecture = unsupported_reason(base_model(set_up.model).config)
    checks = [
        (set_up.is_vlm, "multimodal model"),
        (architecture is not None, architecture),
        (
            set_up.zero3 and not args.ds3_gather_for_generation,
            "ds3_gather_for_generation=False asks for no full copy of the weights, which the engine keeps",
        ),
        (set_up.fsdp1, "FSDP1 shards the weights (use fsdp_version 2)"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def select_rollout_engine(set_up: EngineSetUp) -> PagedRolloutEngine | None:
    """The engine `rollout_engine` asks for ("auto": the paged engine on CUDA) when the set-up allows, else None."""
    choice = set_up.args.rollout_engine
    if choice == "trl":
        return None
    if set_up.args.use_vllm:  # asked for, so no fall-back ("paged" with it is refused at set-up)
        logger.info("use_vllm=True: vLLM generates (TRL's path), not the paged engine.")
        return None
    on_cuda = set_up.device.type == "cuda"
    if choice == "auto" and not on_cuda:
        logger.info("rollout_engine='auto': no CUDA device, using TRL's generation path.")
        return None
    reason = why_engine_cannot_serve(set_up)
    if reason is not None:
        if choice != "auto":
            raise unusable_engine(choice, reason)
        fp8 = fp8_settings(set_up.args)
        if fp8:  # TRL's path would decode in bf16, the setting ignored
            raise paged_engine_needed(set_up.args, f"{fp8[0]}='fp8'", reason, f"set {fp8[0]}='bf16'")
        logger.warning("rollout_engine='auto' falls back to TRL's generation path: %s.", reason)
        return None
    return PagedRolloutEngine(
        set_up.model,
        eos_token_ids=set_up.eos_token_ids,
        pad_token_id=set_up.pad_token_id,
        dtype=torch.bfloat16 if on_cuda else torch.float32,
        cuda_graph=on_cuda,
        memory_fraction=set_up.args.rollout_memory_fraction,
        max_rows=set_up.args.rollout_max_rows,
        show_progress=set_up.show_progress,
        device=set_up.device,
        gather=set_up.gather,
        kv_cache_dtype=set_up.args.rollout_kv_cache_dtype,
        weights_dtype=set_up.args.rollout_weights_dtype,
    )


def keep_cache_bytes(args, engine: PagedRolloutEngine) -> int:
    """The bytes of KV the carried rows may keep through the training step (`partial_rollout_keep_cache` of the
    device's memory; 0: off), on this rank: each rank's engine keeps its own rows'."""
    return int(args.partial_rollout_keep_cache * engine.memory_bytes())


class EngineWeights:
    """The paged engine's weights, refreshed from the training model once per optimizer step at most (the weights
    change once per step): rounds and the stream both generate with it."""

    def __init__(self, engine: PagedRolloutEngine, model: Callable[[], torch.nn.Module]) -> None:
        self.engine, self.model, self.step = engine, model, None

    def current(self, step: int) -> PagedRolloutEngine:
        if self.step != step:
            self.engine.sync_weights(self.model())
            self.step = step
        return self.engine
