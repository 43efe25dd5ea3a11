"""Held-out accuracy as the paper reports it: avg@k (mean accuracy over k samples per problem) and pass@k."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl.models import unwrap_model_for_generation

from .rewards.math import CORRECT, score_answer


class MathAccuracyCallback(TrainerCallback):
    """Every `every` optimizer steps and at the end of training (unless the last step was just evaluated), sample
    `k` completions per held-out problem.

    Results join the next training log as `eval/accuracy` (avg@k) and `eval/pass@k`. Each rank scores a share of the
    problems; the counts are gathered.
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
    ) -> None:
        if len(dataset) == 0:
            raise ValueError(
                "MathAccuracyCallback: the held-out dataset is empty, so avg@k and pass@k would be computed over 0 "
                "problems; pass held-out problems, or leave the callback out."
            )
        self.trainer, self.dataset, self.k, self.every = trainer, dataset, k, every
        self.temperature, self.top_p, self.batch_size = temperature, top_p, batch_size
        self.evaluated_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs: Any):
        if self.every and state.global_step % self.every == 0:
            self.evaluate()
            self.evaluated_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs: Any):
        if self.evaluated_step != state.global_step:  # a second pass would log the same step twice
            self.evaluate()
        if self.trainer._metrics["train"]:
            self.trainer.log({})  # flush the final numbers into the log history

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        trainer = self.trainer
        tokenizer = trainer.processing_class
        accelerator = trainer.accelerator
        rows = list(range(accelerator.process_index, len(self.dataset), accelerator.num_processes))
        counts: list[int] = []
        with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
            was_training = model.training
            model.eval()
            for start in range(0, len(rows), self.batch_size):
                batch = [self.dataset[i] for i in rows[start : start + self.batch_size]]
                texts = [
                    tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
                    for r in batch
                ]
                inputs = tokenizer(
                    texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
                )
                output = model.generate(
                    **inputs.to(accelerator.device),
                    do_sample=True,
                    temperature=self.temperature,
                    top_p=self.top_p,
                    max_new_tokens=trainer.args.max_completion_length,
                    num_return_sequences=self.k,
                    pad_token_id=tokenizer.pad_token_id,
                )
                completions = tokenizer.batch_decode(
                    output[:, inputs["input_ids"].size(1) :], skip_special_tokens=True
                )
                for index, row in enumerate(batch):
                    samples = completions[index * self.k : (index + 1) * self.k]
                    counts.append(sum(score_answer(text, row["answer"])[0] == CORRECT for text in samples))
            model.train(was_training)
        counts = [c for share in gather_object([counts]) for c in share]
        metrics = {
            "eval/accuracy": sum(counts) / max(len(counts) * self.k, 1),
            f"eval/pass@{self.k}": sum(c > 0 for c in counts) / max(len(counts), 1),
        }
        for name, value in metrics.items():
            trainer._metrics["train"][name].append(value)
        return metrics
