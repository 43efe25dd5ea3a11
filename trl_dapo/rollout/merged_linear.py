"""A linear layer's weight and bias as the rollout engine decodes with them: active LoRA adapters merged in. Read by
the architectures (each decoder layer's projections) and the weight snapshot (the output head)."""

from __future__ import annotations

import torch


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
    """The merged weights (and biases, where any layer has one) of `modules` concatenated along their outputs, in
    `dtype`: one matrix product for q/k/v, or for the MLP's gate and up projections."""
    weights, biases = zip(*(linear_weight(m) for m in modules), strict=True)
    weight = torch.cat(weights).to(dtype)
    bias = None if all(b is None for b in biases) else torch.cat([b for b in biases if b is not None]).to(dtype)
    return weight, bias
