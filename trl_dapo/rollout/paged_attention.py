"""Decode attention over a paged KV cache: each row reads only the pages it has filled.

The cache of one layer is a flat, token-major tensor `(slots, kv_heads, head_dim)`; a row's tokens live in pages of
`page_size` consecutive slots, listed in its row of `page_table`. One query token per row attends to the first
`seq_lens[row]` tokens of its pages.

On CUDA a split-K Triton kernel does it in two launches (partial softmax per split of each row's tokens, then the
merge), with a fixed grid so it can be captured in a CUDA graph. FlexAttention's decoding kernel would need the
query heads per KV head to be a power of two (Qwen2.5 has 6 and 7) and a batch size fixed at compile time;
`benchmarks/bench_attention.py` measures both. Elsewhere a PyTorch gather-and-softmax reference computes the same
function.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None


def reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    max_len: int,
) -> torch.Tensor:
    """q (rows, heads, dim); caches (slots, kv_heads, dim); page_table (rows, pages); seq_lens (rows,), at most
    `max_len`. Returns (rows, heads, dim) in q's dtype; a row with no tokens gets zeros."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.size(1)
    pages = math.ceil(max_len / page_size) if max_len else 0
    positions = torch.arange(pages * page_size, device=q.device)
    slots = page_table[:, :pages].long().repeat_interleave(page_size, dim=1) * page_size + positions % page_size
    keys, values = k_cache[slots].float(), v_cache[slots].float()  # (rows, tokens, kv_heads, dim)
    grouped = q.float().view(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("rkgd,rtkd->rkgt", grouped, keys) / math.sqrt(dim)
    valid = positions.unsqueeze(0) < seq_lens.unsqueeze(1)
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    weights = torch.nan_to_num(scores.softmax(dim=-1))
    return torch.einsum("rkgt,rtkd->rkgd", weights, values).reshape(rows, heads, dim).to(q.dtype)


def num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """Splits of each row's tokens so that the grid holds about two programs per multiprocessor."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(32, math.ceil(2 * processors / max(rows * kv_heads, 1))))


def triton_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    splits: int,
    block_n: int = 64,
) -> torch.Tensor:
    """The Triton kernel's version of `reference_decode_attention` (same arguments; no host synchronisation)."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.size(1)
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    partial_out = torch.empty(rows, kv_heads, splits, group_pad, dim, device=q.device, dtype=torch.float32)
    partial_max = torch.empty(rows, kv_heads, splits, group_pad, device=q.device, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    _split_kernel[(rows, kv_heads, splits)](
        q, k_cache, v_cache, page_table, seq_lens, partial_out, partial_max, partial_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), page_table.stride(0),
        (1.0 / math.sqrt(dim)) * 1.4426950408889634,
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, PAGE=page_size, BLOCK_N=block_n, SPLITS=splits,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_kernel[(rows, heads)](
        partial_out, partial_max, partial_sum, out, out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
        num_warps=1,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, max_ptr, sum_ptr,
        stride_q_row, stride_q_head, stride_k_slot, stride_k_head, stride_table_row,
        scale_log2,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        """Online softmax of one row's query heads sharing KV head `kv`, over split `split` of its tokens."""
        row, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lens_ptr + row)
        chunk = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        heads = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM)
        q = tl.load(
            q_ptr + row * stride_q_row + (kv * GROUP + heads)[:, None] * stride_q_head + dims[None, :],
            mask=(heads < GROUP)[:, None],
            other=0.0,
        )
        running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], dtype=tl.float32)
        for first in range(start, end, BLOCK_N):
            tokens = first + tl.arange(0, BLOCK_N)
            valid = tokens < end
            page = tl.load(table_ptr + row * stride_table_row + tokens // PAGE, mask=valid, other=0)
            offsets = (page.to(tl.int64) * PAGE + tokens % PAGE)[:, None] * stride_k_slot + kv * stride_k_head
            k = tl.load(k_ptr + offsets + dims[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.math.exp2(scores - new_max[:, None])
            rescale = tl.math.exp2(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + offsets + dims[None, :], mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
            running_max = new_max
        base = (row * tl.num_programs(1) + kv) * SPLITS + split
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
