"""What the rollout engine asks of a model family: the seam between the engine and one architecture.

The engine owns everything shared by the decoder-only models it serves: the paged KV cache, the scheduler, prefill
and decode loops, the RMS norms around attention and the MLP, the fused q/k/v, output and down projections and their
CUDA graphs and compiles. An architecture supplies what differs between families, at the points where it differs:

- `read_layer`: one decoder layer's weights from the Hugging Face module, under the names the engine reads (below);
- `qk_norm`: per-head q and k norm weights applied before the rotary embedding (Qwen3), or None;
- `mlp`: the MLP from the normed residual to the down projection's input (the activation);
- `rotary_tables`: the rotary embedding's cos and sin per position.

The engine calls `qk_norm` and `mlp` inside its compiled and graph-captured functions, so they must be plain tensor
code that `torch.compile(fullgraph=True)` traces. One subclass per family lives in its own module and is registered
by model type in `architectures/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from transformers import PretrainedConfig


class DecoderArchitecture(ABC):
    """One family of decoder-only Hugging Face models, as the rollout engine runs it.

    Built from the base model (no PEFT wrapper); the engine builds one per engine, before reading any weights."""

    model_types: ClassVar[tuple[str, ...]]
    """The `config.model_type` values this family serves."""

    @abstractmethod
    def __init__(self, model: torch.nn.Module) -> None:
        """Keep what the family's methods read from the model (e.g. its rotary module)."""

    @classmethod
    def unsupported_reason(cls, config: PretrainedConfig) -> str | None:
        """Why this family's engine path cannot run a model of `config` (an option it does not implement), or None:
        read from the config alone, so the trainer can fall back or refuse before it builds an engine."""
        return None

    @abstractmethod
    def read_layer(self, layer: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The generation-dtype weights of decoder layer `layer`, by name: `input_norm` and `post_norm` (the RMS norms
        before attention and the MLP), `qkv_weight` (q, k and v concatenated, `(out, in)` as the other projections),
        `qkv_bias` when the model has one, `o_weight`, `gate_up_weight` (the MLP's input projections, read by `mlp`;
        the benchmarks time it), `down_weight`, and any name this architecture's own methods read. Called inside the
        layer's gather (`weights.py`): the tensors may share its gathered storage. LoRA adapters are merged
        (`merged_linear.linear_weight`)."""

    @abstractmethod
    def qk_norm(self, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-head norm weights of q and k (applied before the rotation) from the layer's snapshot weights, or
        None. The decode attention kernel applies them itself, so a family's q/k norm must be this RMS norm."""

    @abstractmethod
    def mlp(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """The MLP of the normed residual `x` (T, hidden) up to the down projection's input (T, intermediate); the
        engine runs the down projection (`layer["down_weight"]`) itself, outside the compiled code. Its products go
        through `fp8.linear`, which runs them in FP8 when the engine's weights are."""

    @abstractmethod
    def rotary_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (length, head_dim) of positions below `length`, in float32, laid out for rotating the two
        halves of a head (`paged_attention.rotate`)."""
