"""The study's arms: which trainer and which fields each kind of run has. Every arm shares the model copy, the data,
the learning rate, the batch, the temperature and the length cap (`shared_fields`); the DAPO arms differ only in
the fields of `DAPO_ARMS`:

| kind | what it is |
|---|---|
| `dapo` | full DAPO: Clip-Higher (0.2 / 0.28), dynamic sampling on accuracy, token-mean loss, soft overlong punishment over the cap's last quarter, the paged rollout engine, padding-free passes where flash attention runs |
| `grpo_settings` | the same trainer and engine with GRPO's settings: symmetric clip 0.2, no dynamic sampling, no overlong punishment (the loss stays the token-mean, `DAPOTrainer`'s only one) |
| `dapo_partial_kept` | full DAPO with partial rollouts whose carried rows keep their KV cache across the step |
| `dapo_no_dynamic_sampling`, `dapo_symmetric_clip`, `dapo_no_overlong` | full DAPO less one piece |
| `trl_grpo` | TRL's `GRPOTrainer` with its defaults on transformers `generate` (wall-clock) |
| `trl_grpo_vllm` | the same with vLLM colocated in the process (wall-clock; skipped where vLLM is not importable) |
| `trl_grpo_continuous_batching` | the same with transformers' continuous batching (wall-clock) |
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

from trl import GRPOConfig, GRPOTrainer

from ablation.variants import machinery_fields
from trl_dapo import DAPOConfig, DAPOTrainer

from .config import (
    DAPO,
    GRPO,
    NO_DYNAMIC_SAMPLING,
    NO_OVERLONG,
    PARTIAL,
    SYMMETRIC_CLIP,
    TRL_CONTINUOUS,
    TRL_GRPO,
    TRL_VLLM,
    RealModelConfig,
)

ACCURACY = "accuracy"  # the reward's name: dynamic sampling filters on it
# Of a process's share of the device, what its rollout engines (and vLLM) may plan their KV pool in: the rest is
# headroom for the sampling head's chunks, the training state and the allocator's slack. Planned in the whole share,
# every DAPO run of the first H100 study ran out of memory in an evaluation's sampling head.
ENGINE_PART = 0.75
# vLLM's whole footprint (weights, activations, graphs, KV cache) in a share, for the whole run. Its KV cache is
# allocated in the same process and counted in the budget the evaluation engine plans in, so the two parts must leave
# that budget room for the training state and the evaluation's own pool (`evaluation_plan`).
VLLM_PART = 0.25
EVALUATION_ROWS_BESIDE_VLLM = 128  # rows the evaluation engine decodes at once beside vLLM (512 elsewhere)
KEPT_CACHE_PART = 0.05  # of the share: the carried rows' KV held through the training step (partial rollouts)
PROMPT_ROOM = 160  # tokens of the longest chat-templated prompt, with room (the DAPO template is about 110)
CACHE_PAGE = 256  # tokens per page of transformers' continuous-batching cache (its default)

# The fields that tell the DAPO arms apart, on top of full DAPO's.
DAPO_ARMS: dict[str, dict[str, Any]] = {
    DAPO: {},
    GRPO: {"clip_higher": False, "dynamic_sampling": False, "overlong": False},
    PARTIAL: {"partial_rollouts": True},
    NO_DYNAMIC_SAMPLING: {"dynamic_sampling": False},
    SYMMETRIC_CLIP: {"clip_higher": False},
    NO_OVERLONG: {"overlong": False},
}


def vllm_missing(device: str) -> str | None:
    """Why TRL's vLLM arm cannot run here, or None."""
    if device != "cuda":
        return "vLLM generates on CUDA only: the arm runs on a GPU machine"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not importable here (install it first; see benchmarks/README.md): the arm is skipped"
    return None


