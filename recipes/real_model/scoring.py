"""avg@k and pass@k of a model on generated problems, sampled by the package's paged engine: one evaluation engine
per process over its own bf16 (float32 on the CPU) snapshot of the weights, refreshed before each call, so the base
model, every cell of the grid and every run's checkpoints are scored by the same sampler at the task's temperature.
The samples are reproducible under a seed of their own and leave the training random state untouched."""

from __future__ import annotations

import statistics

import torch

from trl_dapo.rewards.math import CORRECT, extract_answer, score_answer
from trl_dapo.rollout.paged_engine import PagedRolloutEngine
from trl_dapo.rollout.token_sampling import TokenSampling


class EngineScorer:
    """Samples `k` completions per problem with the paged engine and scores them with the math reward."""

    def __init__(
        self, model, tokenizer, k: int, max_new_tokens: int, max_rows: int, memory_fraction: float, device: str
    ) -> None:
        cuda = device == "cuda"
        self.tokenizer, self.k, self.max_new_tokens = tokenizer, k, max_new_tokens
        self.engine = PagedRolloutEngine(
            model,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            dtype=torch.bfloat16 if cuda else torch.float32,
            cuda_graph=cuda,
            compile_decode=False,  # 7 processes compiling at once would cost more than the evaluations save
            memory_fraction=memory_fraction,
            max_rows=max_rows,
            device=torch.device(device),  # where the engine decodes, wherever the model is when it is built
        )

    def prompt_ids(self, dataset) -> list[list[int]]:
        texts = [
            self.tokenizer.apply_chat_template(row, add_generation_prompt=True, tokenize=False)
            for row in dataset["prompt"]
        ]
        return [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]

    def score(self, model, dataset, temperature: float, seed: int) -> dict:
        """`avg@k`, `pass@k` (as `{"all": value}`, the ablation report's layout), the mean completion length and the
        share cut at the limit, on `dataset` (`prompt` conversations, `answer` strings)."""
        self.engine.sync_weights(model)
        prompts = self.prompt_ids(dataset)
        device = self.engine.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            settings = TokenSampling(max_new_tokens=self.max_new_tokens, temperature=temperature)
            output = self.engine.generate([ids for ids in prompts for _ in range(self.k)], settings)
        texts = self.tokenizer.batch_decode(output.completions, skip_special_tokens=True)
        answers = [answer for answer in dataset["answer"] for _ in range(self.k)]
        right = [score_answer(text, truth)[0] == CORRECT for text, truth in zip(texts, answers, strict=True)]
        per_problem = [right[i : i + self.k] for i in range(0, len(right), self.k)]
        ends = set(self.engine.eos_token_ids)
        return {
            f"avg@{self.k}": {"all": statistics.fmean(sum(p) / self.k for p in per_problem)},
            f"pass@{self.k}": {"all": statistics.fmean(float(any(p)) for p in per_problem)},
            "mean_length": statistics.fmean(len(c) for c in output.completions),
            "truncated": statistics.fmean(float(not c or c[-1] not in ends) for c in output.completions),
            "answer_line": statistics.fmean(float(extract_answer(t) is not None) for t in texts),
        }
