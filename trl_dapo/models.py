"""What both the rollout engine and the training passes read of a transformers model: the model under a PEFT
wrapper, the attention window it was trained with, and rotary frequencies that must be float32 for both."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def sliding_window(config) -> int | None:
    """The attention window of a model that uses one shorter than its context (Mistral v0.1's 4,096), else None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return window if window < (getattr(config, "max_position_embeddings", None) or window + 1) else None


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _low_precision_rotary(model) -> list[tuple[str, torch.nn.Module]]:
    """The rotary modules (named) whose frequencies are not float32. DeepSpeed ZeRO-3's `zero.Init`, under which
    transformers builds a model named by a string, casts the buffers a module creates to the training dtype: with
    bf16 frequencies cos / sin are off by up to 0.36 within a few thousand positions, for the engine and the
    training forward alike, where every other set-up computes them in float32."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor)
        and module.inv_freq.dtype != torch.float32
        and hasattr(module, "config")
    ]


def _rebuild_rotary_in_float32(modules: list[tuple[str, torch.nn.Module]]) -> None:
    """Recompute each module's frequencies (`inv_freq`, `original_inv_freq`) as its class builds them outside
    `zero.Init`: in float32, on the CPU, then moved to where the module's buffers are."""
    for _, module in modules:
        fresh = type(module)(module.config)
        for buffer in ("inv_freq", "original_inv_freq"):
            if isinstance(getattr(module, buffer, None), torch.Tensor) and hasattr(fresh, buffer):
                setattr(module, buffer, getattr(fresh, buffer).to(getattr(module, buffer).device))


def ensure_float32_rotary(model, built_by_trainer: bool) -> None:
    """A model whose rotary frequencies are not float32 (built under ZeRO-3's `zero.Init`): rebuilt in float32 when the
    trainer built it from a name, so that ZeRO-3 trains the model every other set-up trains; a model the caller built
    is left as it is, with a warning naming the fix."""
    modules = _low_precision_rotary(model)
    if not modules:
        return
    names, dtype = ", ".join(name for name, _ in modules), modules[0][1].inv_freq.dtype
    if built_by_trainer:
        _rebuild_rotary_in_float32(modules)
        logger.info(
            "The model's rotary frequencies were built in %s (DeepSpeed ZeRO-3's zero.Init casts a module's buffers): "
            "rebuilt in float32, as every other set-up holds them (%s).", dtype, names,
        )  # fmt: skip
        return
    logger.warning(
        "The model passed holds its rotary frequencies in %s (%s), as DeepSpeed ZeRO-3's zero.Init leaves them: "
        "cos / sin are then off by up to about 0.4 within a few thousand positions, in generation and training. "
        "Pass the model's name or path instead (the trainer then rebuilds them in float32), or recompute `inv_freq` "
        "in float32 before passing the model.", dtype, names,
    )  # fmt: skip
