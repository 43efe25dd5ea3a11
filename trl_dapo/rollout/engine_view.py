"""The engine as one generation call reads it: what a `Generation` (`generation.py`) takes of the
`PagedRolloutEngine` that starts it (`paged_engine.py`). The engine imports the generation and the generation reads
the engine only through this protocol, so neither module imports the other both ways."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .architectures import DecoderArchitecture
from .kept import KeptBytes
from .token_sampling import TokenSampling
from .weights import WeightSnapshot


@runtime_checkable
class EngineView(Protocol):
    """A call's settings, the model's weights and per-layer math (the layer functions compiled where the engine
    compiles them), and the memory budget a call's KV pool and kept KV are sized within."""

    # the call's settings
    device: torch.device
    dtype: torch.dtype
    page_size: int
    max_rows: int
    sync_every: int
    prefill_tokens: int
    pad_token_id: int
    cuda_graph: bool
    show_progress: bool
    attention_kernel: str
    fp8_kv_cache: bool
    # the model
    snapshot: WeightSnapshot
    architecture: DecoderArchitecture
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    vocab_size: int
    stop_table: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    warm_steps: set[tuple]
    _attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    _decode_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    _layer_output: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    _final_norm: Callable[..., torch.Tensor]
    # the memory budget
    kept: KeptBytes

    def _residual_norm(self, x, delta, weight: torch.Tensor) -> torch.Tensor: ...

    def _output_projection(self, attention: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def _down_projection(
        self, hidden: torch.Tensor, layer: dict[str, torch.Tensor], bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def _rope_tables(self, length: int) -> bool: ...

    def down_bias(self, rows: int) -> torch.Tensor | None: ...

    def sample_tokens(
        self, hidden: torch.Tensor, noise: torch.Tensor | None, settings: TokenSampling, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def cache_pages(self, prompt_ids: list[list[int]], max_new_tokens: int) -> int: ...

    def cache_bytes_per_token(self) -> int: ...

    def budget_left(self) -> float: ...
