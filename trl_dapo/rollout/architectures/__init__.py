"""The model families the rollout engine serves, registered by Hugging Face model type (`base.py` says what one
provides). A new family is a module with its `DecoderArchitecture` subclass, listed in `ARCHITECTURES`."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .base import DecoderArchitecture
from .llama import LlamaArchitecture
from .qwen3 import Qwen3Architecture

ARCHITECTURES: tuple[type[DecoderArchitecture], ...] = (LlamaArchitecture, Qwen3Architecture)
BY_MODEL_TYPE: dict[str, type[DecoderArchitecture]] = {
    model_type: architecture for architecture in ARCHITECTURES for model_type in architecture.model_types
}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


class UnsupportedArchitecture(ValueError):
    """The rollout engine cannot serve this model; the message says why."""


def unsupported_reason(config: PretrainedConfig) -> str | None:
    """Why the rollout engine cannot serve a model of `config` (its type, or an option its family's path does not
    implement), or None: what the trainer falls back on or refuses with before building an engine."""
    architecture = BY_MODEL_TYPE.get(config.model_type)
    if architecture is None:
        return f"model type {config.model_type!r} is not supported (the rollout engine serves {SUPPORTED_MODEL_TYPES})"
    return architecture.unsupported_reason(config)


def architecture_for(model: torch.nn.Module) -> DecoderArchitecture:
    """The architecture serving the base model `model` (no PEFT wrapper), or `UnsupportedArchitecture` saying why
    not."""
    reason = unsupported_reason(model.config)
    if reason is not None:
        raise UnsupportedArchitecture(f"the rollout engine cannot serve this model: {reason}.")
    return BY_MODEL_TYPE[model.config.model_type](model)


__all__ = [
    "ARCHITECTURES",
    "BY_MODEL_TYPE",
    "SUPPORTED_MODEL_TYPES",
    "DecoderArchitecture",
    "UnsupportedArchitecture",
    "architecture_for",
    "unsupported_reason",
]
