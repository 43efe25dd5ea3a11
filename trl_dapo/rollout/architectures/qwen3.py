"""Qwen3: the Llama layout without q/k/v biases, plus an RMS norm over each head of q and k before the rotation
(`self_attn.q_norm`, `self_attn.k_norm`, one weight of `head_dim` shared by the heads)."""

from __future__ import annotations

import torch

from .llama import LlamaArchitecture


class Qwen3Architecture(LlamaArchitecture):
    model_types = ("qwen3",)

    def read_layer(self, layer: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        weights = super().read_layer(layer, dtype)
        weights["q_norm"] = layer.self_attn.q_norm.weight.detach().to(dtype)
        weights["k_norm"] = layer.self_attn.k_norm.weight.detach().to(dtype)
        return weights

    def qk_norm(self, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return layer["q_norm"], layer["k_norm"]
