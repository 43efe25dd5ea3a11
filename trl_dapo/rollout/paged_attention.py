"""Decode attention over a paged KV cache: each row reads only the pages it has filled.

The cache of one layer is a flat, token-major tensor `(slots, kv_heads, head_dim)`; a row's tokens live in pages of
`page_size` consecutive slots, listed in its row of `page_table`. A decode step gives each row one new token, as the
output of the layer's q/k/v projection: its q and k are normalised (Qwen3's per-head norms) and rotated, its k and v
written to the row's cache slot, and its query attends to the row's `seq_lens[row]` tokens, the new one last.

On CUDA a split-K Triton kernel does it in two launches (partial softmax per split of each row's cached tokens, the
new token's rotation, cache write and score in the last split; then the merge), with a fixed grid so it can be
captured in a CUDA graph: folding the rotation and the cache write in saves the decode step two kernels per layer.
With an FP8 cache (`fp8.py`: e4m3 values and a float32 scale per token and KV head) both paths write the new
token quantised and read every token dequantised, the new one included; the kernel multiplies the scales into the
scores and the softmax weights rather than into the loaded tiles (e4m3 converts to bf16 exactly).
FlexAttention's decoding kernel would need the query heads per KV head to be a power of two (Qwen2.5 has 6 and 7)
and a batch size fixed at compile time; `benchmarks/rollout/bench_attention.py` measures both. Elsewhere a PyTorch
reference computes the same function.
"""

from __future__ import annotations

import math

import torch

