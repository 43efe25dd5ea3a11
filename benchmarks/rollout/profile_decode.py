"""Where the paged engine's decode step spends its device time.

    python3 -m benchmarks.rollout.profile_decode         # 7B + LoRA at 64 x 512, 0.5B at 128 x 256
    python3 -m benchmarks.rollout.profile_decode --models qwen2.5-1.5b@128x256
    python3 -m benchmarks.rollout.profile_decode --models qwen2.5-7b@128x512 qwen2.5-7b:fp8kv@128x512 \\
        qwen2.5-7b:fp8@128x512
    python3 -m benchmarks.rollout.profile_decode --tiny  # CPU smoke run on the tiny local model

A model is `NAME[:lora][:fp8kv|:fp8]@ROWSxNEW`: the config (`configs/NAME.json`; `:lora` wraps it in a LoRA r=16
adapter, which the engine merges; `:fp8kv` gives the engine an FP8 KV cache, `:fp8` FP8 weights too, and skips the
microbenchmarks, which time bf16 weights and caches), ROWS rows of 32-token prompts in groups of 16, NEW tokens pinned. Per model:

- the engine's own calls at that shape (wall s, tokens/s, decode s, ms per decode step), after a short warm-up call;
- per-kernel device time per decode step, from torch.profiler over one call of at most 64 tokens (the same settings)
  replayed as CUDA graphs and over the same call run eagerly (the same compiled code; kernels inside graph replays
  can go unreported);
- microbenchmarks at the decode batch: each weight's matrix product (time, TB/s), all of a decode step's matrix
  products in sequence against the copy-bandwidth floor of their bytes, the decode attention at `--context` tokens,
  the sampling head (compiled as the engine runs it) and its noise.

A decode step is a few hundred kernels; which ones take its time is what decides where the next millisecond is.
On the CPU (`--tiny`) the profile counts operators' CPU time and times run on the host clock. Prints a table last
and writes `benchmarks/results/profile_decode_<device>.json` after each model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.timing import copy_bandwidth, timed_call
from benchmarks.core.workload import EOS_TOKEN_ID, PAD_TOKEN_ID, token_prompts
from benchmarks.rollout.bench_rollout import build_model, release_memory
from trl_dapo.rollout import PagedRolloutEngine, TokenSampling
from trl_dapo.rollout.generation import slot_bucket
from trl_dapo.rollout.paged_attention import num_splits, reference_decode_attention, triton_decode_attention
from trl_dapo.rollout.token_sampling import sampling_noise

PROFILED_TOKENS = 64  # at most, per row, in the profiled calls
TOP_KERNELS = 30
DEFAULT_MODELS = ["qwen2.5-7b:lora@64x512", "qwen2.5-0.5b@128x256"]


FP8_OPTIONS = {"fp8kv": ("fp8", "bf16"), "fp8": ("fp8", "fp8")}  # option: (KV cache, weights) dtypes


def parse_model(text: str) -> tuple[str, bool, str, int, int]:
    """`NAME[:lora][:fp8kv|:fp8]@ROWSxNEW` as (name, lora, FP8 option or "", rows, new tokens)."""
    try:
        spec, shape = text.split("@")
        rows, new = (int(n) for n in shape.split("x"))
    except ValueError as error:
        expected = "expected NAME[:lora][:fp8kv|:fp8]@ROWSxNEW, e.g. qwen2.5-7b:lora@64x512"
        raise argparse.ArgumentTypeError(f"model {text!r}: {expected}") from error
    name, *options = spec.split(":")
    unknown = set(options) - {"lora", *FP8_OPTIONS}
    if unknown or len(set(options) & set(FP8_OPTIONS)) > 1:
        raise argparse.ArgumentTypeError(f"model {text!r}: the options after ':' are 'lora' and one of fp8kv, fp8")
    if rows < 1 or new < 2:
        raise argparse.ArgumentTypeError(f"model {text!r}: at least 1 row and 2 new tokens (1 decode step)")
    fp8 = next((option for option in options if option in FP8_OPTIONS), "")
    return name, "lora" in options, fp8, rows, new


def seconds_per_call(function: Callable[[], object], cuda: bool, repeats: int = 50) -> float:
    """Mean time of `function`: on CUDA of `repeats` calls captured in one graph (no launch gaps), else host clock."""
    for _ in range(3):
        function()
    if not cuda:
        return timed_call(lambda: [function() for _ in range(repeats)])[1] / repeats
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            function()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def kernel_profile(generate: Callable[[], object], steps: int, cuda: bool) -> dict:
    """Device time (CPU self time on the CPU) per decode step of each kernel or operator over one `generate` call,
    and the CUDA graphs the host launched per step (kernels inside a graph replay may go unreported)."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        generate()
        if cuda:
            torch.cuda.synchronize()
    rows, graph_launches = [], 0
    for event in profiler.key_averages():
        if event.key.startswith(("cudaGraphLaunch", "cuGraphLaunch")):  # runtime or driver API, any version suffix
            graph_launches += event.count
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        microseconds = event.device_time_total if cuda else event.self_cpu_time_total
        if microseconds > 0 and on_device == cuda:
            rows.append(
                {"us_per_step": microseconds / steps, "calls_per_step": event.count / steps, "name": event.key}
            )
    rows.sort(key=lambda row: -row["us_per_step"])
    return {
        "us_per_step": sum(row["us_per_step"] for row in rows),
        "calls_per_step": sum(row["calls_per_step"] for row in rows),
        "graph_launches_per_step": graph_launches / steps,
        "top": rows[:TOP_KERNELS],
    }


