"""Training attention (forward + backward) over one micro-batch of DAPO's uneven rows: padded against packed.

    python3 -m benchmarks.trainer.bench_training_attention  # CUDA

Rows of a 256-token prompt and a completion of geometric length (mean about 2,000, capped at the maximum), at the
head layouts of Qwen2.5-0.5B and 1.5B. Candidates, one attention layer each, bf16, forward + backward:
- `padded_sdpa`: the rows padded to the longest, SDPA with the padding mask (TRL's padded pass);
- `varlen_flash`: the rows packed, PyTorch's variable-length flash attention (trl-dapo's padding-free CUDA path);
- `flex_document`: the rows packed, FlexAttention with a causal document mask (compiled once per shape);
- `per_row_sdpa`: the rows packed, one causal SDPA call per row (trl-dapo's CPU path and reference).
With `--fixed-rows N`, also N rows all of the maximum length, where packing removes nothing: `varlen_flash` against
causal SDPA on the dense batch with its default backend choice (`dense_sdpa`, trl-dapo's path for equal rows), and
forced to flash (`dense_flash`) and to cuDNN (`dense_cudnn`).
Prints a table last and writes `benchmarks/results/bench_training_attention.json`.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from benchmarks.core.result_file import ResultFile
from benchmarks.core.timing import median_seconds
from benchmarks.core.workload import BENCHMARKS
from trl_dapo.trainer.training.packed_attention import (
    flash_varlen_attention,
    packed_attention,
    reference_packed_attention,
)

HEADS = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128)}


def row_lengths(rows: int, max_new: int, prompt: int, seed: int) -> list[int]:
    """Prompt + a geometric completion length (EOS with probability 1/2,048 per token), capped at `max_new`."""
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(rows, generator=generator)
    completions = (torch.log1p(-uniform) / torch.log1p(torch.tensor(-1 / 2048))).ceil().clamp(1, max_new)
    return [prompt + int(length) for length in completions]


def fwd_bwd(function, inputs):
    def run():
        out = function(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return run


def candidates(lengths: list[int], heads: tuple[int, int, int]) -> dict:
    query_heads, kv_heads, dim = heads
    total, rows, width = sum(lengths), len(lengths), max(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    scale = dim**-0.5

    def packed_inputs():
        shapes = [(1, query_heads, total, dim), (1, kv_heads, total, dim), (1, kv_heads, total, dim)]
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]

    def padded_inputs():
        shapes = [(rows, query_heads, width, dim), (rows, kv_heads, width, dim), (rows, kv_heads, width, dim)]
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]

    real = torch.arange(width, device="cuda") < torch.tensor(lengths, device="cuda").unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device="cuda").tril()
    mask = (causal.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)  # (rows, 1, width, width), keys real and causal

    def padded_sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def varlen_flash(q, k, v):
        return packed_attention(q, k, v, bounds, width, scale)

    def per_row_sdpa(q, k, v):
        return reference_packed_attention(q, k, v, bounds, scale)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = torch.repeat_interleave(torch.arange(rows, device="cuda"), torch.tensor(lengths, device="cuda"))

    def document_causal(b, h, q_index, kv_index):
        return (document[q_index] == document[kv_index]) & (q_index >= kv_index)

    block_mask = create_block_mask(document_causal, None, None, total, total, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def flex_document(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

    return {
        "padded_sdpa": (padded_sdpa, padded_inputs),
        "varlen_flash": (varlen_flash, packed_inputs),
        "flex_document": (flex_document, packed_inputs),
        "per_row_sdpa": (per_row_sdpa, packed_inputs),
    }


def fixed_candidates(rows: int, length: int, heads: tuple[int, int, int]) -> dict:
    """Equal rows: the variable-length kernel against dense causal SDPA, by backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query_heads, kv_heads, dim = heads
    bounds = torch.arange(0, rows * length + 1, length, device="cuda")

    def packed_inputs():
        shapes = [(1, query_heads, rows * length, dim), (1, kv_heads, rows * length, dim)]
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in (*shapes, shapes[1])]

    def dense_inputs():
        shapes = [(rows, query_heads, length, dim), (rows, kv_heads, length, dim)]
        return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in (*shapes, shapes[1])]

    def dense(backend=None):
        def attention(q, k, v):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return attention

    return {
        # the kernel itself: `packed_attention` takes the dense path for equal rows
        "varlen_flash": (lambda q, k, v: flash_varlen_attention(q, k, v, bounds, length, None), packed_inputs),
        "dense_sdpa": (dense(), dense_inputs),
        "dense_flash": (dense(SDPBackend.FLASH_ATTENTION), dense_inputs),
        "dense_cudnn": (dense(SDPBackend.CUDNN_ATTENTION), dense_inputs),
    }


def run_candidates(named: dict, lengths: list[int], model: str, max_new: int, results: list, output) -> None:
    """Time each candidate on its own fresh inputs; an error is recorded and the others still run."""
    for name, (function, make_inputs) in named.items():
        torch.cuda.reset_peak_memory_stats()
        try:
            ms, error = 1e3 * median_seconds(fwd_bwd(function, make_inputs())), None
        except Exception as failure:
            ms, error = None, f"{type(failure).__name__}: {failure}"[:300]
        results.append(
            dict(
                model=model, max_new=max_new, rows=len(lengths), real_tokens=sum(lengths),
                padded_tokens=len(lengths) * max(lengths), candidate=name, fwd_bwd_ms=ms,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, error=error,
            )
        )  # fmt: skip
        output.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-new", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--fixed-rows", type=int, default=0, help="also this many rows all of the maximum length")
    parser.add_argument("--output", default=str(BENCHMARKS / "results" / "bench_training_attention.json"))
    args = parser.parse_args()
    output = ResultFile(args.output, "cuda", vars(args))
    results = output.data["results"] = []
    for model, heads in HEADS.items():
        for max_new in args.max_new:
            lengths = row_lengths(args.rows, max_new, prompt=256, seed=0)
            run_candidates(candidates(lengths, heads), lengths, model, max_new, results, output)
            if args.fixed_rows:
                fixed = [max_new + 256] * args.fixed_rows
                named = fixed_candidates(args.fixed_rows, max_new + 256, heads)
                run_candidates(named, fixed, model, max_new, results, output)
    lines = [
        "| heads | max new | rows | real / padded tokens | candidate | fwd+bwd ms | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = f"{r['fwd_bwd_ms']:.2f}" if r["fwd_bwd_ms"] is not None else r["error"]
        lines.append(
            f"| {r['model']} | {r['max_new']} | {r['rows']} | {r['real_tokens']} / {r['padded_tokens']} | "
            f"{r['candidate']} | {ms} | {r['peak_gib']:.2f} |"
        )
    print("\n".join(lines))
    print(f"wrote {output.path}")


if __name__ == "__main__":
    main()
