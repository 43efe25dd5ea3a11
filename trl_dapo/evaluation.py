"""Held-out evaluation: avg@k (mean accuracy over k samples per problem) and pass@k, as the paper reports them.

One loop generates and scores (`sample_and_score`); what a task checks is a function of a completion and its
problem's row, so the math recipe and the ablation study share it. Two entry points call it:

- `MathAccuracyCallback`: in training, every few optimizer steps, on this rank's share of the problems (the math
  recipe);
- `evaluate`: greedy and sampled accuracy per group of problems (the ablation's difficulty buckets) and the
  mechanism metrics on the same samples (policy entropy, mean and longest response, the share cut at the limit, and
  any share a task flags), reproducible under its own seed (the ablation study).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import GenerationConfig, TrainerCallback
from trl.models import unwrap_model_for_generation

from .rewards.math import CORRECT, score_answer

OVERALL = "all"
ENTROPY_ROWS = 512  # rows per teacher-forced forward: its activations stay a fraction of the generation's cache

Check = Callable[[str, Mapping[str, Any]], bool]  # (completion, its problem's row) -> whether it holds


@dataclass
class Scored:
    """Completions of held-out problems, checked; with `mechanisms`, also measured."""

    correct: list[list[bool]] = field(default_factory=list)  # per problem, per sample
    flagged: dict[str, int] = field(default_factory=dict)  # per flag, the completions it held for
    lengths: list[int] = field(default_factory=list)  # tokens up to and including the first end token
    truncated: int = 0  # completions without an end token
    entropy_sum: float = 0.0
    tokens: int = 0


def _first_eos_mask(completion: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including the first end token of each row (everything when there is none)."""
    is_eos = completion == eos_token_id
    after = is_eos.int().cumsum(dim=1) - is_eos.int()  # end tokens strictly before each position
    return (after == 0).int()


def _measure(model, tokenizer, inputs, output: torch.Tensor, samples: int, scored: Scored) -> None:
    """Lengths, truncation and the policy's token entropy on its own completions (a teacher-forced forward in chunks
    of `ENTROPY_ROWS`)."""
    width = inputs["input_ids"].size(1)
    completion = output[:, width:]
    mask = _first_eos_mask(completion, tokenizer.eos_token_id)
    attention = torch.cat([inputs["attention_mask"].repeat_interleave(samples, dim=0), mask], dim=1)
    for row in range(0, output.size(0), ENTROPY_ROWS):
        rows = slice(row, row + ENTROPY_ROWS)
        logits = model(input_ids=output[rows], attention_mask=attention[rows]).logits[:, width - 1 : -1].float()
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        scored.entropy_sum += float((entropy * mask[rows]).sum())
    lengths = mask.sum(dim=1)
    scored.tokens += int(lengths.sum())
    scored.lengths += lengths.tolist()
    scored.truncated += int((~(completion == tokenizer.eos_token_id).any(dim=1)).sum())


@torch.no_grad()
def sample_and_score(
    model,
    tokenizer,
    prompts: list[str],
    problems: Sequence[Mapping[str, Any]],
    correct: Check,
    problems_per_call: int,
    device: torch.device,
    flags: Mapping[str, Check] | None = None,
    mechanisms: bool = False,
    **generate_kwargs: Any,
) -> Scored:
    """The completions of each prompt by `model.generate(**generate_kwargs)` (as many per prompt as its settings
    return), `problems_per_call` prompts (left-padded) per call, each checked by `correct` and counted by every flag
    against its problem's row. The model runs in eval mode, its own mode set back after."""
    flags = flags or {}
    was_training = model.training
    model.eval()
    scored = Scored(flagged=dict.fromkeys(flags, 0))
    for start in range(0, len(prompts), problems_per_call):
        inputs = tokenizer(
            prompts[start : start + problems_per_call],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        ).to(device)
        output = model.generate(**inputs, **generate_kwargs)
        samples = output.size(0) // inputs["input_ids"].size(0)
        if mechanisms:
            _measure(model, tokenizer, inputs, output, samples, scored)
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].size(1) :], skip_special_tokens=True)
        for index, problem in enumerate(problems[start : start + problems_per_call]):
            own = texts[index * samples : (index + 1) * samples]
            scored.correct.append([correct(text, problem) for text in own])
            for name, flag in flags.items():
                scored.flagged[name] += sum(flag(text, problem) for text in own)
    model.train(was_training)
    return scored


@dataclass(frozen=True)
class EvalSettings:
    k: int  # samples per problem for avg@k and pass@k; 0: greedy only
    temperature: float
    top_p: float
    max_new_tokens: int
    max_rows: int  # rows of one generate call
    seed: int
    bf16: bool


def _by_group(values: list[float], groups: list[str]) -> dict[str, float]:
    """Mean per group and over all (`OVERALL`)."""
    means: dict[str, list[float]] = defaultdict(list)
    for value, group in zip(values, groups, strict=True):
        means[group].append(value)
        means[OVERALL].append(value)
    return {name: sum(v) / len(v) for name, v in sorted(means.items())}


