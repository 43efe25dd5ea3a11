"""The model families the rollout engine serves, registered by Hugging Face model type (`base.py` says what one
provides). A new family is a module with its `DecoderArchitecture` subclass, listed in `ARCHITECTURES`."""

from __future__ import annotations

import torch

from .base import DecoderArchitecture
from .llama import LlamaArchitecture
from .qwen3 import Qwen3Architecture

ARCHITECTURES: tuple[type[DecoderArchitecture], ...] = (LlamaArchitecture, Qwen3Architecture)
BY_MODEL_TYPE: dict[str, type[DecoderArchitecture]] = {
    model_type: architecture for architecture in ARCHITECTURES for model_type in architecture.model_types
}
SUPPORTED_MODEL_TYPES = tuple(BY_MODEL_TYPE)


def architecture_for(model: torch.nn.Module) -> DecoderArchitecture:
    """The architecture serving the base model `model` (no PEFT wrapper), or a ValueError naming the supported
    model types."""
    model_type = model.config.model_type
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(f"the rollout engine supports {SUPPORTED_MODEL_TYPES}, not {model_type!r}.")
    return BY_MODEL_TYPE[model_type](model)


__all__ = [
    "ARCHITECTURES",
    "BY_MODEL_TYPE",
    "SUPPORTED_MODEL_TYPES",
    "DecoderArchitecture",
    "architecture_for",
]
