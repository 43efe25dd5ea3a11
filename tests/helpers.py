"""Shared test helpers: a deterministic rollout, fixed-length prompts, config defaults for the CPU."""

from __future__ import annotations

from datasets import Dataset

from trl_dapo import DAPOConfig

CPU_ARGS = dict(use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)


def arithmetic_prompts(count: int, offset: int = 0) -> Dataset:
    """Prompts of identical token length (no left padding), so any batch split gives the same positions."""
    rows = [(i + offset) for i in range(count)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i % 10} + {i // 10 % 10} ?"}] for i in rows],
            "index": rows,
        }
    )


def dapo_args(output_dir, **overrides) -> DAPOConfig:
    values = dict(
        output_dir=str(output_dir),
        num_generations=4,
        max_completion_length=8,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        seed=0,
        **CPU_ARGS,
    )
    values.update(overrides)
    return DAPOConfig(**values)


class ScriptedRollout:
    """A `rollout_func` whose completions and logprobs depend only on the prompt and the sample's index in its group.

    Lengths vary (1..7 tokens) so micro-batches carry uneven token counts; logprobs are not the model's, so ratios
    differ from 1 and every clip branch can fire. The same rows come out whatever the number of ranks.
    """

    def __init__(self, tokenizer, vocab_low: int = 3, vocab_high: int = 300) -> None:
        self.tokenizer = tokenizer
        self.low, self.span = vocab_low, vocab_high - vocab_low

    def completion(self, prompt_ids: list[int], index: int) -> tuple[list[int], list[float]]:
        seed = sum((p + 1) * (k + 3) for k, p in enumerate(prompt_ids)) + 7 * index
        length = 1 + seed % 7
        ids = [self.low + (seed * (t + 5) + t * t) % self.span for t in range(length)]
        ids.append(self.tokenizer.eos_token_id) if seed % 3 else None
        logps = [-5.9 + ((seed + 3 * t) % 11 - 5) / 20 for t in range(len(ids))]
        return ids, logps

    def __call__(self, prompts, trainer) -> dict:
        # Groups are consecutive in the global row order, so a row's index in its group is its global row index
        # modulo the group size, whichever rank holds it.
        first_row = trainer.accelerator.process_index * len(prompts)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for row, prompt in enumerate(prompts, start=first_row):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            completion, logps = self.completion(ids, row % trainer.num_generations)
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append(logps)
        return out


def length_reward(completion_ids, **kwargs) -> list[float]:
    """Varied within most groups: a completion's length parity."""
    return [float(len(ids) % 2) for ids in completion_ids]


def first_token_parity(completion_ids, **kwargs) -> list[float]:
    """Varied within most groups of a random model's samples (whose lengths mostly hit the limit)."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]
