"""Held-out accuracy per difficulty bucket (greedy and avg@k sampled), the mechanism metrics on the same samples
(policy entropy, mean and longest response, the share cut at the limit, the share that rechecks), and the callback
that records them against optimizer steps and training wall-clock.

Evaluation runs under `torch.random.fork_rng` with its own seed: its samples are reproducible and it leaves the
training RNG untouched, so how often a run is evaluated does not change what it trains on. With `bf16` it runs under
bf16 autocast, as the trainers' models do once accelerate has wrapped them, so the warm-started model (step 0) and
the trained ones are evaluated at the same precision.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, TrainerCallback

from trl_dapo.data.addition import excess_columns, verify

OVERALL = "all"
ENTROPY_ROWS = 512  # rows per teacher-forced forward: its activations stay a fraction of the generation's cache


@dataclass(frozen=True)
class EvalSettings:
    k: int  # samples per problem for avg@k and pass@k; 0: greedy only
    temperature: float
    top_p: float
    max_new_tokens: int
    max_rows: int  # rows of one generate call
    seed: int
    bf16: bool


@dataclass
class _Generated:
    correct: list[list[bool]]  # per problem, per sample
    lengths: list[int]
    truncated: int
    rechecked: int  # completions with more column lines than their problem has columns
    entropy_sum: float
    tokens: int


def _first_eos_mask(completion: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including the first end token of each row (everything when there is none)."""
    is_eos = completion == eos_token_id
    after = is_eos.int().cumsum(dim=1) - is_eos.int()  # end tokens strictly before each position
    return (after == 0).int()


@torch.no_grad()
def _generate(model, tokenizer, dataset, samples: int, generation: GenerationConfig, settings: EvalSettings):
    device = next(model.parameters()).device
    prompts, answers, digits = list(dataset["prompt"]), list(dataset["answer"]), list(dataset["digits"])
    per_call = max(1, settings.max_rows // samples)
    result = _Generated([], [], 0, 0, 0.0, 0)
    for start in range(0, len(prompts), per_call):
        inputs = tokenizer(
            prompts[start : start + per_call],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        ).to(device)
        output = model.generate(**inputs, generation_config=generation)
        width = inputs["input_ids"].size(1)
        completion = output[:, width:]
        mask = _first_eos_mask(completion, tokenizer.eos_token_id)
        attention = torch.cat([inputs["attention_mask"].repeat_interleave(samples, dim=0), mask], dim=1)
        for row in range(0, output.size(0), ENTROPY_ROWS):
            rows = slice(row, row + ENTROPY_ROWS)
            logits = model(input_ids=output[rows], attention_mask=attention[rows]).logits[:, width - 1 : -1].float()
            entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
            result.entropy_sum += float((entropy * mask[rows]).sum())
        lengths = mask.sum(dim=1)
        result.tokens += int(lengths.sum())
        result.lengths += lengths.tolist()
        result.truncated += int((~(completion == tokenizer.eos_token_id).any(dim=1)).sum())
        texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
        for index, (answer, columns) in enumerate(
            zip(answers[start : start + per_call], digits[start : start + per_call], strict=True)
        ):
            own = texts[index * samples : (index + 1) * samples]
            result.correct.append([verify(text, answer) for text in own])
            result.rechecked += sum(excess_columns(text, columns) > 0 for text in own)
    return result


def _by_bucket(values: list[float], buckets: list[str]) -> dict[str, float]:
    groups: dict[str, list[float]] = defaultdict(list)
    for value, bucket in zip(values, buckets, strict=True):
        groups[bucket].append(value)
        groups[OVERALL].append(value)
    return {name: sum(v) / len(v) for name, v in sorted(groups.items())}


def evaluate(model, tokenizer, dataset, settings: EvalSettings) -> dict[str, Any]:
    """Greedy accuracy per bucket; with `k > 0` also avg@k, pass@k, and on the sampled completions the policy's mean
    token entropy, their mean and longest length, the share cut at `max_new_tokens` and the share that rechecks."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    common = dict(
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    buckets = list(dataset["bucket"])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
        torch.manual_seed(settings.seed)
        greedy = _generate(model, tokenizer, dataset, 1, GenerationConfig(do_sample=False, **common), settings)
        metrics: dict[str, Any] = {"greedy": _by_bucket([float(c[0]) for c in greedy.correct], buckets)}
        if settings.k:
            sampling = GenerationConfig(
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=0,
                num_return_sequences=settings.k,
                **common,
            )
            sampled = _generate(model, tokenizer, dataset, settings.k, sampling, settings)
            metrics[f"avg@{settings.k}"] = _by_bucket([sum(c) / len(c) for c in sampled.correct], buckets)
            metrics[f"pass@{settings.k}"] = _by_bucket([float(any(c)) for c in sampled.correct], buckets)
            metrics["entropy"] = sampled.entropy_sum / max(sampled.tokens, 1)
            metrics["mean_length"] = sum(sampled.lengths) / len(sampled.lengths)
            metrics["max_length"] = max(sampled.lengths)
            metrics["truncated"] = sampled.truncated / len(sampled.lengths)
            metrics["rechecked"] = sampled.rechecked / len(sampled.lengths)
    model.train(was_training)
    return metrics


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HeldOutCurve(TrainerCallback):
    """Evaluates at `eval_steps` and stamps every optimizer step with the training wall-clock: seconds since training
    began, evaluation time left out, so a variant's time axis is its training cost alone."""

    def __init__(self, tokenizer, dataset, settings: EvalSettings, eval_steps: list[int], generated) -> None:
        self.tokenizer, self.dataset, self.settings = tokenizer, dataset, settings
        self.eval_steps = set(eval_steps) - {0}
        self.generated = generated  # what the reward has counted (completions, tokens) so far
        self.points: list[dict[str, Any]] = []
        self.step_seconds: list[float] = []
        self._start = self._excluded = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._excluded = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        device = next(model.parameters()).device
        _synchronize(device)
        elapsed = time.perf_counter() - self._start - self._excluded
        self.step_seconds.append(elapsed)
        if state.global_step in self.eval_steps:
            began = time.perf_counter()
            metrics = evaluate(model, self.tokenizer, self.dataset, self.settings)
            _synchronize(device)
            self._excluded += time.perf_counter() - began
            self.points.append(
                {"step": state.global_step, "wall_clock_s": elapsed, **self.generated.totals(), **metrics}
            )