def matrix_products(engine: PagedRolloutEngine, rows: int, bandwidth: float, cuda: bool) -> dict:
    """Each weight's product at `rows` rows and a decode step's products in sequence, against their bytes' floor; the
    down projection called as the decode step calls it (`down_bias`: with the zero bias the engine chose)."""
    snapshot, dtype = engine.snapshot, engine.dtype
    layer = snapshot.layers[0]
    down_bias = engine.down_bias(slot_bucket(rows, engine.max_rows))
    result = {"down_bias": down_bias is not None}
    for key in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
        weight = layer[key]
        bias = down_bias if key == "down_weight" else None
        x = torch.randn(rows, weight.size(1), device=engine.device, dtype=dtype)
        seconds = seconds_per_call(lambda x=x, weight=weight, bias=bias: F.linear(x, weight, bias), cuda)
        result[key] = {"us": seconds * 1e6, "tb_per_s": weight.nbytes / seconds / 1e12, "shape": list(weight.shape)}
    hidden = torch.randn(rows, snapshot.config.hidden_size, device=engine.device, dtype=dtype)
    seconds = seconds_per_call(lambda: F.linear(hidden, snapshot.lm_head), cuda)
    head = snapshot.lm_head
    result["lm_head"] = {"us": seconds * 1e6, "tb_per_s": head.nbytes / seconds / 1e12, "shape": list(head.shape)}
    intermediate = layer["down_weight"].size(1)
    inner = torch.randn(rows, intermediate, device=engine.device, dtype=dtype)

    def all_products() -> None:
        for weights in snapshot.layers:
            F.linear(hidden, weights["qkv_weight"], weights["qkv_bias"])
            F.linear(hidden, weights["o_weight"])
            F.linear(hidden, weights["gate_up_weight"])
            F.linear(inner, weights["down_weight"], down_bias)
        F.linear(hidden, snapshot.lm_head)

    weight_bytes = snapshot.lm_head.nbytes + sum(
        weights[key].nbytes
        for weights in snapshot.layers
        for key in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    )
    seconds = seconds_per_call(all_products, cuda, repeats=5)
    result["all"] = {
        "us": seconds * 1e6,
        "tb_per_s": weight_bytes / seconds / 1e12,
        "weight_bytes": weight_bytes,
        "floor_us": weight_bytes / bandwidth * 1e6,
    }
    return result


