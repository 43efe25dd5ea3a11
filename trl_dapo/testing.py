"""Test helpers shipped with the package: a deterministic rollout for trainer tests and benchmarks."""

from __future__ import annotations


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
