"""The generation weights a rollout engine decodes with: a snapshot of the training model in the generation dtype.

LoRA deltas are merged (in float32, rounded once), q/k/v and gate/up are concatenated (one matrix product each per
layer), and later syncs copy into the same tensors, so CUDA graphs captured over them stay valid across optimizer
steps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def linear_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of a linear layer, with active LoRA adapters merged in (PEFT wraps it as `base_layer`).

    The merge is summed in float32 and left for the caller to round once to the generation dtype: casting the delta
    to a bf16 base weight's dtype before adding it would round twice, and lose more of a small adapter's update."""
    base = getattr(module, "base_layer", module)
    weight = base.weight.detach()
    for adapter in getattr(module, "active_adapters", []) or []:
        if adapter in getattr(module, "lora_A", {}) and not getattr(module, "merged", False):
            weight = weight.float() + module.get_delta_weight(adapter).float()
    bias = base.bias.detach() if getattr(base, "bias", None) is not None else None
    return weight, bias


def cat_linear(modules: list[torch.nn.Module], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    weights, biases = zip(*(linear_weight(m) for m in modules), strict=True)
    weight = torch.cat(weights).to(dtype)
    bias = None if all(b is None for b in biases) else torch.cat([b for b in biases if b is not None]).to(dtype)
    return weight, bias


def gather_nothing(module: torch.nn.Module) -> AbstractContextManager:
    """Unsharded parameters are readable as they are."""
    return nullcontext()


class WeightSnapshot:
    """Generation-dtype weights by name (`embed`, `final_norm`, `lm_head`, `layers.<i>.<name>`) and per layer.

    `gather(module)` is a context manager under which the module's full parameters can be read; the snapshot reads
    one module at a time inside it.
    """

    def __init__(self, model, dtype: torch.dtype, gather=gather_nothing) -> None:
        base = base_model(model)
        self.config = base.config
        if self.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the rollout engine supports {SUPPORTED_MODEL_TYPES}, not {self.config.model_type!r}.")
        self.dtype, self.gather = dtype, gather
        self.tensors = self._read(model)
        self.device = self.tensors["embed"].device
        self.rotary = base.model.rotary_emb
        self.embed, self.final_norm = self.tensors["embed"], self.tensors["final_norm"]
        self.lm_head = self.tensors.get("lm_head", self.embed)
        self.layers = []
        for index in range(self.config.num_hidden_layers):
            prefix = f"layers.{index}."
            layer = {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
            layer.setdefault("qkv_bias", None)
            self.layers.append(layer)

    @torch.no_grad()
    def sync(self, model) -> None:
        """Copy the training weights into the snapshot's own tensors (called once per generation batch)."""
        for name, tensor in self._read(model).items():
            if self.tensors[name].data_ptr() != tensor.data_ptr():
                self.tensors[name].copy_(tensor)

    @torch.no_grad()
    def _read(self, model) -> dict[str, torch.Tensor]:
        base = base_model(model)
        decoder, dtype = base.model, self.dtype
        weights: dict[str, torch.Tensor] = {}
        with self.gather(decoder.embed_tokens):
            weights["embed"] = decoder.embed_tokens.weight.detach().to(dtype)
        with self.gather(decoder.norm):
            weights["final_norm"] = decoder.norm.weight.detach().to(dtype)
        lm_head = base.get_output_embeddings()
        if lm_head.weight is not decoder.embed_tokens.weight:
            with self.gather(lm_head):
                weights["lm_head"] = linear_weight(lm_head)[0].to(dtype)
        for index, layer in enumerate(decoder.layers):
            with self.gather(layer):
                weights.update(self._read_layer(f"layers.{index}.", layer))
        return weights

    def _read_layer(self, prefix: str, layer) -> dict[str, torch.Tensor]:
        attention, mlp, dtype = layer.self_attn, layer.mlp, self.dtype
        qkv_weight, qkv_bias = cat_linear([attention.q_proj, attention.k_proj, attention.v_proj], dtype)
        weights = {
            prefix + "input_norm": layer.input_layernorm.weight.detach().to(dtype),
            prefix + "post_norm": layer.post_attention_layernorm.weight.detach().to(dtype),
            prefix + "qkv_weight": qkv_weight,
            prefix + "o_weight": linear_weight(attention.o_proj)[0].to(dtype),
            prefix + "gate_up_weight": cat_linear([mlp.gate_proj, mlp.up_proj], dtype)[0],
            prefix + "down_weight": linear_weight(mlp.down_proj)[0].to(dtype),
        }
        if qkv_bias is not None:
            weights[prefix + "qkv_bias"] = qkv_bias
        if hasattr(attention, "q_norm"):  # Qwen3
            weights[prefix + "q_norm"] = attention.q_norm.weight.detach().to(dtype)
            weights[prefix + "k_norm"] = attention.k_norm.weight.detach().to(dtype)
        return weights
