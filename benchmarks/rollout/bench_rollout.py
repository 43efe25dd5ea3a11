"""The rollout engine in DAPO's real regime, beside HF `generate` (TRL's path) in one process.

    python3 -m benchmarks.rollout.bench_rollout --models qwen2.5-0.5b --shapes 128x256-fixed 128x1024 1024x8192
    python3 -m benchmarks.rollout.bench_rollout --tiny  # CPU smoke run on the tiny local model (fp32, eager)

A shape is `ROWSxNEW[pPROMPT][-fixed][-lora][=ENGINE,...]`: ROWS rows of PROMPT-token prompts (default 256; 32 for
fixed shapes) in groups of 16 identical prompts, as DAPO samples them, with random ids in [3, vocab), generating up
to NEW tokens at temperature 1. `-fixed` pins every length to NEW (`min_new_tokens`) on the full-vocabulary config
of each of `--models`; otherwise nothing is pinned and the model's 2,048-token-vocabulary variant runs, so lengths
are geometric with mean about 2,000, capped at NEW. `-lora` runs `--lora-model` (Qwen2.5-7B layers) wrapped in a
LoRA r=16 all-linear adapter, which the paged engine merges into its snapshot. `=ENGINE,...` picks the engines (hf,
paged, paged_fp8kv, paged_fp8); by default a named shape runs those that finish in reasonable time and memory
(`DEFAULT_ENGINES`), never the FP8 ones. `paged_fp8kv` is the paged engine with an FP8 KV cache
(`rollout_kv_cache_dtype="fp8"`), `paged_fp8` with FP8 weights too (`rollout_weights_dtype="fp8"`; GPUs of compute
capability 8.9 or more), each built once per model like `paged`:

    python3 -m benchmarks.rollout.bench_rollout --models qwen2.5-7b --shapes 128x4096=paged,paged_fp8kv,paged_fp8 \
        --engines paged paged_fp8kv paged_fp8 --repeats 3

Per (model, shape, engine): useful tokens/s = sum of completion lengths / device-synchronised wall time of one
generate call, after warm-up calls (engine construction, compile, capture: reported on their own); the share of
decode work spent on finished rows; peak memory over the call; and bandwidth use = floor / measured time, the floor
being the time to read, at the measured copy bandwidth, the weights once per decode step and each row's live KV
cache at each of its steps (in bf16 bytes: the FP8 engines read about half, so their use reads high). The paged engine is built once per model and serves each of its shapes, as it serves
every round of a training run.
Prints a table last and writes `benchmarks/results/bench_rollout_<device>.json` after every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import re
import traceback

import torch

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.timing import copy_bandwidth, timed_call
from benchmarks.core.workload import (
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    config_path,
    decode_weight_bytes,
    kv_bytes_per_token,
    random_model,
    token_prompts,
    with_lora,
)
from trl_dapo.rollout import PagedRolloutEngine, TokenSampling

ENGINES = ("paged", "paged_fp8kv", "paged_fp8", "hf")  # in the default run order (--engines)
PLAIN_ENGINES = ("paged", "hf")  # what a shape runs unless it names its engines
# HF generate is far too slow for the long shapes.
DEFAULT_ENGINES = {
    "128x256-fixed": PLAIN_ENGINES,
    "128x1024": PLAIN_ENGINES,
    "128x4096": ("paged",),
    "128x8192": ("paged",),
    "1024x2048": ("paged",),
    "1024x8192": ("paged",),
    "8192x8192": ("paged",),
    "512x8192p2048": ("paged",),
    "64x512-fixed-lora": PLAIN_ENGINES,
}
TINY_SHAPES = ["32x16p8-fixed", "16x96p8", "16x8p8-fixed-lora"]
SHAPE = re.compile(r"(\d+)x(\d+)(?:p(\d+))?(-fixed)?(-lora)?(?:=([a-z0-9_,]+))?")
HF_WARMUP_TOKENS = 16  # HF generate has nothing to compile or capture: a short call warms up the device
PAGED_WARMUP_TOKENS = 40  # one synchronisation and a few steps


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    rows: int
    new_tokens: int
    prompt_tokens: int
    fixed: bool
    lora: bool
    engines: tuple[str, ...]


def parse_shape(text: str) -> Shape:
    match = SHAPE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: expected ROWSxNEW[pPROMPT][-fixed][-lora][=ENGINE,...], e.g. 1024x8192, 512x8192p2048 "
            "or 64x512-fixed-lora=hf,paged"
        )
    rows, new_tokens, prompt_tokens, fixed, lora, engines = match.groups()
    name = text.split("=")[0]
    chosen = tuple(engines.split(",")) if engines else DEFAULT_ENGINES.get(name, PLAIN_ENGINES)
    if set(chosen) - set(ENGINES):
        raise argparse.ArgumentTypeError(f"shape {text!r}: engines are {', '.join(ENGINES)}")
    prompt = int(prompt_tokens) if prompt_tokens else 32 if fixed else 256
    return Shape(name, int(rows), int(new_tokens), prompt, bool(fixed), bool(lora), chosen)


# --------------------------------------------------------------------------------------------------- engines
# Each builder returns generate(prompt ids, settings) -> (completions cut after their first EOS, paged stats or None).


def hf_generate(model, dtype, cuda: bool, args):
    """TRL's path: `model.generate`, sampling with the model's own cache."""

    def generate(prompt_ids: list[list[int]], settings: TokenSampling):
        ids = torch.tensor(prompt_ids, device=model.device)
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=settings.temperature,
            top_p=1.0, top_k=0, max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens,
            eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, disable_compile=True,
        )[:, ids.size(1) :].cpu()  # fmt: skip
        is_eos = out == EOS_TOKEN_ID
        lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, out.size(1))
        return [row[:length].tolist() for row, length in zip(out, lengths.tolist(), strict=True)], None

    return generate


def paged_generate(model, dtype, cuda: bool, args, kv_cache_dtype: str = "bf16", weights_dtype: str = "bf16"):
    engine = PagedRolloutEngine(
        model, eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID, dtype=dtype, cuda_graph=cuda,
        memory_fraction=args.memory_fraction, max_rows=args.max_rows, kv_cache_dtype=kv_cache_dtype,
        weights_dtype=weights_dtype,
    )  # fmt: skip
    engine.sync_weights(model)

    def generate(prompt_ids: list[list[int]], settings: TokenSampling):
        out = engine.generate(prompt_ids, settings)
        return out.completions, out.stats

    return generate


BUILDERS = {
    "hf": hf_generate,
    "paged": paged_generate,
    "paged_fp8kv": functools.partial(paged_generate, kv_cache_dtype="fp8"),
    "paged_fp8": functools.partial(paged_generate, kv_cache_dtype="fp8", weights_dtype="fp8"),
}


# ----------------------------------------------------------------------------------------------- measurement


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warmup_calls(engine: str, prompt_ids, settings: TokenSampling, args) -> list[tuple]:
    """The calls that compile and capture before the measured one. The paged engine compiles once per process but its
    Triton kernels have a variant per slot bucket (the split count) and its graphs are captured per bucket and
    settings: one short call per bucket up to `--warmup-rows` (the shape's prompts repeated, its settings but at most
    PAGED_WARMUP_TOKENS tokens) meets every bucket a measured call can use, as a training run's first rounds do; the
    graphs a measured call captures for its own pool still count in it. HF: a few tokens on all rows."""
    if engine == "hf":
        short = dataclasses.replace(
            settings,
            max_new_tokens=min(settings.max_new_tokens, HF_WARMUP_TOKENS),
            min_new_tokens=min(settings.min_new_tokens, HF_WARMUP_TOKENS),
        )
        return [(prompt_ids, short)]
    short = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, PAGED_WARMUP_TOKENS))
    largest = min(args.warmup_rows, args.max_rows)
    buckets = [2**i for i in range(3, largest.bit_length()) if 2**i < largest] + [largest]
    return [((prompt_ids * math.ceil(rows / len(prompt_ids)))[:rows], short) for rows in buckets]


def measure(engine: str, generate, prompt_ids, settings, setup: dict, args) -> dict:
    """Warm-up, then `--repeats` measured calls of `generate` (`engine`'s); the call of median tokens/s is reported
    (a single short call varies by tens of percent between runs on the same GPU)."""
    cuda = setup["device"] == "cuda"
    warmup_s = sum(timed_call(generate, *call)[1] for call in warmup_calls(engine, prompt_ids, settings, args))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    calls = []
    for _ in range(args.repeats):
        (completions, stats), seconds = timed_call(generate, prompt_ids, settings)
        calls.append((sum(map(len, completions)) / seconds, seconds, completions, stats))
    _, seconds, completions, stats = sorted(calls, key=lambda call: call[0])[len(calls) // 2]
    result = {"warmup_call_s": warmup_s, "seconds": seconds, "tokens_per_s_calls": [call[0] for call in calls]}
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    useful = int(lengths.sum())
    if stats is None:  # every row decodes until the longest ends
        decode_steps = int(lengths.max())
        finished_share = 1 - useful / (len(completions) * decode_steps)
    else:
        decode_steps = stats.decode_steps
        finished_share = 1 - stats.busy_slot_steps / stats.slot_steps
        result["engine_stats"] = stats.as_dict()
        if cuda:
            budget = args.memory_fraction * torch.cuda.get_device_properties(0).total_memory / 2**30
            result.update(budget_gib=budget, within_budget=result["peak_reserved_gib"] <= budget)
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.float64)
    live_kv_tokens = float((lengths * prompt_lengths + lengths * (lengths - 1) / 2).sum())  # sum_r sum_{t<L_r} P_r + t
    floor_bytes = decode_steps * setup["weight_bytes"] + live_kv_tokens * setup["kv_bytes_per_token"]
    floor_s = floor_bytes / setup["copy_bytes_per_s"]
    quantiles = torch.quantile(lengths, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {
        **result,
        "useful_tokens": useful,
        "tokens_per_s": useful / seconds,
        "decode_steps": decode_steps,
        "finished_row_share": finished_share,
        "lengths": {"mean": useful / len(completions), "min": int(lengths.min()), "max": int(lengths.max()),
                    "p10": quantiles[0], "p50": quantiles[1], "p90": quantiles[2]},
        "floor_bytes": floor_bytes,
        "floor_s": floor_s,
        "bandwidth_use": floor_s / seconds,
    }  # fmt: skip


def run_engine(engine: str, model, shapes: list[Shape], setup: dict, args, record: dict, save) -> int:
    """Measure `engine` on each shape, `save` each result (`record` + the measurement); return the failures. The
    paged engine is built once and serves every shape, as it serves every round of a training run (its KV pool is
    sized by the budget, not by the shape); HF `generate`, which has nothing to build, is warmed up per shape."""
    cuda, failures, reusable = setup["device"] == "cuda", 0, None
    for shape in shapes:
        prompt_ids = token_prompts(shape.rows, shape.prompt_tokens, model.config.vocab_size)
        sampling = TokenSampling(
            shape.new_tokens, temperature=1.0, min_new_tokens=shape.new_tokens if shape.fixed else 0
        )
        entry = {**record, "shape": shape.name, "engine": engine, "rows": shape.rows, "new_tokens": shape.new_tokens,
                 "prompt_tokens": shape.prompt_tokens, "fixed": shape.fixed}  # fmt: skip
        generate = None
        try:
            if reusable is None:
                generate, entry["build_s"] = timed_call(BUILDERS[engine], model, setup["dtype"], cuda, args)
            else:
                generate, entry["build_s"] = reusable, 0.0
            entry.update(measure(engine, generate, prompt_ids, sampling, setup, args))
            reusable = generate if engine.startswith("paged") else None
        except torch.OutOfMemoryError:
            entry["error"], reusable = "out of memory", None
        except Exception as error:  # recorded and reported; the other measurements still run
            traceback.print_exc()
            entry["error"], reusable = f"{type(error).__name__}: {error}"[:300], None
            failures += 1
        del generate
        release_memory()
        save(entry)
    del reusable
    release_memory()
    return failures


def build_model(name: str, lora: bool, device: str, dtype: torch.dtype):
    model = random_model(config_path(name), device, dtype).eval()
    return with_lora(model, rank=16) if lora else model


def model_runs(shapes: list[Shape], args) -> dict[tuple[str, bool], list[Shape]]:
    """The shapes each (config name, LoRA) model runs, in the order given."""
    runs: dict[tuple[str, bool], list[Shape]] = {}
    for model in args.models:
        for shape in shapes:
            name = (
                "tiny" if args.tiny else args.lora_model if shape.lora else model if shape.fixed else f"{model}-v2048"
            )
            if shape not in runs.setdefault((name, shape.lora), []):
                runs[(name, shape.lora)].append(shape)
    return runs


# ---------------------------------------------------------------------------------------------------- report


def table(results: list[dict]) -> str:
    """The results by model, then shape, then engine (they run engine by engine)."""
    order = {
        key: {value: i for i, value in enumerate(dict.fromkeys(r[key] for r in results))} for key in ("model", "shape")
    }
    results = sorted(
        results, key=lambda r: (order["model"][r["model"]], order["shape"][r["shape"]], ENGINES.index(r["engine"]))
    )
    lines = [
        "| model | shape | engine | useful tok/s | s | warm-up s | mean / max length | decode on finished rows | "
        "peak GiB (budget) | bandwidth use |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {r['model']} | {r['shape']} | {r['engine']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | | | | |")
            continue
        peak = f"{r['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in r else "-"
        peak += f" ({r['budget_gib']:.0f})" if "budget_gib" in r else ""
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['seconds']:.2f} | {r['build_s'] + r['warmup_call_s']:.1f} | "
            f"{r['lengths']['mean']:.0f} / {r['lengths']['max']} | {r['finished_row_share']:.0%} | {peak} | "
            f"{r['bandwidth_use']:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument(
        "--models", nargs="*", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
        help="configs of the -fixed shapes; the other shapes run their -v2048 variants",
    )  # fmt: skip
    parser.add_argument("--lora-model", default="qwen2.5-7b", help="the config -lora shapes run")
    parser.add_argument("--shapes", nargs="*", type=parse_shape, default=None, help="default: every named shape")
    parser.add_argument("--engines", nargs="*", choices=ENGINES, default=list(ENGINES), help="run order, and filter")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="paged engine: device memory budget")
    parser.add_argument("--max-rows", type=int, default=1024, help="paged engine: decode slots")
    parser.add_argument("--warmup-rows", type=int, default=1024, help="rows of the paged engine's warm-up calls")
    parser.add_argument("--repeats", type=int, default=1, help="measured calls per shape and engine (median reported)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    shapes = args.shapes or [parse_shape(s) for s in (TINY_SHAPES if args.tiny else DEFAULT_ENGINES)]
    if args.tiny:
        args.models = ["tiny"]

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":  # one paged engine per model, each compiling its layer and sampling head for its sizes and
        # settings: past the default limit of 8 recompilations of the same code, later ones would run eagerly
        torch._dynamo.config.recompile_limit = 64
    settings = {**vars(args), "shapes": [s.name for s in shapes], "device": device, "dtype": dtype}
    output = ResultFile(args.output or default_output("bench_rollout", args.tiny, device), device, settings)
    output.data["copy_bytes_per_s"] = bandwidth = copy_bandwidth(device)
    output.data["models"] = {}  # the bytes a decode step reads, per model
    results = output.data["results"] = []

    def save(entry: dict) -> None:
        results.append(entry)
        output.save()
        print({k: v for k, v in entry.items() if k not in ("engine_stats", "lengths")}, flush=True)

    failures = 0
    for (name, lora), model_shapes in model_runs(shapes, args).items():
        model = build_model(name, lora, device, dtype)
        label = f"{name}+lora-r16" if lora else name
        output.data["models"][label] = sizes = {
            "weight_bytes": decode_weight_bytes(model, dtype.itemsize),
            "kv_bytes_per_token": kv_bytes_per_token(model.config, dtype.itemsize),
        }
        setup = {"device": device, "dtype": dtype, "copy_bytes_per_s": bandwidth, **sizes}
        for engine in args.engines:
            runs = [shape for shape in model_shapes if engine in shape.engines]
            failures += run_engine(engine, model, runs, setup, args, record={"model": label}, save=save)
        del model
        release_memory()
    finish(table(results), output.path, failures, "measurement(s)")


if __name__ == "__main__":
    main()
