"""The train/rollout logprob gap, source by source, and what recomputing the old policy costs.

    python3 -m benchmarks.rollout.check_logprob_gap         # CUDA: Qwen2.5 0.5B, 1.5B, 7B layers + LoRA r=16, bf16
    python3 -m benchmarks.rollout.check_logprob_gap --tiny  # CPU smoke run on the tiny model (float32: gaps near 0)

Per model (random init; `NAME:loraR` wraps it in a LoRA adapter of rank R on every linear layer, with B drawn so the
adapter changes the weights as a trained one does) the paged rollout engine samples `--rows` rows (groups of 8
identical prompts of `--prompt-tokens` random ids) of up to `--new-tokens` tokens at temperature 1, once per engine
variant (nothing pinned: `min_new_tokens` would make the engine report the EOS-blocked distribution's logprobs, a
gap of log(1 - p_EOS) per token that is no rounding). Each variant's sampled tokens are then scored by
teacher-forced forwards as TRL's training forward computes them (its fused LM head, `add_fused_lm_head`,
micro-batches of `--micro-batch` rows), once per training variant. For every (engine variant, training variant): the gap |train - engine| of the sampled tokens' logprobs
(mean, 99th percentile, max), the k3 estimate of KL(π_engine ‖ π_train) per token, and the shares of tokens whose first-update ratio
exp(train - engine) leaves DAPO's clip range [0.8, 1.28] (clipped by numerics when the advantage has the sign that
clips), exceeds a TIS cap of 2 (verl's default), or leaves IcePop's band [0.5, 5]; and the largest deviation of a
sequence's geometric-mean ratio from 1.

Engine variants: `bf16_logits` (the default), `fp32_logits` (the head's bf16 products kept in float32, which the
engine does when `cast_lm_head_to_fp32=True`), `fp8_kv` (`rollout_kv_cache_dtype="fp8"`: an e4m3 KV cache; CPU too),
`fp8_kv_weights` (GPUs with FP8: the cache and `rollout_weights_dtype="fp8"`), `reference_attention` (CUDA: decode attention by the engine's PyTorch
gather-and-softmax reference instead of its Triton kernel, on the same paged cache, decoded without CUDA graphs, in
which the reference's page count would stay at its capture value) and, with LoRA,
`lora_merged_twice` (the adapter merged as the snapshot did before: the delta rounded to bf16, then added in bf16).
Training variants: `bf16_head` (TRL's default), `fp32_head` (`cast_lm_head_to_fp32=True`), `fp32_head_tf32` (CUDA:
the same with TF32 matrix products, exact for bf16-valued inputs and faster), `eager_attention` (transformers' eager
attention instead of SDPA), and last `fp32_model` (the whole model in float32: the reference both sides are compared
with, on the `bf16_logits` and `fp32_logits` samples).

Costs: each training variant's scoring time over all rows (the recompute pass of `old_logprobs="recompute"` in that
variant), against the engine's generation time for the same rows; `bench_step.py`'s `recompute_old_logprobs`
variant measures the pass inside the trainer step. With LoRA, the merge's mean error against the exact float64 merge,
rounded once and rounded twice.

Writes `benchmarks/results/check_logprob_gap_<device>.json` (or `--output`) after every measurement; prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import traceback
from typing import NamedTuple

import torch
from trl.trainer.utils import add_fused_lm_head

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.timing import timed_call
from benchmarks.core.workload import EOS_TOKEN_ID, PAD_TOKEN_ID, config_path, random_model, token_prompts, with_lora
from trl_dapo.rollout import PagedRolloutEngine, TokenSampling
from trl_dapo.rollout.fp8 import fp8_supported

DEFAULT_MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b:lora16"]
TINY_MODELS = ["tiny", "tiny:lora4"]
LORA_B_STD = 0.02  # with PEFT's A init, a delta of about 8% of the base weights' spread at the 7B shape
CLIP_RANGE, TIS_CAP, ICEPOP_BAND = (0.8, 1.28), 2.0, (0.5, 5.0)
REFERENCE = "fp32_model"
PRECISION_VARIANTS = ("bf16_logits", "fp8_kv", "fp8_kv_weights")  # bf16, FP8 KV cache, FP8 KV cache and weights


def parse_model(text: str) -> tuple[str, int]:
    name, _, lora = text.partition(":lora")
    return name, int(lora or 0)


def gap_stats(train: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How the training forward's logprobs of the sampled tokens differ from the engine's, (rows, tokens) each, over
    the sampled tokens (`mask`)."""
    log_ratio = torch.where(mask, train.double() - engine.double(), 0.0)
    ratio = log_ratio.exp()
    tokens = mask.sum()

    def share(flags: torch.Tensor) -> torch.Tensor:
        return (flags & mask).sum() / tokens

    lengths = mask.sum(dim=1)
    sequences = lengths > 0
    geometric = (log_ratio.sum(dim=1)[sequences] / lengths[sequences]).exp()
    stats = {
        "tokens": tokens,
        "gap_mean": log_ratio.abs().sum() / tokens,
        "gap_p99": torch.quantile(log_ratio.abs()[mask], 0.99),
        "gap_max": log_ratio.abs().max(),
        "kl_k3": (ratio - 1 - log_ratio).sum() / tokens,
        "outside_clip_share": share((ratio < CLIP_RANGE[0]) | (ratio > CLIP_RANGE[1])),
        "above_tis_cap_share": share(ratio > TIS_CAP),
        "outside_icepop_share": share((ratio < ICEPOP_BAND[0]) | (ratio > ICEPOP_BAND[1])),
        "sequence_ratio_max_deviation": (geometric - 1).abs().max(),
    }
    return {name: float(value) for name, value in stats.items()}


