"""Llama, Mistral and Qwen2: one layout (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, two RMS norms per
layer, a SiLU-gated MLP, Hugging Face's rotary module). They differ only in whether q/k/v carry a bias (Qwen2's do),
which the snapshot keeps, and in Mistral's sliding window. A window shorter than the context, Llama's
`attention_bias` (which biases the output projection too), `mlp_bias` and any activation but SiLU are options the
engine does not implement: `unsupported_reason` names them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from ...models import sliding_window
from ..fp8 import linear
from ..merged_linear import cat_linear, linear_weight
from .base import DecoderArchitecture


class LlamaArchitecture(DecoderArchitecture):
    model_types = ("llama", "mistral", "qwen2")

    def __init__(self, model: torch.nn.Module) -> None:
        self.rotary = model.model.rotary_emb

    @classmethod
    def unsupported_reason(cls, config: PretrainedConfig) -> str | None:
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act={config.hidden_act!r} (the rollout engine runs a SiLU-gated MLP)"
        for option in ("attention_bias", "mlp_bias"):  # attention_bias biases o_proj too
            if getattr(config, option, False):
                return f"{option}=True (the rollout engine applies biases to q/k/v only)"
        window = sliding_window(config)
        if window is not None:
            return f"sliding-window attention (a window of {window} tokens; the engine attends to the whole context)"
        return None

    def read_layer(self, layer: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        attention, mlp = layer.self_attn, layer.mlp
        unapplied = [m for m in (attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj) if _has_bias(m)]
        if unapplied:  # Llama's `attention_bias` also biases o_proj, and its `mlp_bias` the MLP
            raise ValueError("the rollout engine applies biases to q/k/v only; this model has them elsewhere too.")
        qkv_weight, qkv_bias = cat_linear([attention.q_proj, attention.k_proj, attention.v_proj], dtype)
        weights = {
            "input_norm": layer.input_layernorm.weight.detach().to(dtype),
            "post_norm": layer.post_attention_layernorm.weight.detach().to(dtype),
            "qkv_weight": qkv_weight,
            "o_weight": linear_weight(attention.o_proj)[0].to(dtype),
            "gate_up_weight": cat_linear([mlp.gate_proj, mlp.up_proj], dtype)[0],
            "down_weight": linear_weight(mlp.down_proj)[0].to(dtype),
        }
        if qkv_bias is not None:
            weights["qkv_bias"] = qkv_bias
        return weights

    def qk_norm(self, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def mlp(self, x: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        gate, up = linear(x, layer, "gate_up_weight").chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=device).unsqueeze(0)
        probe = torch.zeros(1, device=device, dtype=torch.float32)  # the module reads only its dtype and device
        cos, sin = self.rotary(probe, positions)
        return cos[0], sin[0]


def _has_bias(module: torch.nn.Module) -> bool:
    return getattr(getattr(module, "base_layer", module), "bias", None) is not None
