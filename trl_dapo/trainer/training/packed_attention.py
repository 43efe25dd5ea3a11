"""Attention over packed rows: every row's tokens attend causally to the earlier tokens of the same row only.

A packed forward passes the rows concatenated into one sequence, `position_ids` restarting at each row, and the row
bounds as transformers' flash-attention keyword arguments (`cu_seq_lens_q`, `max_length_q`, ...), which the model hands
to its attention function unchanged. transformers' own SDPA and eager paths would turn packed `position_ids` into a
dense `(tokens x tokens)` mask, quadratic in the micro-batch's tokens, so the model's attention is switched to a
dispatcher (`PACKED_PREFIX` + its own implementation) that:

- for packed calls, runs PyTorch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) on CUDA
  in bf16/fp16, and elsewhere each row through SDPA (the exact reference, used on the CPU);
- for every other call (TRL's padded passes, `generate`) runs the model's own implementation with its own mask.

Models with flash-attention already pack natively from the same keyword arguments and are left as they are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...models import sliding_window
from .packing import PackedRows

PACKED_PREFIX = "trl_dapo_packed_"
# Implementations the dispatcher wraps: their padded calls keep working unchanged.
WRAPPED_IMPLEMENTATIONS = ("sdpa", "flex_attention")
# transformers' flash-attention paths read the row bounds from the same keyword arguments themselves.
NATIVE_PACKED_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
# Decoder families whose layers are all causal attention over rotary positions and whose attention goes through
# transformers' attention interface: a packed forward of each equals its rows' own forwards (tests/test_padding_free.py).
PACKABLE_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2"}
)

try:  # PyTorch >= 2.9
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older PyTorch: the per-row path serves every device
    varlen_attn = None

_VARLEN_PARAMETERS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
# PyTorch 2.10 says causal with `is_causal`, later releases with a window of (-1, 0).
_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMETERS else {"is_causal": True}


def packed_implementation(base: str) -> str:
    """The dispatcher's registered name for a model whose own implementation is `base` (registered on first use)."""
    name = PACKED_PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        ALL_ATTENTION_FUNCTIONS.register(name, _dispatcher(ALL_ATTENTION_FUNCTIONS[base]))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _mask_dispatcher(ALL_MASK_ATTENTION_FUNCTIONS[base]))
    return name