@contextlib.contextmanager
def training_forward(model, variant: str):
    """The model's forward as TRL's training step runs it, in `variant`: its fused LM head (float32 with the `fp32_*`
    variants, as `cast_lm_head_to_fp32=True` makes it), TF32 products, eager attention or the float32 model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    attention = base.config._attn_implementation
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if variant == REFERENCE:
        model.float()
    if variant == "eager_attention":
        base.set_attn_implementation("eager")
    torch.backends.cuda.matmul.allow_tf32 = variant == "fp32_head_tf32"
    add_fused_lm_head(base, cast_lm_head_to_fp32=variant.startswith("fp32_head"))
    try:
        yield
    finally:
        del base.forward  # the patched forward is an instance attribute over the class's own
        base.set_attn_implementation(attention)
        torch.backends.cuda.matmul.allow_tf32 = tf32


@torch.no_grad()
def score(model, prompts: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor, micro_batch: int):
    """Teacher-forced logprobs of the right-padded `completions` (`mask`: their tokens) after `prompts` (all of one
    length), as TRL's `_get_per_token_logps_and_entropies` computes them."""
    ids = torch.cat([prompts, completions], dim=1)
    attention = torch.cat([torch.ones_like(prompts), mask.long()], dim=1)
    width, out = completions.size(1), []
    for start in range(0, ids.size(0), micro_batch):
        rows, rows_attention = ids[start : start + micro_batch], attention[start : start + micro_batch]
        labels = rows.masked_fill(rows_attention == 0, -100)
        labels[:, :-width] = -100
        output = model(input_ids=rows, attention_mask=rows_attention, labels=labels, fused_lm_head=True)
        out.append(output.log_probs[:, -width:].float())
    return torch.cat(out)


def lora_layers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer") and m.active_adapters]


@contextlib.contextmanager
def merged_twice(model):
    """The base layers hold the adapter merged as the snapshot merged it before (delta rounded to the base's dtype,
    then added in it) and are marked merged, so a snapshot taken meanwhile reads exactly that."""
    swapped = []
    for module in lora_layers(model):
        weight = module.base_layer.weight
        merged = weight.data
        for adapter in module.active_adapters:
            merged = merged + module.get_delta_weight(adapter).to(weight.dtype)
        swapped.append((module, weight.data))
        weight.data, module.merged_adapters = merged, list(module.active_adapters)
    try:
        yield
    finally:
        for module, original in swapped:
            module.base_layer.weight.data, module.merged_adapters = original, []


