"""Static rollout engine against transformers on one device: greedy agreement, sampled-logprob agreement, speed.

    python benchmarks/check_rollout.py --models qwen2.5-0.5b qwen2.5-1.5b     # CUDA: bf16 weights

Each model runs with the decode step as a CUDA graph of eager kernels and as a CUDA graph of the compiled decoder
layer (the default). Greedy decoding is compared token by token with `model.generate` (bf16 kernels differ, so long
greedy runs can part ways at near-ties: the share of agreeing tokens before the first difference is reported).
Sampled logprobs are compared with a teacher-forced forward pass of the same bf16 model. Prints a table last and
writes `benchmarks/results/check_rollout.json` (or `--output`) after every measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from timing import synchronize
from workload import HERE, config_path, random_model

from trl_dapo.rollout import SamplingSettings, StaticRolloutEngine


def greedy_agreement(model, engine, prompts, new_tokens: int, device: str) -> list[float]:
    """Share of `model.generate`'s greedy tokens the engine reproduces before the first difference, per prompt."""
    greedy = SamplingSettings(new_tokens, greedy=True, min_new_tokens=new_tokens)
    ours, _ = engine.generate(prompts, greedy)
    agree = []
    for prompt, completion in zip(prompts, ours, strict=True):
        reference = model.generate(
            torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, eos_token_id=2, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        pairs = zip(completion, reference, strict=True)
        agree.append(next((i for i, (a, b) in enumerate(pairs) if a != b), len(reference)) / len(reference))
    return agree


@torch.no_grad()
def logprob_gaps(model, engine, prompts, settings: SamplingSettings, device: str) -> torch.Tensor:
    """|engine logprob - teacher-forced logprob| of every sampled token."""
    completions, logprobs = engine.generate(prompts, settings)
    gaps = []
    for prompt, completion, logps in zip(prompts, completions, logprobs, strict=True):
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion, device=device)[:, None])[:, 0]
        gaps.append((logps[: len(completion)] - reference).abs())
    return torch.cat(gaps)


def measure(model, prompts, args, device: str, dtype, compile_decode: bool) -> dict:
    start = time.perf_counter()
    engine = StaticRolloutEngine(
        model, eos_token_ids=[2], pad_token_id=0, dtype=dtype, cuda_graph=device == "cuda",
        compile_decode=compile_decode,
    )  # fmt: skip
    sampling = SamplingSettings(args.new_tokens, temperature=1.0, min_new_tokens=args.new_tokens)
    engine.generate(prompts, sampling)  # compile, capture
    synchronize()
    first_call = time.perf_counter() - start
    times = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        engine.generate(prompts, sampling)
        synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[1]
    gaps = logprob_gaps(model, engine, prompts[:16], sampling, device)
    result = {
        "compile_decode": compile_decode,
        "first_call_s": first_call,
        "seconds": seconds,
        "tokens_per_s": len(prompts) * args.new_tokens / seconds,
        "decode_step_ms": seconds / args.new_tokens * 1e3,
        "logprob_abs_gap_mean": gaps.mean().item(),
        "logprob_abs_gap_max": gaps.max().item(),
    }
    if compile_decode and args.greedy_prompts:
        result["greedy_agreement_before_first_difference"] = greedy_agreement(
            model, engine, prompts[: args.greedy_prompts], args.new_tokens, device
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=["qwen2.5-0.5b"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--greedy-prompts", type=int, default=4)
    parser.add_argument("--output", default=str(HERE / "results" / "check_rollout.json"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 5000, (int(n),), generator=generator).tolist()
        for n in torch.randint(20, 40, (args.batch,), generator=generator)
    ]
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "models": {},
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        model = random_model(config_path(name), device, dtype).eval()
        for compile_decode in (False, True):
            variant = "graph+compiled layer" if compile_decode else "graph"
            result = measure(model, prompts, args, device, dtype, compile_decode)
            results["models"].setdefault(name, {})[variant] = result
            output.write_text(json.dumps(results, indent=2))
            print(name, variant, json.dumps(result), flush=True)
        del model
    print("| model | decode step | tokens/s | ms/step | first call s | logprob gap mean / max |")
    print("|---|---|---|---|---|---|")
    for name, variants in results["models"].items():
        for variant, r in variants.items():
            print(
                f"| {name} | {variant} | {r['tokens_per_s']:,.0f} | {r['decode_step_ms']:.2f} | "
                f"{r['first_call_s']:.1f} | {r['logprob_abs_gap_mean']:.4f} / {r['logprob_abs_gap_max']:.3f} |"
            )


if __name__ == "__main__":
    main()