def evaluate(
    model,
    tokenizer,
    dataset,
    settings: EvalSettings,
    correct: Check,
    group: str,
    flags: Mapping[str, Check] | None = None,
) -> dict[str, Any]:
    """Greedy accuracy per value of the `group` column; with `k > 0` also avg@k, pass@k, and on the sampled
    completions the policy's mean token entropy, their mean and longest length, the share cut at `max_new_tokens`
    and the share each flag holds for. The dataset's `prompt` column is plain text.

    Runs under `torch.random.fork_rng` with its own seed: its samples are reproducible and it leaves the training RNG
    untouched, so how often a run is evaluated does not change what it trains on. With `bf16` it runs under bf16
    autocast, as the trainers' models do once accelerate has wrapped them, so a model before training and the trained
    ones are evaluated at the same precision."""
    device = next(model.parameters()).device
    common = dict(
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    prompts, problems, groups = list(dataset["prompt"]), list(dataset), list(dataset[group])

    def run(samples: int, generation: GenerationConfig, mechanisms: bool) -> Scored:
        per_call = max(1, settings.max_rows // samples)
        return sample_and_score(
            model,
            tokenizer,
            prompts,
            problems,
            correct,
            per_call,
            device,
            flags=flags,
            mechanisms=mechanisms,
            generation_config=generation,
        )

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), autocast:
        torch.manual_seed(settings.seed)
        greedy = run(1, GenerationConfig(do_sample=False, **common), mechanisms=False)
        metrics: dict[str, Any] = {"greedy": _by_group([float(c[0]) for c in greedy.correct], groups)}
        if settings.k:
            sampling = GenerationConfig(
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=0,
                num_return_sequences=settings.k,
                **common,
            )
            sampled = run(settings.k, sampling, mechanisms=True)
            completions = len(sampled.lengths)
            metrics[f"avg@{settings.k}"] = _by_group([sum(c) / len(c) for c in sampled.correct], groups)
            metrics[f"pass@{settings.k}"] = _by_group([float(any(c)) for c in sampled.correct], groups)
            metrics["entropy"] = sampled.entropy_sum / max(sampled.tokens, 1)
            metrics["mean_length"] = sum(sampled.lengths) / completions
            metrics["max_length"] = max(sampled.lengths)
            metrics["truncated"] = sampled.truncated / completions
            metrics.update({name: count / completions for name, count in sampled.flagged.items()})
    return metrics


def _math_correct(completion: str, problem: Mapping[str, Any]) -> bool:
    return score_answer(completion, problem["answer"])[0] == CORRECT


class MathAccuracyCallback(TrainerCallback):
    """Every `every` optimizer steps and at the end of training (unless the last step was just evaluated), sample
    `k` completions per held-out problem.

    Results join the next training log of `trainer` (a `DAPOTrainer`: `add_metrics`) as `eval/accuracy` (avg@k) and
    `eval/pass@k`. Each rank scores a share of the problems; the counts are gathered. With `at_train_end=False` the
    final evaluation waits for `evaluate_final`, so a script can save the trained model first: an error in the
    evaluation then costs no weights.
    """

    def __init__(
        self,
        trainer,
        dataset,
        k: int = 32,
        every: int = 0,
        temperature: float = 1.0,
        top_p: float = 0.7,
        batch_size: int = 8,
        at_train_end: bool = True,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError(
                "MathAccuracyCallback: the held-out dataset is empty, so avg@k and pass@k would be computed over 0 "
                "problems; pass held-out problems, or leave the callback out."
            )
        self.trainer, self.dataset, self.k, self.every = trainer, dataset, k, every
        self.temperature, self.top_p, self.batch_size = temperature, top_p, batch_size
        self.at_train_end = at_train_end
        self.evaluated_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs: Any):
        if self.every and state.global_step % self.every == 0:
            self.evaluate()
            self.evaluated_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs: Any):
        if self.at_train_end:
            self.evaluate_final()

    def evaluate_final(self) -> None:
        """The trained model's evaluation, unless its last step was just evaluated, and the numbers not yet logged
        into the log history (no later training log comes)."""
        if self.evaluated_step != self.trainer.state.global_step:  # a second pass would log the same step twice
            self.evaluate()
        self.trainer.flush_metrics()

    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        tokenizer = trainer.processing_class
        accelerator = trainer.accelerator
        rows = [
            self.dataset[i] for i in range(accelerator.process_index, len(self.dataset), accelerator.num_processes)
        ]
        prompts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
        ]
        with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
            scored = sample_and_score(
                model,
                tokenizer,
                prompts,
                rows,
                _math_correct,
                self.batch_size,
                accelerator.device,
                do_sample=True,
                temperature=self.temperature,
                top_p=self.top_p,
                max_new_tokens=trainer.args.max_completion_length,
                num_return_sequences=self.k,
                pad_token_id=tokenizer.pad_token_id,
            )
        counts = [c for share in gather_object([[sum(c) for c in scored.correct]]) for c in share]
        metrics = {
            "eval/accuracy": sum(counts) / max(len(counts) * self.k, 1),
            f"eval/pass@{self.k}": sum(c > 0 for c in counts) / max(len(counts), 1),
        }
        trainer.add_metrics(metrics)
        return metrics