def merge_errors(model, dtype: torch.dtype) -> dict[str, float]:
    """Mean |merged - exact| over the adapted weights, merged in float32 and rounded once to `dtype` vs rounded twice,
    and the share of weights where the two differ."""
    once = twice = differing = count = 0.0
    for module in lora_layers(model):
        weight = module.base_layer.weight.detach()
        delta = sum(module.get_delta_weight(adapter).detach() for adapter in module.active_adapters)
        exact = weight.double() + delta.double()
        single, double = (weight.float() + delta.float()).to(dtype), weight + delta.to(weight.dtype)
        once += float((single.double() - exact).abs().sum())
        twice += float((double.to(dtype).double() - exact).abs().sum())
        differing += float((single != double.to(dtype)).sum())
        count += exact.numel()
    return {
        "rounded_once_error": once / count,
        "rounded_twice_error": twice / count,
        "differing_share": differing / count,
    }


class Samples(NamedTuple):
    completions: torch.Tensor  # (rows, new tokens), right-padded
    mask: torch.Tensor  # the sampled tokens
    logprobs: torch.Tensor  # the engine's, 0 past each completion


def engine_samples(engine, prompts: list[list[int]], variants: dict, args, device: str, save, out: dict) -> dict:
    """Each engine variant's sampled tokens and their logprobs (`variants`: name -> (settings, a context to sample
    in)); the first variant is sampled twice, the first call compiling and capturing. A variant that fails is
    recorded and skipped."""
    samples = {}
    for index, (name, (variant_settings, context)) in enumerate(variants.items()):
        try:
            with context():
                if index == 0:
                    _, warmup = timed_call(engine.generate, prompts, variant_settings)
                    out.setdefault("warmup_call_s", {})[name] = warmup
                (completions, logprobs, _), seconds = timed_call(engine.generate, prompts, variant_settings)
        except Exception as error:  # recorded; the other variants still run
            traceback.print_exc()
            out.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"[:300]
            save()
            continue
        out.setdefault("generation_s", {})[name] = seconds
        out.setdefault("sampled_tokens", {})[name] = sum(map(len, completions))
        lengths = torch.tensor([len(c) for c in completions], device=device)
        mask = torch.arange(args.new_tokens, device=device) < lengths.unsqueeze(1)
        ids = torch.full((len(completions), args.new_tokens), PAD_TOKEN_ID, device=device)
        ids[mask] = torch.tensor([token for c in completions for token in c], device=device)
        samples[name] = Samples(ids, mask, logprobs[:, : args.new_tokens].float())
        save()
    return samples


def fp8_samples(model, prompts, settings: TokenSampling, common: dict, args, device: str, save, out: dict) -> dict:
    """The FP8 engine variants' samples: `fp8_kv` wherever the engine reads an FP8 cache (the CPU's reference
    attention, CUDA with FP8), `fp8_kv_weights` where the device has FP8 tensor cores; one engine each."""
    fp8 = fp8_supported(torch.device(device))
    variants = [("fp8_kv", "fp8", "bf16")] if device == "cpu" or fp8 else []
    variants += [("fp8_kv_weights", "fp8", "fp8")] if fp8 else []
    samples = {}
    for name, kv_cache, weights in variants:
        engine = PagedRolloutEngine(
            model, cuda_graph=device == "cuda", kv_cache_dtype=kv_cache, weights_dtype=weights, **common
        )
        variant = {name: (settings, contextlib.nullcontext)}
        samples.update(engine_samples(engine, prompts, variant, args, device, save, out))
        del engine
        release_memory()
    return samples


@contextlib.contextmanager
def snapshot_merged_twice(engine, model):
    """The engine's snapshot with the adapter merged as it was before, then taken again from the model."""
    try:
        with merged_twice(model):
            engine.sync_weights(model)
            yield
    finally:
        engine.sync_weights(model)


