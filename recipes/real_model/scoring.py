"""avg@k and pass@k of a model on generated problems, sampled by the package's paged engine, and what the study reads
beside them on the same samples: one evaluation engine per process over its own bf16 (float32 on the CPU) snapshot of
the weights, refreshed before each call, so the base model, every grid cell and every run's checkpoints are scored by
the same sampler at the task's temperature. The samples are reproducible under a seed of their own and leave the
training random state untouched.

Beside accuracy, on the same samples (`cap_scores`): the share with an `Answer:` line and the accuracy among those
(`line_accuracy`: accuracy = answer-line share x line accuracy, so the answer-line lesson is measured apart), the mean
length, the share cut at the cap, and the policy's token entropy, estimated as the mean negative logprob of the
sampled tokens (unbiased at temperature 1 and top-p 1, where the engine samples the policy itself). A sample drawn up
to a larger cap and cut at a smaller one is a sample at the smaller cap (the model never sees the cap), so one
sampling at the grid's largest cap scores every cap.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from trl_dapo.rewards.math import CORRECT, extract_answer, score_answer
from trl_dapo.rollout.paged_engine import PagedRolloutEngine
from trl_dapo.rollout.token_sampling import TokenSampling


@dataclass
class Samples:
    """`k` completions per problem (token ids, each ending at its end token when it has one) and the logprob of each
    sampled token under the sampling distribution."""

    completions: list[list[int]]
    logprobs: list[list[float]]
    answers: list[str]  # the problem's answer, per completion
    k: int
    end_tokens: frozenset[int]


class EngineScorer:
    """Samples `k` completions per problem with the paged engine and scores them with the math reward."""

    def __init__(
        self,
        model,
        tokenizer,
        k: int,
        max_new_tokens: int,
        max_rows: int,
        memory_fraction: float,
        device: str,
        max_cache_tokens: int | None = None,
    ) -> None:
        cuda = device == "cuda"
        self.tokenizer, self.k, self.max_new_tokens = tokenizer, k, max_new_tokens
        self.engine = PagedRolloutEngine(
            model,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            dtype=torch.bfloat16 if cuda else torch.float32,
            cuda_graph=cuda,
            compile_decode=False,  # several processes compiling at once would cost more than the evaluations save
            memory_fraction=memory_fraction,
            max_rows=max_rows,
            max_cache_tokens=max_cache_tokens,
            device=torch.device(device),  # where the engine decodes, wherever the model is when it is built
        )

    def prompt_ids(self, dataset) -> list[list[int]]:
        texts = [
            self.tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=False)
            for row in dataset["prompt"]
        ]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]

    def sample(self, model, dataset, temperature: float, seed: int) -> Samples:
        """`k` completions of each problem of `dataset` (`prompt` conversations, `answer` strings) by `model`'s
        current weights, up to `max_new_tokens`."""
        self.engine.sync_weights(model)
        prompts = self.prompt_ids(dataset)
        device = self.engine.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            settings = TokenSampling(max_new_tokens=self.max_new_tokens, temperature=temperature)
            output = self.engine.generate([ids for ids in prompts for _ in range(self.k)], settings)
        logprobs = output.logprobs.float().cpu()
        return Samples(
            completions=output.completions,
            logprobs=[logprobs[row, : len(c)].tolist() for row, c in enumerate(output.completions)],
            answers=[answer for answer in dataset["answer"] for _ in range(self.k)],
            k=self.k,
            end_tokens=frozenset(self.engine.eos_token_ids),
        )

    def score(self, model, dataset, temperature: float, seed: int) -> dict:
        """`cap_scores` of fresh samples at this scorer's length limit."""
        return cap_scores(self.sample(model, dataset, temperature, seed), self.tokenizer, self.max_new_tokens)


def cap_scores(samples: Samples, tokenizer, cap: int) -> dict:
    """The samples cut at `cap` tokens, scored: `avg@k` and `pass@k` (as `{"all": value}`, the ablation report's
    layout), `answer_line`, `line_accuracy` (None when no completion has the line), `mean_length`, `truncated` (no
    end token within the cap) and `entropy` (nats per sampled token)."""
    cut = [completion[:cap] for completion in samples.completions]
    texts = tokenizer.batch_decode(cut, skip_special_tokens=True)
    right = [score_answer(text, truth)[0] == CORRECT for text, truth in zip(texts, samples.answers, strict=True)]
    has_line = [extract_answer(text) is not None for text in texts]
    per_problem = [right[i : i + samples.k] for i in range(0, len(right), samples.k)]
    tokens = sum(len(c) for c in cut)
    surprise = -sum(sum(logprobs[:cap]) for logprobs in samples.logprobs)
    k = samples.k
    return {
        f"avg@{k}": {"all": statistics.fmean(sum(p) / k for p in per_problem)},
        f"pass@{k}": {"all": statistics.fmean(float(any(p)) for p in per_problem)},
        "answer_line": statistics.fmean(has_line),
        "line_accuracy": sum(right) / sum(has_line) if any(has_line) else None,
        "mean_length": statistics.fmean(len(c) for c in cut),
        "truncated": statistics.fmean(float(not set(c) & samples.end_tokens) for c in cut),
        "entropy": surprise / max(tokens, 1),
    }
