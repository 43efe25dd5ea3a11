"""Paged decode attention on one GPU: trl-dapo's Triton kernel against PyTorch's FlexAttention and the reference.

    python3 -m benchmarks.rollout.bench_attention  # CUDA

One new token per row over a paged KV cache (pages of `--page-size` tokens scattered through a pool), at the head
layouts of Qwen2.5-0.5B (14 query / 2 KV heads, dim 64), 1.5B (12 / 2, dim 128) and 7B (28 / 4, dim 128). For each
(rows, context length) it checks the kernel against the float32 reference and times it (the kernel also rotates the
new token's q and k and writes its k and v to the cache; FlexAttention gets the rotated q and the written cache, so
it times the attention alone); FlexAttention runs with its
decoding kernel through a block mask built from the page table (its GQA packing needs a power-of-two number of query
heads per KV head, so the query heads are zero-padded to the next one) and is compiled once per shape. Bandwidth use
is the KV bytes each call must read over its time, against the measured copy bandwidth. Prints a table last and
writes `benchmarks/results/bench_attention.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from benchmarks.core.timing import copy_bandwidth, median_seconds
from benchmarks.core.workload import BENCHMARKS
from trl_dapo.rollout.paged_attention import (
    num_splits,
    reference_decode_attention,
    rotated_heads,
    triton_decode_attention,
)

HEADS = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}


def paged_problem(rows: int, context: int, heads: int, kv_heads: int, dim: int, page_size: int, seed: int = 0):
    """Random new tokens (q/k/v projections, rotary angles) and cache, each row's pages scattered through the pool;
    lengths spread over [context/2, context] so rows end at different points, the new token last."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(context // 2, context + 1, (rows,), device="cuda", generator=generator, dtype=torch.int32)
    pages_per_row = math.ceil(context / page_size)
    pool_pages = rows * pages_per_row + 1
    order = torch.randperm(pool_pages, device="cuda", generator=generator)[: rows * pages_per_row]
    table = order.view(rows, pages_per_row).int()
    shape = (pool_pages * page_size, kv_heads, dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    angles = torch.rand(rows, dim // 2, device="cuda", generator=generator) * 2 * math.pi
    cos, sin = (torch.cat([f(angles)] * 2, dim=1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    position = (lengths - 1).long()
    write = table.gather(1, (position // page_size).unsqueeze(1)).squeeze(1).long() * page_size + position % page_size
    return (qkv, cos, sin, write, k, v, table, lengths)


def flex_decoder(q, k, v, table, lengths, page_size: int):
    """FlexAttention over the same pages: full pages skip the mask, the last partial page masks its tail."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    rows, heads, dim = q.shape
    kv_heads = k.size(1)
    group = heads // kv_heads
    padded = 2 ** math.ceil(math.log2(group))
    query = torch.zeros(rows, kv_heads, padded, dim, device=q.device, dtype=q.dtype)
    query[:, :, :group] = q.view(rows, kv_heads, group, dim)
    query = query.view(rows, kv_heads * padded, 1, dim)
    keys, values = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)  # (1, KV, slots, D)
    full = (lengths // page_size).view(rows, 1, 1)
    partial = (lengths % page_size > 0).int().view(rows, 1, 1)
    last_fill = (lengths % page_size).view(rows)
    partial_index = table.gather(1, full.view(rows, 1).long()).view(rows, 1, 1, 1)
    block_mask = BlockMask.from_kv_blocks(
        partial.int(),
        partial_index.int(),
        full.int(),
        table.view(rows, 1, 1, -1).int(),
        BLOCK_SIZE=(16, page_size),
        mask_mod=lambda b, h, q_index, kv_index: kv_index % page_size < last_fill[b],
        seq_lengths=(1, keys.size(2)),
        compute_q_blocks=False,
    )
    compiled = torch.compile(flex_attention, fullgraph=True)

    def run():
        out = compiled(query, keys, values, block_mask=block_mask, enable_gqa=True)
        return out.view(rows, kv_heads, padded, dim)[:, :, :group].reshape(rows, heads, dim)

    return run


def measure(model: str, rows: int, context: int, page_size: int, bandwidth: float, flex: bool) -> dict:
    heads, kv_heads, dim = HEADS[model]
    problem = paged_problem(rows, context, heads, kv_heads, dim, page_size)
    qkv, cos, sin, _, k, v, table, lengths = problem
    new_token = (*problem, page_size, heads, None, 1e-6)
    kv_bytes = int(lengths.sum()) * kv_heads * dim * 2 * 2
    splits = num_splits(rows, kv_heads, qkv.device)
    candidates = {"triton": lambda: triton_decode_attention(*new_token, splits)}
    # Either call writes the new tokens' k and v, which FlexAttention reads; the reference's memory grows with rows.
    reference = reference_decode_attention(*new_token, context) if rows <= 256 else None
    if reference is None:
        candidates["triton"]()
    result = {"model": model, "rows": rows, "context": context, "page_size": page_size, "splits": splits}
    if flex:
        try:
            start = time.perf_counter()
            q = rotated_heads(qkv, cos, sin, heads, kv_heads, None, 1e-6)[0]
            candidates["flex"] = flex_decoder(q, k, v, table, lengths, page_size)
            candidates["flex"]()
            result["flex_compile_s"] = time.perf_counter() - start
        except Exception as error:  # record why it cannot serve this shape
            result["flex_error"] = f"{type(error).__name__}: {error}"[:300]
            candidates.pop("flex")
    for name, function in candidates.items():
        out = function()
        if reference is not None:
            result[f"{name}_max_error"] = (out.float() - reference.float()).abs().max().item()
        milliseconds = 1e3 * median_seconds(function)
        result[f"{name}_ms"] = milliseconds
        result[f"{name}_bandwidth_use"] = kv_bytes / (milliseconds / 1e3) / (bandwidth * 1e12)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(HEADS))
    parser.add_argument("--shapes", nargs="*", default=["16x8192", "128x512", "128x2048", "1024x2048", "256x8192"])
    parser.add_argument("--page-size", type=int, nargs="*", default=[16])
    parser.add_argument("--flex", action="store_true", help="also FlexAttention (compiled once per shape)")
    parser.add_argument("--output", default=str(BENCHMARKS / "results" / "bench_attention.json"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth("cuda") / 1e12  # TB/s
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_tb_per_s": bandwidth}
    results["runs"] = []
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for shape in args.shapes:
            rows, context = map(int, shape.split("x"))
            for page_size in args.page_size:
                run = measure(model, rows, context, page_size, bandwidth, args.flex and model == args.models[0])
                results["runs"].append(run)
                output.write_text(json.dumps(results, indent=2))
                print(json.dumps(run), flush=True)
    print(f"copy bandwidth {bandwidth:.2f} TB/s")
    print("| model | rows x context | page | triton ms | triton BW use | flex ms | flex BW use | max error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        flex = (
            f"{r['flex_ms']:.3f} | {r['flex_bandwidth_use']:.0%}"
            if "flex_ms" in r
            else f"- | {r.get('flex_error', '-')[:40]}"
        )
        print(
            f"| {r['model']} | {r['rows']}x{r['context']} | {r['page_size']} | {r['triton_ms']:.3f} | "
            f"{r['triton_bandwidth_use']:.0%} | {flex} | {r.get('triton_max_error', float('nan')):.2e} |"
        )


if __name__ == "__main__":
    main()