from .fp8 import FP8_MAX, MIN_SCALE, LayerCache

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension in float32, rounded to x's dtype before the weight (as transformers does)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., head_dim), rotating its two halves."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotated_heads(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, heads, dim), k and v (T, kv_heads, dim) of the projection output qkv (T, (heads + 2 kv_heads) dim):
    q and k normalised by `qk_norm` (Qwen3's per-head weights, or None) and rotated by `cos`, `sin` (T, dim)."""
    tokens = qkv.size(0)
    dim = qkv.size(1) // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps), rms_norm(k, qk_norm[1], eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (rows, heads, dim) over the first `seq_lens` (rows,) tokens, at most `max_len`, of each row's pages; caches
    (slots, kv_heads, dim), e4m3 with scales `k_scale`, `v_scale` (slots, kv_heads) or unquantised (None); page_table
    (rows, pages). Returns (rows, heads, dim) in q's dtype; a row with no tokens gets zeros."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.size(1)
    pages = math.ceil(max_len / page_size) if max_len else 0
    positions = torch.arange(pages * page_size, device=q.device)
    slots = page_table[:, :pages].long().repeat_interleave(page_size, dim=1) * page_size + positions % page_size
    keys, values = LayerCache(k_cache, v_cache, k_scale, v_scale).read(slots)  # (rows, tokens, kv_heads, dim)
    grouped = q.float().view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,rtkd->rkgt", grouped, keys) / math.sqrt(dim)
    valid = positions.unsqueeze(0) < seq_lens.unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    weights = torch.nan_to_num(scores.softmax(dim=-1))
    return torch.einsum("rkgt,rtkd->rkgd", weights, values).reshape(rows, heads, dim).to(q.dtype)


def reference_decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    max_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention. qkv (rows, (heads + 2 kv_heads) dim): each row's new token; cos, sin (rows, dim):
    its position's rotary; write_slots (rows,): the cache slot its k and v go to (an idle slot's: one nobody reads),
    quantised with the cache; seq_lens (rows,): its tokens with the new one (0: an idle slot, which gets zeros); the
    rest as in `reference_attention`."""
    q, k, v = rotated_heads(qkv, cos, sin, heads, k_cache.size(1), qk_norm, eps)
    LayerCache(k_cache, v_cache, k_scale, v_scale).write(write_slots, k, v)
    return reference_attention(q, k_cache, v_cache, page_table, seq_lens, page_size, max_len, k_scale, v_scale)


def num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Splits of each row's tokens so that the grid holds about two programs per multiprocessor."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(32, math.ceil(2 * processors / max(rows * kv_heads, 1))))


def triton_decode_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    heads: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    splits: int,
    block_n: int = 64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel's version of `reference_decode_attention` (`splits` in place of `max_len`; no host
    synchronisation)."""
    rows = qkv.size(0)
    kv_heads, dim = k_cache.size(1), k_cache.size(2)
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    partial_out = torch.empty(rows, kv_heads, splits, group_pad, dim, device=qkv.device, dtype=torch.float32)
    partial_max = torch.empty(rows, kv_heads, splits, group_pad, device=qkv.device, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    q_norm, k_norm = qk_norm if qk_norm is not None else (cos, cos)  # unread without QK_NORM
    fp8 = k_scale is not None
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (cos, cos)  # unread without FP8
    _split_kernel[(rows, kv_heads, splits)](
        qkv, cos, sin, write_slots, q_norm, k_norm, k_cache, v_cache, k_scale, v_scale, page_table, seq_lens,
        partial_out, partial_max, partial_sum,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_scale.stride(0), page_table.stride(0),
        (1.0 / math.sqrt(dim)) * 1.4426950408889634, eps,
        HEADS=heads, GROUP=group, GROUP_PAD=group_pad, DIM=dim, PAGE=page_size, BLOCK_N=block_n, SPLITS=splits,
        QK_NORM=qk_norm is not None, FP8=fp8, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty(rows, heads, dim, device=qkv.device, dtype=qkv.dtype)
    _merge_kernel[(rows, heads)](
        partial_out, partial_max, partial_sum, out, out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        num_warps=1,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _rotated(ptr, dims, mask, cos, sin, norm_ptr, eps, DIM: tl.constexpr, QK_NORM: tl.constexpr):
        """Heads at `ptr` (offsets (heads, 1) + dims) normalised (QK_NORM) and rotated as `rotated_heads` does, in
        float32, rounding to the input's dtype where it does; the float32 operations' order differs, so bf16 results
        can differ from it by an ulp or two (measured on the H200)."""
        swapped = (dims + DIM // 2) % DIM  # rotate_half reads the other half, negated for the first
        x = tl.load(ptr + dims[None, :], mask=mask, other=0.0)
        other = tl.load(ptr + swapped[None, :], mask=mask, other=0.0).to(tl.float32)
        dtype = x.dtype
        x = x.to(tl.float32)
        if QK_NORM:
            inverse = tl.math.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)[:, None]
            x = tl.load(norm_ptr + dims).to(tl.float32)[None, :] * (x * inverse).to(dtype).to(tl.float32)
            other = tl.load(norm_ptr + swapped).to(tl.float32)[None, :] * (other * inverse).to(dtype).to(tl.float32)
        sign = tl.where(dims < DIM // 2, -1.0, 1.0)[None, :]
        return (x * cos[None, :] + sign * other * sin[None, :]).to(dtype)

    @triton.jit
    def _quantized(x, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
        """`fp8.quantize_rows` of x (1, DIM): its e4m3 values, its scale (1,) and the float32 values they stand for
        (what the reference reads back). IEEE divisions, as PyTorch's, so both round to the same e4m3 values."""
        x = x.to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
        values = tl.clamp(tl.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        return values, scale, values.to(tl.float32) * scale[:, None]

    @triton.jit
    def _write_new_token(
        k_new, v_new, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slot, kv, stride_k_slot, stride_k_head,
        stride_scale_slot, last, DIM: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
        MIN_SCALE: tl.constexpr,
    ):  # fmt: skip
        """Store the new token's k and v (1, DIM) at cache `slot` (the last split only), quantised with an FP8
        cache; returns them in float32 as the cache now holds them."""
        one, dims = tl.arange(0, 1), tl.arange(0, DIM)
        at = slot * stride_k_slot + kv * stride_k_head + one[:, None] + dims[None, :]
        writes = dims[None, :] < tl.where(last, DIM, 0)
        if FP8:
            k_values, k_scale, k_new = _quantized(k_new, FP8_MAX, MIN_SCALE)
            v_values, v_scale, v_new = _quantized(v_new, FP8_MAX, MIN_SCALE)
            tl.store(k_ptr + at, k_values, mask=writes)
            tl.store(v_ptr + at, v_values, mask=writes)
            scale_at = slot * stride_scale_slot + kv + one
            tl.store(k_scale_ptr + scale_at, k_scale, mask=one < tl.where(last, 1, 0))
            tl.store(v_scale_ptr + scale_at, v_scale, mask=one < tl.where(last, 1, 0))
        else:
            tl.store(k_ptr + at, k_new, mask=writes)
            tl.store(v_ptr + at, v_new, mask=writes)
        return k_new.to(tl.float32), v_new.to(tl.float32)

    @triton.jit
    def _split_kernel(
        qkv_ptr, cos_ptr, sin_ptr, write_ptr, q_norm_ptr, k_norm_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
        table_ptr, lens_ptr, out_ptr, max_ptr, sum_ptr,
        stride_qkv_row, stride_cos_row, stride_k_slot, stride_k_head, stride_scale_slot, stride_table_row,
        scale_log2, eps,
        HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr,
        FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of one row's query heads sharing KV head `kv`, over split `split` of its cached tokens;
        the last split also writes the new token's k and v to the cache and adds its score (an idle slot's, of
        length 0, goes to its write slot alone). With FP8, each token's k scale multiplies its scores and its v
        scale its softmax weights."""
        row, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_heads = tl.num_programs(1)
        length = tl.load(lens_ptr + row)
        cached = tl.maximum(length - 1, 0)
        chunk = tl.cdiv(tl.cdiv(cached, BLOCK_N), SPLITS) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, cached)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM)
        cos = tl.load(cos_ptr + row * stride_cos_row + dims).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_cos_row + dims).to(tl.float32)
        token = qkv_ptr + row * stride_qkv_row
        q = _rotated(
            token + (kv * GROUP + heads)[:, None] * DIM, dims, (heads < GROUP)[:, None], cos, sin, q_norm_ptr, eps,
            DIM, QK_NORM,
        )  # fmt: skip
        # the new token first, so that its loads overlap the query's and nothing follows the loop: the last split
        # writes its k and v to the cache and starts its softmax with it
        last = split == SPLITS - 1
        one = tl.arange(0, 1)[:, None]
        k_new = _rotated(token + (HEADS + kv) * DIM + one, dims, one < 1, cos, sin, k_norm_ptr, eps, DIM, QK_NORM)
        v_new = tl.load(token + (HEADS + kv_heads + kv) * DIM + one + dims[None, :])
        k_new, v_new = _write_new_token(
            k_new, v_new, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, tl.load(write_ptr + row).to(tl.int64), kv,
            stride_k_slot, stride_k_head, stride_scale_slot, last, DIM, FP8, FP8_MAX, MIN_SCALE,
        )  # fmt: skip
        starts = last & (length > 0)  # an idle slot (length 0) attends to nothing
        score = tl.sum(q.to(tl.float32) * k_new, axis=1) * scale_log2
        running_max = tl.where(starts, score, float("-inf"))
        running_sum = tl.where(starts, 1.0, 0.0) + tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.where(starts, v_new, 0.0) + tl.zeros([GROUP_PAD, DIM], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            tokens = first + tl.arange(0, BLOCK_N)
            valid = tokens < end
            page = tl.load(table_ptr + row * stride_table_row + tokens // PAGE, mask=valid, other=0)
            slots = page.to(tl.int64) * PAGE + tokens % PAGE
            offsets = slots[:, None] * stride_k_slot + kv * stride_k_head
            k = tl.load(k_ptr + offsets + dims[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            if FP8:
                scores *= tl.load(k_scale_ptr + slots * stride_scale_slot + kv, mask=valid, other=0.0)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.math.exp2(scores - new_max[:, None])
            rescale = tl.math.exp2(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + offsets + dims[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
            if FP8:
                probs *= tl.load(v_scale_ptr + slots * stride_scale_slot + kv, mask=valid, other=0.0)[None, :]
            acc = acc * rescale[:, None] + tl.dot(probs.to(q.dtype), v)
            running_max = new_max
        base = (row * kv_heads + kv) * SPLITS + split
        tl.store(out_ptr + (base * GROUP_PAD + heads)[:, None] * DIM + dims[None, :], acc)
        tl.store(max_ptr + base * GROUP_PAD + heads, running_max)
        tl.store(sum_ptr + base * GROUP_PAD + heads, running_sum)

    @triton.jit
    def _merge_kernel(
        out_ptr, max_ptr, sum_ptr, result_ptr, stride_result_row, stride_result_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):  # fmt: skip
        """Combine the splits' partial softmax sums of one (row, query head)."""
        row, head = tl.program_id(0), tl.program_id(1)
        kv_heads = tl.num_programs(1) // GROUP
        kv, member = head // GROUP, head % GROUP
        splits = tl.arange(0, SPLITS_PAD)
        index = ((row * kv_heads + kv) * SPLITS + splits) * GROUP_PAD + member
        in_range = splits < SPLITS
        split_max = tl.load(max_ptr + index, mask=in_range, other=float("-inf"))
        split_sum = tl.load(sum_ptr + index, mask=in_range, other=0.0)
        overall = tl.max(split_max, axis=0)
        weight = tl.where(split_max > float("-inf"), tl.math.exp2(split_max - overall), 0.0)
        dims = tl.arange(0, DIM)
        parts = tl.load(out_ptr + index[:, None] * DIM + dims[None, :], mask=in_range[:, None], other=0.0)
        total = tl.sum(split_sum * weight, axis=0)
        merged = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            result_ptr + row * stride_result_row + head * stride_result_head + dims,
            merged.to(result_ptr.dtype.element_ty),
        )
