"""The generation weights a rollout engine decodes with: a snapshot of the training model in the generation dtype.

LoRA deltas are merged (in float32, rounded once: `merged_linear.py`), q/k/v and gate/up are concatenated (one
matrix product each per layer), and later syncs copy into the same tensors, so CUDA graphs captured over them stay
valid across optimizer steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from ..models import base_model
from .merged_linear import linear_weight

if TYPE_CHECKING:
    from .architectures import DecoderArchitecture


def gather_nothing(module: torch.nn.Module) -> AbstractContextManager:
    """Unsharded parameters are readable as they are."""
    return nullcontext()


class WeightSnapshot:
    """Generation-dtype weights by name (`embed`, `final_norm`, `lm_head`, `layers.<i>.<name>`) and per layer.

    `gather(module)` is a context manager under which the module's full parameters can be read (`sharded.py` for
    ZeRO-3 and FSDP2); the snapshot reads one module at a time inside it, and `sync` copies each module into the
    snapshot before the next is gathered, so the extra memory is the snapshot plus one module in flight. `device` is
    where the snapshot lives (default: the model's); a trainer's model may still be on the host when it is built.
    `architecture` reads each decoder layer, under the names the engine and it read back (`architectures/base.py`).
    """

    def __init__(
        self,
        model,
        dtype: torch.dtype,
        architecture: DecoderArchitecture,
        *,
        device: torch.device | None = None,
        gather=gather_nothing,
    ) -> None:
        base = base_model(model)
        self.config, self.architecture = base.config, architecture
        self.dtype, self.gather = dtype, gather
        self.device = torch.device(device) if device is not None else base.model.embed_tokens.weight.device
        self.tensors = {name: self._own(tensor) for weights in self._read(model) for name, tensor in weights.items()}
        self.embed, self.final_norm = self.tensors["embed"], self.tensors["final_norm"]
        self.lm_head = self.tensors.get("lm_head", self.embed)
        self.layers = []
        for index in range(self.config.num_hidden_layers):
            prefix = f"layers.{index}."
            layer = {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
            layer.setdefault("qkv_bias", None)
            self.layers.append(layer)

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """The snapshot's tensor for a weight as read. An unsharded parameter already in the generation dtype and
        on the device outlives the read and is used as it is; a gathered one is freed when its module is resharded,
        so it is copied. A weight on the meta device (a rank that loads no weights, as with FSDP's RAM-efficient
        loading) only gets its storage: the first `sync` fills it, and the trainer syncs before it generates."""
        if tensor.is_meta:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        return tensor.to(self.device, copy=self.gather is not gather_nothing)

    @torch.no_grad()
    def sync(self, model) -> None:
        """Copy the training weights into the snapshot's own tensors (called once per generation batch)."""
        for weights in self._read(model):
            for name, tensor in weights.items():
                if self.tensors[name].data_ptr() != tensor.data_ptr():
                    self.tensors[name].copy_(tensor)

    @torch.no_grad()
    def _read(self, model) -> Iterator[dict[str, torch.Tensor]]:
        """The generation-dtype weights of one module at a time, yielded while that module is gathered: they may
        share its gathered storage, so use them before asking for the next."""
        base = base_model(model)
        decoder, dtype = base.model, self.dtype
        with self.gather(decoder.embed_tokens):
            yield {"embed": decoder.embed_tokens.weight.detach().to(dtype)}
        with self.gather(decoder.norm):
            yield {"final_norm": decoder.norm.weight.detach().to(dtype)}
        lm_head = base.get_output_embeddings()
        if lm_head.weight is not decoder.embed_tokens.weight:
            with self.gather(lm_head):
                yield {"lm_head": linear_weight(lm_head)[0].to(dtype)}
        for index, layer in enumerate(decoder.layers):
            with self.gather(layer):
                weights = self.architecture.read_layer(layer, dtype)
                yield {f"layers.{index}.{name}": tensor for name, tensor in weights.items()}
