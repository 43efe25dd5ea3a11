"""Test helpers shipped with the package: a deterministic rollout for trainer tests and benchmarks, and a paged decode
step's inputs for the attention kernels' tests (their Triton-interpreter scripts import it too)."""

from __future__ import annotations

import math

import torch


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


def paged_decode_case(
    heads: int, kv_heads: int, dim: int, page: int, lengths: list[int], value_scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """One decode step's inputs for the paged attention's tests, drawn from torch's global generator: rows of
    `lengths` tokens (0: an idle slot, whose write goes to the pool's extra page that no row reads) over pages
    scattered through a pool, random float32 k / v caches (v times `value_scale`), each row's new token and rotary."""
    rows, width = len(lengths), max(math.ceil(n / page) for n in lengths) + 1
    pool = rows * width + 3
    k, v = torch.randn((pool + 1) * page, kv_heads, dim), torch.randn((pool + 1) * page, kv_heads, dim) * value_scale
    table = torch.randperm(pool)[: rows * width].view(rows, width).int()
    lens = torch.tensor(lengths, dtype=torch.int32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    angles = torch.rand(rows, dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    position = (lens - 1).clamp(min=0)
    write = table.gather(1, (position // page).long()[:, None])[:, 0].long() * page + position % page
    write[lens == 0] = pool * page
    return dict(qkv=qkv, cos=cos, sin=sin, write=write, k=k, v=v, table=table, lens=lens)
