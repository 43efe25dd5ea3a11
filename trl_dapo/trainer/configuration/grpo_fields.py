"""Which `GRPOConfig` fields `DAPOTrainer` honours, and the check that rejects the others when set.

The list below names the fields DAPOTrainer honours: TRL applies them (model loading, generation, vLLM, logging) or
DAPO implements them. Every other field `GRPOConfig` adds to `TrainingArguments` must keep its default: a field
DAPOTrainer would silently ignore is an error naming it, and so is any field a later TRL adds, until it is
reviewed and listed here. `TrainingArguments` fields are the HF Trainer's, which DAPOTrainer runs unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments
from trl import GRPOConfig

from .field_rules import invalid_value

HONOURED_FIELDS = frozenset(
    {
        # model loading and the forward pass (TRL)
        "model_init_kwargs",
        "trust_remote_code",
        "router_aux_loss_coef",
        "disable_dropout",
        "cast_lm_head_to_fp32",
        # batches and groups
        "num_generations",
        "num_generations_eval",
        "generation_batch_size",
        "steps_per_generation",
        "num_iterations",
        "shuffle_dataset",
        "pad_to_multiple_of",
        # generation (TRL's paths, or the rollout engine, which falls back to them for what it cannot do)
        "max_completion_length",
        "ds3_gather_for_generation",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "generation_kwargs",
        "chat_template_kwargs",
        "repetition_penalty",
        "cache_implementation",
        "max_tool_calling_iterations",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
        "use_vllm",
        "vllm_mode",
        "vllm_model_impl",
        "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout",
        "vllm_group_port",
        "vllm_gpu_memory_utilization",
        "vllm_max_model_length",
        "vllm_tensor_parallel_size",
        # rewards, advantages and the loss (DAPOConfig validates the combinations dynamic sampling cannot serve)
        "reward_weights",
        "multi_objective_aggregation",
        "scale_rewards",
        "epsilon",
        "epsilon_high",
        "mask_truncated_completions",
        # logging
        "log_completions",
        "log_multimodal",
        "num_completions_to_print",
        "log_unique_prompts",
        "log_completions_hub_repo",
    }
)

_KL = "DAPO has no KL term and no reference model (use trl.GRPOTrainer for a KL penalty)"
_ENTROPY = "entropy regularisation is not part of DAPO"
_VLLM_IS = (
    "TRL's correction applies to vLLM only; DAPOTrainer's old_logprobs='recompute' with rollout_correction "
    "('token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask'; rollout_correction_max / _min) is the "
    "same correction for every generation path (its sequence level is the geometric mean of the token ratios, TRL's "
    "their product): set those instead"
)
# Why a field is not honoured, for the error message; fields missing here get a generic reason.
REASONS = {
    "beta": _KL,
    "use_bias_correction_kl": _KL,
    "sync_ref_model": _KL,
    "ref_model_mixup_alpha": _KL,
    "ref_model_sync_steps": _KL,
    "loss_type": "DAPOTrainer computes its own token-level loss, an exact mean over each optimizer step",
    "delta": "the upper bound on the ratio of TRL's two-sided clipping; DAPO caps negative-advantage tokens with "
    "clip_ratio_c instead",
    "importance_sampling_level": "DAPO clips the ratio per token",
    "off_policy_mask_threshold": "off-policy sequence masking is not part of DAPO",
    "top_entropy_quantile": _ENTROPY,
    "entropy_coef": _ENTROPY,
    "use_adaptive_entropy": _ENTROPY,
    "entropy_coef_min": _ENTROPY,
    "entropy_coef_max": _ENTROPY,
    "entropy_coef_delta": _ENTROPY,
    "entropy_target": _ENTROPY,
    "vllm_importance_sampling_correction": _VLLM_IS,
    "vllm_importance_sampling_mode": _VLLM_IS,
    "vllm_importance_sampling_clip_max": _VLLM_IS,
    "vllm_importance_sampling_clip_min": _VLLM_IS,
    "vllm_importance_sampling_cap": _VLLM_IS,
}
for _name in ("sapo_temperature_neg", "sapo_temperature_pos"):
    REASONS[_name] = "a parameter of TRL's 'sapo' loss; DAPOTrainer uses its own loss"
for _name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
    REASONS[_name] = "a parameter of TRL's 'vespo' loss; DAPOTrainer uses its own loss"
GENERIC_REASON = "DAPOTrainer does not implement this GRPOConfig field"


def grpo_only_fields() -> list[str]:
    """Fields `GRPOConfig` adds to `TrainingArguments`, in the installed TRL."""
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in inherited]


def unhonoured_fields() -> list[str]:
    """The fields `GRPOConfig` adds that DAPOTrainer does not honour: each must keep its default."""
    return [name for name in grpo_only_fields() if name not in HONOURED_FIELDS]


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default, its factory's value where it has one."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def unhonoured_settings(config: GRPOConfig) -> list[tuple[str, Any, Any, str]]:
    """`(field, value, default, reason)` for each field DAPOTrainer does not honour that is set away from its default.

    The default is the config class's own: GRPOConfig's, or DAPOConfig's where DAPO sets a field to the value under
    which it has no effect (e.g. `vllm_importance_sampling_correction=False`).
    """
    defaults = {f.name: field_default(f) for f in dataclasses.fields(config)}
    return [
        (name, getattr(config, name), defaults[name], REASONS.get(name, GENERIC_REASON))
        for name in unhonoured_fields()
        if getattr(config, name) != defaults[name]
    ]


def reject_unhonoured_settings(config: GRPOConfig) -> None:
    """A GRPOConfig field DAPOTrainer does not honour, set away from its default, would be silently ignored."""
    for name, value, default, reason in unhonoured_settings(config):
        raise invalid_value(name, value, f"{reason}; leave it at its default {default!r}.")
