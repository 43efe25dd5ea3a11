"""Row operations on a rollout batch, the dict TRL's `_generate_and_score_completions` returns (text-only keys): the
batch format the trainer, the dynamic-sampling buffer and the integrity checks share.

Dynamic sampling moves rows between candidate rounds, ranks and steps; these helpers keep the left-padded prompt
side and the right-padded completion side consistent while doing so.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# key -> padding side and value ("pad_token" = the tokenizer's pad id)
PADDED_KEYS: dict[str, tuple[str, float | str]] = {
    "prompt_ids": ("left", "pad_token"),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", "pad_token"),
    "completion_mask": ("right", 0),
    "tool_mask": ("right", 1),
    "old_per_token_logps": ("right", 0.0),  # the old policy of the ratio
    "sampling_per_token_logps": ("right", 0.0),  # the rollout's, when the old policy is recomputed (TRL's name)
    "sampling_step": ("right", 0),  # per token, the optimizer step whose weights sampled it (`SAMPLING_STEP`)
}
LOGPROB_KEYS = ("old_per_token_logps", "sampling_per_token_logps")
# With old_logprobs="recompute": the optimizer step whose weights computed a row's `old_per_token_logps` (-1: not yet),
# so rows that TRL's own pass already covered are not recomputed, and surplus rows of an earlier step are.
OLD_LOGPROBS_STEP = "old_logprobs_step"
# Per completion token, the optimizer step whose weights sampled it: every token of a round the step it was generated
# at, a carried row's earlier tokens an earlier one (partial rollouts). The age metrics read it; no pass trains on it.
SAMPLING_STEP = "sampling_step"
# One value (or one row of values) per completion: its advantage, and what the trained-batch metrics read (the
# per-function rewards, the completion length in model tokens, whether it was cut at max_completion_length).
ROW_KEYS = ("advantages", "rewards", "completion_lengths", "truncated", OLD_LOGPROBS_STEP)
ROLLOUT_KEYS = (*PADDED_KEYS, *ROW_KEYS)

RolloutBatch = dict[str, torch.Tensor]


def num_rows(batch: RolloutBatch) -> int:
    return batch["completion_ids"].size(0)


def pad_to_width(tensor: torch.Tensor, width: int, side: str, value: float) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    return F.pad(tensor, (missing, 0) if side == "left" else (0, missing), value=value)


def _pad_value(key: str, pad_token_id: int) -> float:
    value = PADDED_KEYS[key][1]
    return pad_token_id if value == "pad_token" else value


def concat_rollouts(batches: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Stack rows of several batches, re-padding each padded key to the widest batch."""
    batches = [b for b in batches if num_rows(b) > 0] or list(batches[:1])
    out: RolloutBatch = {}
    for key in batches[0]:
        tensors = [b[key] for b in batches]
        if key in PADDED_KEYS:
            width = max(t.size(1) for t in tensors)
            side = PADDED_KEYS[key][0]
            tensors = [pad_to_width(t, width, side, _pad_value(key, pad_token_id)) for t in tensors]
        out[key] = torch.cat(tensors, dim=0)
    return out


def select_rows(batch: RolloutBatch, rows: torch.Tensor | slice) -> RolloutBatch:
    return {key: value[rows] for key, value in batch.items()}


def trim_padding(batches: list[RolloutBatch]) -> list[RolloutBatch]:
    """Drop, in each batch, prompt columns and completion columns that are padding in every row (a re-sharded slice
    may have many). The used columns of all batches come back to the host in one synchronisation."""
    used = torch.cat(
        [torch.cat([b["prompt_mask"].bool().any(dim=0), b["completion_mask"].bool().any(dim=0)]) for b in batches]
    ).cpu()
    out = []
    for batch, batch_used in zip(
        batches, used.split([b["prompt_mask"].size(1) + b["completion_mask"].size(1) for b in batches]), strict=True
    ):
        prompt_width = batch["prompt_mask"].size(1)
        prompt_used, completion_used = batch_used[:prompt_width].nonzero(), batch_used[prompt_width:].nonzero()
        first_prompt = int(prompt_used[0]) if prompt_used.numel() else prompt_width
        last_completion = int(completion_used[-1]) + 1 if completion_used.numel() else 1
        trimmed = dict(batch)
        for key, (side, _) in PADDED_KEYS.items():
            if key in trimmed:
                trimmed[key] = trimmed[key][:, first_prompt:] if side == "left" else trimmed[key][:, :last_completion]
        out.append(trimmed)
    return out


def gather_rollout(batch: RolloutBatch, accelerator, pad_token_id: int) -> RolloutBatch:
    """Every rank gets the global batch, rows in rank order (the order TRL's sampler laid the groups out in)."""
    if accelerator.num_processes == 1:
        return batch
    out: RolloutBatch = {}
    for key, value in batch.items():
        if key in PADDED_KEYS:
            side = PADDED_KEYS[key][0]
            value = accelerator.pad_across_processes(
                value, dim=1, pad_index=_pad_value(key, pad_token_id), pad_first=side == "left"
            )
        out[key] = accelerator.gather(value.contiguous())
    return out


def loss_mask(batch: RolloutBatch) -> torch.Tensor:
    """The tokens the loss counts: completion tokens the policy sampled (not padding, not tool or environment output).
    The one rule for the loss, its token-mean denominator, the logprob checks and every per-token metric."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def rollout_logprobs(batch: RolloutBatch) -> torch.Tensor:
    """The logprobs of the policy that sampled: kept apart when the old policy was recomputed, else the old policy."""
    return batch.get("sampling_per_token_logps", batch["old_per_token_logps"])


def count_loss_tokens(batch: RolloutBatch) -> torch.Tensor:
    """The token-mean's denominator for these rows."""
    return loss_mask(batch).sum()