def _dispatcher(base: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        bounds = kwargs.get("cu_seq_lens_q")
        # packed: the same bounds for keys as for queries and as many keys as queries (no cache, no paged batch)
        if bounds is None or kwargs.get("cu_seq_lens_k") is not bounds or key.size(2) != query.size(2):
            return base(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if torch.is_autocast_enabled(query.device.type):  # rotary upcasts: run the kernel in autocast's precision
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        return packed_attention(query, key, value, bounds, int(kwargs["max_length_q"]), scaling), None

    return attention


def _mask_dispatcher(base: Callable) -> Callable:
    """No mask for a packed call (no padding mask and as many keys as queries: a training pass with no cache); the
    model's own mask for every other call. The dispatcher never reads a mask in packed calls."""

    def mask(*args, attention_mask=None, q_length=None, kv_length=None, **kwargs):
        if attention_mask is None and q_length == kv_length and _building_packed_masks:
            return None
        return base(*args, attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, **kwargs)

    return mask


# True while a packed forward builds its masks: mask functions see neither `position_ids` nor the row bounds. The
# attention calls themselves dispatch on their keyword arguments alone, so a gradient-checkpointing recompute after the
# forward returned is still packed.
_building_packed_masks = False


@contextlib.contextmanager
def _packed_masks() -> Iterator[None]:
    """Wrap a packed forward: its mask construction returns no mask (the dense packed mask would be quadratic)."""
    global _building_packed_masks
    outer, _building_packed_masks = _building_packed_masks, True
    try:
        yield
    finally:
        _building_packed_masks = outer


def forward_packed(model, packed: PackedRows, **kwargs):
    """One forward of packed rows through TRL's fused head (`add_fused_lm_head`): per packed token, the log-probability
    of the next one (and the entropy, where the head computes it), never the full-vocabulary logits."""
    with _packed_masks():
        return model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            labels=packed.labels,
            fused_lm_head=True,
            **packed.attention_kwargs(),
            **kwargs,
        )


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_length: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each row of a packed sequence. `query` `(1, Hq, T, D)`, `key`/`value` `(1, Hkv, T, D)`,
    `cu_seq_lens` `(rows + 1,)`; returns `(1, T, Hq, D)`, the layout transformers' attention functions return.

    Rows all of one length are a dense batch with no padding: they go through SDPA, whose backend choice beats the
    variable-length flash kernel there (on an H200 with PyTorch 2.11, SDPA's cuDNN attention ran forward + backward
    of 4 rows of 8,224 tokens, Qwen2.5-1.5B's heads, in 5.4 ms against 10.6 ms)."""
    rows = cu_seq_lens.numel() - 1
    if rows * max_length == query.size(2):
        return _dense_rows(query, key, value, rows, scaling)
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and varlen_attn is not None:
        return flash_varlen_attention(query, key, value, cu_seq_lens, max_length, scaling).unsqueeze(0)
    return reference_packed_attention(query, key, value, cu_seq_lens, scaling)


def _dense_rows(query, key, value, rows, scaling):
    """Equal rows as a batch `(rows, H, length, D)`, one causal SDPA call, back to `(1, T, Hq, D)`."""
    query, key, value = (x[0].unflatten(1, (rows, -1)).transpose(0, 1) for x in (query, key, value))
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=scaling, enable_gqa=query.size(1) != key.size(1)
    )
    return out.transpose(1, 2).flatten(0, 1).unsqueeze(0)


def flash_varlen_attention(query, key, value, cu_seq_lens, max_length, scaling):
    """PyTorch's variable-length flash attention over packed rows (CUDA, bf16/fp16); `(T, Hq, D)` out."""
    query, key, value = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    groups = query.size(1) // key.size(1)
    kwargs = {"scale": scaling, **_CAUSAL}
    if groups > 1 and "enable_gqa" in _VARLEN_PARAMETERS:
        kwargs["enable_gqa"] = True
    elif groups > 1 and not _takes_fewer_key_heads(query.device):
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu_seq_lens = cu_seq_lens.to(torch.int32)
    return varlen_attn(query, key, value, cu_seq_lens, cu_seq_lens, max_length, max_length, **kwargs)


@functools.cache
def _takes_fewer_key_heads(device: torch.device) -> bool:
    """Whether this PyTorch's `varlen_attn` (before its `enable_gqa` flag) hands fewer key/value heads than query heads
    to the flash kernel, which reads each group's shared head itself. Repeating the heads instead costs a copy forward
    and a reduction backward of every layer's keys and values (6x their size for Qwen2.5-1.5B)."""
    probe = torch.zeros(2, 2, 64, device=device, dtype=torch.bfloat16)
    bounds = torch.tensor([0, 2], device=device, dtype=torch.int32)
    try:
        varlen_attn(probe, probe[:, :1], probe[:, :1], bounds, bounds, 2, 2, **_CAUSAL)
    except RuntimeError:
        return False
    return True


def reference_packed_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Each row through SDPA with a causal mask: exact, one call per row (the CPU path and the tests' reference)."""
    bounds = cu_seq_lens.tolist()
    groups = query.size(1) // key.size(1)
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            enable_gqa=groups > 1,
        )
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)


def why_model_cannot_pack(model, is_multimodal: bool) -> str | None:
    """Why `model` (unwrapped, PEFT's base model included) cannot run packed passes, or None when it can. Only model
    types whose every layer is attention with rotary positions are packed: a convolution or state-space layer (LFM2,
    Mamba hybrids) or chunked attention (Llama 4) would mix tokens across the packed rows."""
    config = model.config
    base = (config._attn_implementation or "eager").removeprefix(PACKED_PREFIX)
    window = sliding_window(config)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    checks = [
        (is_multimodal, "multimodal model (its image inputs are batched per row)"),
        (
            config.model_type not in PACKABLE_MODEL_TYPES,
            f"model type {config.model_type!r} is not among those checked to keep packed rows apart",
        ),
        (
            base not in (*WRAPPED_IMPLEMENTATIONS, *NATIVE_PACKED_IMPLEMENTATIONS),
            f"attn_implementation={base!r} (padding-free runs with 'sdpa', 'flex_attention' or flash attention)",
        ),
        (window is not None, f"sliding-window attention (a window of {window} tokens)"),
        (layer_types != {"full_attention"}, f"layers other than full attention ({sorted(layer_types)})"),
        (getattr(config, "attn_logit_softcapping", None) is not None, "attention logit soft-capping"),
        (bool(getattr(config, "attention_dropout", 0.0)), "attention dropout"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def enable_packed_attention(model) -> None:
    """Route `model`'s attention through the dispatcher (its padded calls unchanged); flash attention packs as is."""
    implementation = model.config._attn_implementation
    if implementation in NATIVE_PACKED_IMPLEMENTATIONS or implementation.startswith(PACKED_PREFIX):
        return
    model.set_attn_implementation(packed_implementation(implementation))


@contextlib.contextmanager
def attention_for_packing(model) -> Iterator[None]:
    """`model`'s attention through the dispatcher while the block runs, its own implementation set back after (also
    on an error): the model is the caller's and must come back as it was passed. Nested blocks change nothing."""
    implementation = model.config._attn_implementation
    enable_packed_attention(model)
    try:
        yield
    finally:
        if model.config._attn_implementation != implementation:
            model.set_attn_implementation(implementation)
