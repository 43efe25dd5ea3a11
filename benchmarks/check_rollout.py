"""Static rollout engine against transformers on one device: greedy agreement, sampled-logprob agreement, speed.

    python benchmarks/check_rollout.py --model qwen2.5-0.5b      # CUDA: bf16 weights, CUDA-graph decode

Greedy decoding is compared token by token with `model.generate` (bf16 kernels differ, so long greedy runs can part
ways at near-ties: the share of agreeing tokens before the first difference is reported). Sampled logprobs are
compared with a teacher-forced forward pass of the same bf16 model. Writes `benchmarks/results/check_rollout.json`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_step import HERE, random_model

from trl_dapo.rollout import SamplingSettings, StaticRolloutEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(HERE / "configs" / f"{args.model}.json", device, dtype).eval()
    engine = StaticRolloutEngine(model, eos_token_ids=[2], pad_token_id=0, dtype=dtype, cuda_graph=device == "cuda")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 5000, (int(n),), generator=generator).tolist()
        for n in torch.randint(20, 40, (args.batch,), generator=generator)
    ]

    # greedy agreement on 8 prompts
    greedy = SamplingSettings(args.new_tokens, greedy=True, min_new_tokens=args.new_tokens)
    ours, _ = engine.generate(prompts[:8], greedy)
    agree = []
    for prompt, completion in zip(prompts[:8], ours, strict=True):
        reference = model.generate(
            torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, eos_token_id=2, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        first_difference = next(
            (i for i, (a, b) in enumerate(zip(completion, reference, strict=True)) if a != b), len(reference)
        )
        agree.append(first_difference / len(reference))

    # sampled logprobs against a teacher-forced forward pass
    sampling = SamplingSettings(args.new_tokens, temperature=1.0, min_new_tokens=args.new_tokens)
    completions, logprobs = engine.generate(prompts[:16], sampling)
    gaps = []
    with torch.no_grad():
        for prompt, completion, logps in zip(prompts[:16], completions, logprobs, strict=True):
            ids = torch.tensor([prompt + completion], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion, device=device)[:, None])[:, 0]
            gaps.append((torch.tensor(logps, device=device) - reference).abs())
    gaps = torch.cat(gaps)

    # speed: full batch, fixed length
    for _ in range(2):
        engine.generate(prompts, sampling)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "greedy_agreement_before_first_difference": agree,
        "logprob_abs_gap_mean": gaps.mean().item(),
        "logprob_abs_gap_max": gaps.max().item(),
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "seconds": seconds,
        "tokens_per_s": args.batch * args.new_tokens / seconds,
    }
    output = HERE / "results" / "check_rollout.json"
    output.parent.mkdir(exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