def shared_fields(config: RealModelConfig, job: dict, output_dir: str) -> dict[str, Any]:
    """The fields every arm shares: model precision, data order, batch geometry, optimizer, sampling."""
    return dict(
        output_dir=output_dir,
        seed=job["seed"],
        data_seed=job["seed"],
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=config.micro_batch_rows,
        gradient_checkpointing=True,  # both trainers' default, set so the study does not follow a changed default
        gradient_accumulation_steps=config.accumulation_steps,
        steps_per_generation=config.accumulation_steps * config.optimizer_steps_per_generation,
        num_generations=config.num_generations,
        max_steps=job["max_steps"],
        learning_rate=job["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_completion_length=job["task"]["cap"],
        temperature=job["task"]["temperature"],
        top_p=1.0,
        **machinery_fields(config.bf16, config.device),
    )


def trl_fields(config: RealModelConfig, kind: str, job: dict, share: float) -> dict[str, Any]:
    """What TRL's generation path needs beyond its defaults: vLLM colocated within the process's share, or a
    continuous-batching cache sized for one generation batch (its default takes half the device's free memory,
    which other runs on the device hold)."""
    if kind == TRL_VLLM:
        return dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=VLLM_PART * share,
                    vllm_max_model_length=PROMPT_ROOM + job["task"]["cap"])  # fmt: skip
    if kind == TRL_CONTINUOUS:
        rows = config.rows_per_step * config.optimizer_steps_per_generation
        pages = rows * math.ceil((PROMPT_ROOM + job["task"]["cap"]) / CACHE_PAGE)
        cache = {"num_blocks": pages, "max_batch_tokens": 4096}
        return dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config=cache)
    return {}


def evaluation_plan(config: RealModelConfig, job: dict, share: float) -> dict:
    """What the run's evaluation engine plans its KV pool in: `memory_fraction` of the device, counting everything the
    process holds (vLLM included), at most `max_rows` rows and `max_cache_tokens` tokens at once. Beside vLLM, whose
    part of the share stays allocated through the run, the pool is bounded in tokens so it needs no more than the
    share leaves: planned like the other arms', it got no memory at all in the study's first H100 run (2026-12-07)."""
    if job.get("arm", job["kind"]) != TRL_VLLM:
        return {"memory_fraction": ENGINE_PART * share, "max_rows": config.engine_max_rows, "max_cache_tokens": None}
    rows = EVALUATION_ROWS_BESIDE_VLLM
    return {"memory_fraction": ENGINE_PART * share, "max_rows": rows,
            "max_cache_tokens": rows * (PROMPT_ROOM + job["task"]["cap"])}  # fmt: skip


def trainer_args(config: RealModelConfig, job: dict, output_dir: str, share: float):
    """The run's trainer class and its config."""
    values = shared_fields(config, job, output_dir)
    kind = job.get("arm", job["kind"])
    if kind in (TRL_GRPO, TRL_VLLM, TRL_CONTINUOUS):
        return GRPOTrainer, GRPOConfig(**values, **trl_fields(config, kind, job, share))
    arm = {"clip_higher": True, "dynamic_sampling": True, "overlong": True, "partial_rollouts": False}
    arm |= DAPO_ARMS[kind]
    partial = arm["partial_rollouts"]
    return DAPOTrainer, DAPOConfig(
        **values,
        beta=0.0,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high if arm["clip_higher"] else config.epsilon,
        clip_ratio_c=None,  # the dual clip is in neither the paper's objective nor GRPO's
        dynamic_sampling=arm["dynamic_sampling"],
        dynamic_sampling_metric=ACCURACY,
        dynamic_sampling_oversample="auto",
        dynamic_sampling_max_oversample=config.dynamic_sampling_max_oversample,
        max_num_gen_batches=config.max_num_gen_batches,
        overlong_buffer_len=config.overlong_buffer(job["task"]["cap"]) if arm["overlong"] else 0,
        rollout_engine="paged",
        rollout_memory_fraction=ENGINE_PART * share,
        partial_rollouts=partial,
        partial_rollout_keep_cache=KEPT_CACHE_PART * share if partial else 0.0,
        padding_free=None,  # on where flash attention runs (CUDA, bf16)
    )
