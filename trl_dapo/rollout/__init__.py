"""The paged rollout engine: continuous batching over a paged KV cache, with CUDA graphs and a Triton decode kernel.
Which generation path a trainer uses is the trainer's choice (`trl_dapo/trainer/collection/engine_choice.py`)."""

from __future__ import annotations

from .architectures import SUPPORTED_MODEL_TYPES
from .generation import GenerationOutput, RolloutStats
from .paged_engine import PagedRolloutEngine, RolloutStream
from .token_sampling import TokenSampling

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "GenerationOutput",
    "PagedRolloutEngine",
    "RolloutStats",
    "RolloutStream",
    "TokenSampling",
]