def measure(spec: str, args, device: str, dtype: torch.dtype, out: dict, save) -> None:
    name, lora_rank = parse_model(spec)
    model = random_model(config_path(name), device, dtype).eval()
    if lora_rank:
        model = with_lora(model, lora_rank, b_std=LORA_B_STD)
        out["lora_merge"] = merge_errors(model, dtype)
    out["params"] = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    prompts = token_prompts(args.rows, args.prompt_tokens, vocab, group=8)
    common = dict(eos_token_ids=[EOS_TOKEN_ID], pad_token_id=PAD_TOKEN_ID, dtype=dtype)
    settings = TokenSampling(args.new_tokens, temperature=1.0)
    engine = PagedRolloutEngine(model, cuda_graph=device == "cuda", **common)
    variants = {
        "bf16_logits": (settings, contextlib.nullcontext),
        "fp32_logits": (dataclasses.replace(settings, fp32_logits=True), contextlib.nullcontext),
    }
    if lora_rank:
        variants["lora_merged_twice"] = (settings, functools.partial(snapshot_merged_twice, engine, model))
    samples = engine_samples(engine, prompts, variants, args, device, save, out)
    del engine
    release_memory()
    samples.update(fp8_samples(model, prompts, settings, common, args, device, save, out))
    if device == "cuda":
        # The PyTorch reference reads the pages of the longest row at the last synchronisation: a CUDA graph would
        # freeze that at capture, so this engine decodes eagerly, with the same compiled layers.
        engine = PagedRolloutEngine(
            model, cuda_graph=False, compile_decode=True, attention_kernel="reference", **common
        )
        reference = {"reference_attention": (settings, contextlib.nullcontext)}
        samples.update(engine_samples(engine, prompts, reference, args, device, save, out))
        del engine
        release_memory()
    prompt_ids = torch.tensor(prompts, device=device)
    training = ["bf16_head", "fp32_head", *(["fp32_head_tf32"] if device == "cuda" else []), "eager_attention"]
    scores: dict[str, dict[str, torch.Tensor]] = {variant: {} for variant in samples}
    gaps, timings = out.setdefault("gaps", {}), out.setdefault("score_s", {})
    for variant in [*training, REFERENCE]:
        sampled = [s for s in samples if variant != REFERENCE or s in ("bf16_logits", "fp32_logits")]
        try:
            with training_forward(model, variant):
                for engine_variant in sampled:
                    sample = samples[engine_variant]
                    logprobs = score(model, prompt_ids, sample.completions, sample.mask, args.micro_batch)
                    if engine_variant == "bf16_logits" and variant != REFERENCE:  # the first call warmed kernels up
                        timings[variant] = timed_call(
                            score, model, prompt_ids, sample.completions, sample.mask, args.micro_batch
                        )[1]
                    scores[engine_variant][variant] = logprobs
                    gaps.setdefault(engine_variant, {})[variant] = gap_stats(logprobs, sample.logprobs, sample.mask)
                    save()
        except Exception as error:  # recorded; the other variants still run
            traceback.print_exc()
            out.setdefault("errors", {})[variant] = f"{type(error).__name__}: {error}"[:300]
            save()
    reference = out["reference_gaps"] = {}  # each side against the float32 model, on the same samples
    for engine_variant, scored in scores.items():
        if REFERENCE in scored:
            sample = samples[engine_variant]
            others = {"engine": sample.logprobs, **{k: v for k, v in scored.items() if k != REFERENCE}}
            reference[engine_variant] = {k: gap_stats(v, scored[REFERENCE], sample.mask) for k, v in others.items()}
    generation = out.get("generation_s", {}).get("bf16_logits")
    if generation and "bf16_head" in timings:
        out["recompute_over_generation"] = timings["bf16_head"] / generation
    out["before_after"] = before_after(gaps)
    save()
    del model, samples, scores
    release_memory()