def attention_and_head(engine: PagedRolloutEngine, rows: int, context: int, settings, cuda: bool) -> dict:
    """The decode attention over `context` tokens per row (the new token's rotation and cache write included), the
    sampling head and its noise, at `rows` rows."""
    device, dtype, page = engine.device, engine.dtype, engine.page_size
    heads, kv_heads, dim = engine.num_heads, engine.num_kv_heads, engine.head_dim
    pages = math.ceil(context / page)
    cache_shape = (rows * pages * page + page, kv_heads, dim)
    k_cache = torch.randn(cache_shape, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.arange(rows * pages, device=device, dtype=torch.int32).view(rows, pages)
    lengths = torch.full((rows,), context, device=device, dtype=torch.int32)
    write = table[:, (context - 1) // page].long() * page + (context - 1) % page
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    cos, sin = (
        engine.cos[context - 1].expand(rows, dim).contiguous(),
        engine.sin[context - 1].expand(rows, dim).contiguous(),
    )
    norm = engine.architecture.qk_norm(engine.snapshot.layers[0])
    new_token = (qkv, cos, sin, write, k_cache, v_cache, table, lengths, page, heads, norm, engine.eps)
    if engine.attention_kernel == "triton":
        splits = num_splits(rows, kv_heads, device)
        attention = lambda: triton_decode_attention(*new_token, splits)  # noqa: E731
    else:
        splits = 0
        attention = lambda: reference_decode_attention(*new_token, context)  # noqa: E731
    kv_bytes = rows * context * kv_heads * dim * 2 * k_cache.element_size()
    seconds = seconds_per_call(attention, cuda)
    hidden = torch.randn(rows, engine.snapshot.config.hidden_size, device=device, dtype=dtype)
    draw_noise = lambda: sampling_noise(rows, engine.vocab_size, settings, device)  # noqa: E731
    noise = draw_noise()
    generated = torch.zeros(rows, dtype=torch.long, device=device)
    head = lambda: engine.sample_tokens(hidden, noise, settings, generated)  # noqa: E731
    return {
        "attention": {
            "us": seconds * 1e6,
            "tb_per_s": kv_bytes / seconds / 1e12,
            "context": context,
            "splits": splits,
        },
        "head_us": seconds_per_call(head, cuda) * 1e6,
        "noise_us": seconds_per_call(draw_noise, cuda) * 1e6,
    }


def profile_model(name: str, lora: bool, fp8: str, rows: int, new_tokens: int, args, setup: dict) -> dict:
    """The engine's calls and kernel profiles; the microbenchmarks time bf16 weights and caches, so an FP8 engine
    (`fp8`: an option of `FP8_OPTIONS`) skips them."""
    cuda, dtype, bandwidth = setup["device"] == "cuda", setup["dtype"], setup["copy_bytes_per_s"]
    model = build_model(name, lora, setup["device"], dtype)
    kv_cache_dtype, weights_dtype = FP8_OPTIONS.get(fp8, ("bf16", "bf16"))
    engine = PagedRolloutEngine(
        model, eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID, dtype=dtype, cuda_graph=cuda,
        memory_fraction=args.memory_fraction, max_rows=args.max_rows, kv_cache_dtype=kv_cache_dtype,
        weights_dtype=weights_dtype,
    )  # fmt: skip
    engine.sync_weights(model)
    prompts = token_prompts(rows, 32, model.config.vocab_size)
    pinned = TokenSampling(new_tokens, temperature=1.0, min_new_tokens=new_tokens)
    # the measured calls' settings, fewer tokens: what the engine compiles for (all but the length) is the same
    short = dataclasses.replace(pinned, max_new_tokens=min(PROFILED_TOKENS, new_tokens))
    entry: dict = {
        "rows": rows, "new_tokens": new_tokens, "profiled_tokens": short.max_new_tokens,
        "kv_cache_dtype": kv_cache_dtype, "weights_dtype": weights_dtype,
        "cache_bytes_per_token": engine.cache_bytes_per_token(),
    }  # fmt: skip
    entry["warmup_s"] = timed_call(engine.generate, prompts, short)[1]
    entry["calls"] = []
    for _ in range(args.calls):
        out, seconds = timed_call(engine.generate, prompts, pinned)
        stats = out.stats
        entry["calls"].append({
            "wall_s": seconds, "tokens_per_s": stats.generated_tokens / seconds, "decode_s": stats.decode_s,
            "prefill_s": stats.prefill_s, "decode_steps": stats.decode_steps,
            "ms_per_decode_step": 1e3 * stats.decode_s / stats.decode_steps,
        })  # fmt: skip
    steps = short.max_new_tokens - 1  # each row's first token comes from its prefill
    if cuda:
        entry["graph_profile"] = kernel_profile(lambda: engine.generate(prompts, short), steps, cuda)
        engine.cuda_graph = False  # the same compiled code, its kernels launched one by one
        engine.generate(prompts, short)
    entry["eager_profile"] = kernel_profile(lambda: engine.generate(prompts, short), steps, cuda)
    engine.cuda_graph = cuda
    if not fp8:
        entry["matrix_products"] = matrix_products(engine, rows, bandwidth, cuda)
        entry.update(attention_and_head(engine, rows, args.context, pinned, cuda))
    return entry


def table(models: dict) -> str:
    lines = [
        "| model | rows x new | ms / decode step | kernel us / step (kernels) | products us (TB/s; floor us) | "
        "attention us | head us |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in models.items():
        if "error" in r:
            lines.append(f"| {label} | {r['error']} |")
            continue
        step = sorted(call["ms_per_decode_step"] for call in r["calls"])[len(r["calls"]) // 2]
        kernels = r.get("graph_profile", r["eager_profile"])
        if "matrix_products" in r:
            products = r["matrix_products"]["all"]
            micro = (
                f"{products['us']:,.0f} ({products['tb_per_s']:.2f}; {products['floor_us']:,.0f}) | "
                f"{r['attention']['us']:.1f} | {r['head_us']:.1f}"
            )
        else:
            micro = "(bf16 only) | | "
        lines.append(
            f"| {label} | {r['rows']}x{r['new_tokens']} | {step:.3f} | {kernels['us_per_step']:,.0f} "
            f"({kernels['calls_per_step']:.0f}) | {micro} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument(
        "--models", nargs="*", type=parse_model, default=None, help="NAME[:lora][:fp8kv|:fp8]@ROWSxNEW ..."
    )
    parser.add_argument("--context", type=int, default=288, help="cached tokens per row in the attention timing")
    parser.add_argument("--calls", type=int, default=3, help="measured calls of the engine at each model's shape")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="the engine's device memory budget")
    parser.add_argument("--max-rows", type=int, default=1024, help="the engine's decode slots")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    models = args.models or [parse_model(m) for m in (["tiny@16x12"] if args.tiny else DEFAULT_MODELS)]
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":  # one engine per model, each compiling its layer and sampling head for its sizes: past the
        # default limit of 8 recompilations of the same code, later ones would run eagerly
        torch._dynamo.config.recompile_limit = 64
    output = ResultFile(args.output or default_output("profile_decode", args.tiny, device), device, vars(args))
    output.data["copy_bytes_per_s"] = bandwidth = copy_bandwidth(device)
    results = output.data["models"] = {}
    setup = {"device": device, "dtype": dtype, "copy_bytes_per_s": bandwidth}
    failures = 0
    for name, lora, fp8, rows, new_tokens in models:
        label = name + ("+lora-r16" if lora else "") + (f"+{fp8}" if fp8 else "")
        try:
            results[label] = profile_model(name, lora, fp8, rows, new_tokens, args, setup)
        except Exception as error:  # recorded and reported; the other models still run
            traceback.print_exc()
            results[label], failures = {"error": f"{type(error).__name__}: {error}"[:300]}, failures + 1
        output.save()
        for row in results[label].get("graph_profile", results[label].get("eager_profile", {})).get("top", [])[:12]:
            print(f"{label}: {row['us_per_step']:9.1f} us x{row['calls_per_step']:5.1f}  {row['name'][:100]}")
        release_memory()  # the engine and its graphs hold device memory until collected
    finish(table(results), output.path, failures, "model(s)")


if __name__ == "__main__":
    main()
