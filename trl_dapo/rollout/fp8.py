"""FP8 (e4m3) rollouts: the KV cache and the engine's linear layers stored as `torch.float8_e4m3fn` with float32
scales, halving what decode reads per token.

e4m3 keeps 3 mantissa bits: a value in its normal range (|x| >= 2^-6 after scaling) rounds to within a relative 2^-4,
a smaller one (subnormal) to within 2^-10 absolutely, both times its scale. Each scale maps the largest magnitude
of what it covers to e4m3's largest finite value (448), so nothing overflows and the normal range covers the top
2^15 of the values' range:

- KV cache: one scale per token and KV head (its `head_dim` values), written with the token; the cache grows by
  4 bytes per head beside its `head_dim` bytes, and a token's write never rescales its page's other tokens.
- Weights: one scale per output channel (a row of the weight), computed from the bf16 snapshot at each weight sync
  (LoRA merged by then); activations get one scale per row (token), computed as they are multiplied. On Hopper the
  product runs on FP8 tensor cores through `torch._scaled_mm`.

Decoding with FP8 samples from a policy slightly off the training model's; `DAPOConfig` pairs it with a recomputed
old policy and a rollout correction for that reason.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# the smallest scale: an all-zero vector gets it (and zeros), never a division by zero
MIN_SCALE = 1e-12
KV_CACHE_DTYPES = ("bf16", "fp8")
WEIGHTS_DTYPES = ("bf16", "fp8")
# FP8 tensor cores and Triton's e4m3 type: Ada (8.9) and Hopper (9.0) onwards
FP8_COMPUTE_CAPABILITY = (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., n) as e4m3 values (..., n) and float32 scales (...): x ≈ values * scale, one scale per vector of the
    last dimension, its largest magnitude mapped to 448."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1)
    # a tensor divisor: CUDA divides by a Python number as a product with its rounded reciprocal, an ulp off the
    # IEEE quotient the decode kernel computes (`tl.div_rn`) for half the scales
    scale = (amax / amax.new_full((), FP8_MAX)).clamp(min=MIN_SCALE)
    values = (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 (..., n) from e4m3 `values` (..., n) and their `scale` (...)."""
    return values.float() * scale.unsqueeze(-1)


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` runs FP8 matrix products and Triton's e4m3 loads: CUDA of compute capability 8.9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_COMPUTE_CAPABILITY


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 rollouts cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"the {device.type} device has no FP8 kernels (they need CUDA of compute capability 8.9 or more)"
    if not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"the GPU's compute capability {major}.{minor} has no FP8 (it needs 8.9 or more: Ada, Hopper)"
    return None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor viewed as bytes (the same storage), for the copies and gathers PyTorch's CPU kernels lack for
    float8 types; any other tensor as it is."""
    return tensor.view(torch.uint8) if tensor.dtype == FP8 else tensor


class LayerCache(NamedTuple):
    """One layer's KV cache: k and v `(slots, kv_heads, head_dim)` in the engine's dtype, or e4m3 with float32 scales
    `(slots, kv_heads)` (None when not quantised)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool, device) -> LayerCache:
        """Zeros, so that unwritten entries of a page (read and masked out by the reference attention) are finite."""
        shape = (slots, kv_heads, head_dim)
        if not fp8:
            return cls(*(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)))
        caches = (torch.zeros(shape, dtype=FP8, device=device) for _ in range(2))
        scales = (torch.zeros(slots, kv_heads, dtype=torch.float32, device=device) for _ in range(2))
        return cls(*caches, *scales)

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v `(tokens, kv_heads, head_dim)` at cache `slots` (tokens,), quantised when the cache is."""
        if not self.fp8:
            self.k.index_copy_(0, slots, k)
            self.v.index_copy_(0, slots, v)
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = quantize_rows(x)
            as_bytes(cache).index_copy_(0, slots, as_bytes(values))
            scales.index_copy_(0, slots, scale)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v at `slots` (any shape) in float32, dequantised when the cache is quantised."""
        if not self.fp8:
            return self.k[slots].float(), self.v[slots].float()
        k, v = (as_bytes(cache)[slots].view(FP8) for cache in (self.k, self.v))
        return dequantize_rows(k, self.k_scale[slots]), dequantize_rows(v, self.v_scale[slots])

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the entries of slots `source` to slots `target` (a shared prompt's pages), scales included."""
        for tensor in self:
            if tensor is not None:
                as_bytes(tensor)[target] = as_bytes(tensor)[source]


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool) -> int:
    """Bytes one token's k and v take in every layer's cache (an e4m3 byte per value and a float32 scale per head)."""
    per_head = head_dim + 4 if fp8 else head_dim * dtype.itemsize
    return 2 * layers * kv_heads * per_head


# the decoder layers' linear weights the engine runs in FP8; the output head stays in the engine's dtype (the
# sampled tokens' logprobs are read from it, and it is one matrix of every layer's seven)
FP8_LINEARS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


@torch.no_grad()
def quantize_linears(layers: list[dict[str, torch.Tensor]]) -> None:
    """Add (first call) or refresh in place (later calls, so CUDA graphs captured over them stay valid) each layer's
    e4m3 weights `<name>_fp8` and per-output-channel scales `<name>_scale` from its weights `<name>` (the snapshot,
    LoRA merged)."""
    for layer in layers:
        for name in FP8_LINEARS:
            values, scale = quantize_rows(layer[name])
            if f"{name}_fp8" in layer:
                layer[f"{name}_fp8"].copy_(values)
                layer[f"{name}_scale"].copy_(scale)
            else:
                layer[f"{name}_fp8"], layer[f"{name}_scale"] = values, scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (..., in) times e4m3 `weight` (out, in) with per-output-channel `weight_scale` (out,), plus `bias`, in x's
    dtype: x quantised per row (token), the product on FP8 tensor cores (`torch._scaled_mm`, rowwise scales; the
    weight's transpose is the column-major operand it needs, in and out multiples of 16)."""
    values, scale = quantize_rows(x.reshape(-1, x.size(-1)))
    out = torch._scaled_mm(
        values, weight.t(), scale_a=scale.unsqueeze(1), scale_b=weight_scale.unsqueeze(0), out_dtype=x.dtype
    )
    if bias is not None:  # added apart: not every PyTorch build takes a bias with rowwise scales
        out = out + bias
    return out.view(*x.shape[:-1], weight.size(0))


def linear(x: torch.Tensor, layer: dict[str, torch.Tensor], name: str, bias: torch.Tensor | None = None):
    """The layer's linear `name` of x: in FP8 where the layer holds its e4m3 copy (`quantize_linears`), else
    `F.linear` over the snapshot's weight."""
    if f"{name}_scale" in layer:
        return fp8_linear(x, layer[f"{name}_fp8"], layer[f"{name}_scale"], bias)
    return torch.nn.functional.linear(x, layer[name], bias)