def before_after(gaps: dict) -> dict:
    """The gap as the engine and TRL's default head computed it (with LoRA: merged twice, as the snapshot did), and
    with the source-side fixes (float32 logits on both sides, LoRA merged once)."""
    before = gaps.get("lora_merged_twice", gaps.get("bf16_logits", {})).get("bf16_head")
    after = gaps.get("fp32_logits", {}).get("fp32_head")
    if before is None or after is None:
        return {}
    return {key: [before[key], after[key]] for key in ("gap_mean", "gap_max", "kl_k3", "outside_clip_share")}


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(models: dict) -> str:
    lines = [
        "| model | engine | training forward | gap mean | gap p99 | gap max | k3 KL | outside [0.8, 1.28] | > 2 | "
        "outside [0.5, 5] | sequence ratio max dev |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, out in models.items():
        for engine_variant, by_training in out.get("gaps", {}).items():
            for variant, r in by_training.items():
                lines.append(
                    f"| {spec} | {engine_variant} | {variant} | {r['gap_mean']:.3g} | {r['gap_p99']:.3g} | "
                    f"{r['gap_max']:.3g} | "
                    f"{r['kl_k3']:.2e} | {r['outside_clip_share']:.2%} | {r['above_tis_cap_share']:.2%} | "
                    f"{r['outside_icepop_share']:.2%} | {r['sequence_ratio_max_deviation']:.3f} |"
                )
    for spec, out in models.items():
        for engine_variant, by_side in out.get("reference_gaps", {}).items():
            sides = ", ".join(f"{k} {r['gap_mean']:.3g} / {r['gap_max']:.3g}" for k, r in by_side.items())
            lines.append(f"- {spec} {engine_variant} samples, gap mean / max against the float32 model: {sides}")
        generation = out.get("generation_s", {}).get("bf16_logits")
        if generation:
            passes = ", ".join(f"{k} {v:.3f} s" for k, v in out.get("score_s", {}).items())
            lines.append(f"- {spec}: generation {generation:.3f} s; scoring pass {passes}")
        precision = {
            k: out["gaps"][k]["bf16_head"] for k in PRECISION_VARIANTS if "bf16_head" in out.get("gaps", {}).get(k, {})
        }
        if len(precision) > 1:
            gaps = ", ".join(
                f"{k} {r['gap_mean']:.3g} / {r['gap_p99']:.3g} / {r['gap_max']:.3g}" for k, r in precision.items()
            )
            lines.append(f"- {spec} rollout precision, gap mean / p99 / max against bf16_head: {gaps}")
        if out.get("before_after"):
            change = ", ".join(f"{k} {a:.3g} -> {b:.3g}" for k, (a, b) in out["before_after"].items())
            lines.append(f"- {spec} before -> after the source-side fixes: {change}")
        if "lora_merge" in out:
            m = out["lora_merge"]
            lines.append(
                f"- {spec}: LoRA merge mean error {m['rounded_twice_error']:.3e} rounded twice, "
                f"{m['rounded_once_error']:.3e} once; {m['differing_share']:.2%} of the weights differ"
            )
        for engine_variant, error in out.get("errors", {}).items():
            lines.append(f"- {spec} {engine_variant}: {error}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument("--models", nargs="*", default=None, help="NAME or NAME:loraR (configs in benchmarks/configs)")
    parser.add_argument(
        "--rows", type=int, default=None, help="sampled rows per engine variant (default 128; tiny 16)"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default 256; tiny 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default 64; tiny 6)")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per teacher-forced forward")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    args.models = args.models or (TINY_MODELS if args.tiny else DEFAULT_MODELS)
    args.rows = args.rows or (16 if args.tiny else 128)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 256)
    args.prompt_tokens = args.prompt_tokens or (6 if args.tiny else 64)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":  # one engine per model, each compiling its sampling head per setting: past the default 8
        # recompilations of the same code, later ones would run eagerly
        torch._dynamo.config.recompile_limit = 64
    output = ResultFile(args.output or default_output("check_logprob_gap", args.tiny, device), device, vars(args))
    models = output.data["models"] = {}
    failures = 0
    for spec in args.models:
        out = models[spec] = {}
        try:
            measure(spec, args, device, dtype, out, output.save)
        except Exception as error:  # recorded; the next model still runs
            traceback.print_exc()
            out["error"], failures = f"{type(error).__name__}: {error}"[:300], failures + 1
            output.save()
            release_memory()
        print(table({spec: out}), flush=True)
    finish(table(models), output.path, failures, "model(s)")


if __name__ == "__main__":
    main()
