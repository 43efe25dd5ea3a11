"""Prompts checked before anything is generated from them.

A missing prompt (None) failed inside the tokenizer with no row named, as did one of bytes, an empty one with an
`IndexError` inside generation; a prompt longer than the model's context trained on positions the model never saw,
and a very long one ran the device out of memory (a 48k-character prompt asked for 28.8 GB). TRL 1.16 dropped
`max_prompt_length`; `DAPOConfig.max_prompt_length` refuses longer prompts rather than truncating them (a truncated
math problem is another problem, with the same ground truth).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from datasets import Dataset

from ...data.blank import blank_rows, is_blank
from ...text import and_more


def why_unreadable(prompt: Any) -> str | None:
    """Why `prompt` is neither text nor messages (the two forms TRL reads), or None."""
    if isinstance(prompt, str | list):
        return None
    if isinstance(prompt, bytes | bytearray):
        return (
            f"is bytes ({prompt!r:.40}): decode it first, e.g. `dataset.map(lambda row: {{'prompt': "
            "row['prompt'].decode('utf-8')})`"
        )
    return (
        f"is of type {type(prompt).__name__} ({prompt!r:.40}): a prompt is a string, or a list of messages "
        "(`[{'role': 'user', 'content': ...}]`)"
    )


def _unreadable_rows(dataset: Any) -> Sequence[int]:
    """Rows whose prompt is neither text nor messages: every row of a column Arrow holds as bytes or numbers."""
    if isinstance(dataset, Dataset):
        kind = dataset.features["prompt"]
        if not hasattr(kind, "dtype") or kind.dtype in ("string", "large_string"):
            return []  # text, or a list (of messages): `Value` features alone carry a dtype
        return range(len(dataset))
    return [row for row, prompt in enumerate(dataset["prompt"]) if why_unreadable(prompt) is not None]


def check_dataset_prompts(name: str, dataset: Any) -> None:
    """Each row of a dataset's `prompt` column holds a prompt, as text or messages, else an error naming the first
    row without one."""
    blank = blank_rows(dataset, "prompt")
    if blank:
        raise ValueError(
            f"{name} row {blank[0]}{and_more(len(blank))} has no prompt ({dataset[blank[0]]['prompt']!r}): nothing "
            "to generate from. Drop such rows (e.g. `dataset.filter(lambda row: row['prompt'])`) or fill them in."
        )
    unreadable = _unreadable_rows(dataset)
    if unreadable:
        why = why_unreadable(dataset[unreadable[0]]["prompt"])
        raise ValueError(f"{name} row {unreadable[0]}{and_more(len(unreadable))}: its prompt {why}.")


def prompt_token_limit(
    max_prompt_length: int | None, model_positions: int | None, max_completion_length: int
) -> tuple[int, str]:
    """Most prompt tokens (`max_prompt_length`, else the model's positions less the completion's; 0 when neither is
    known), and how the limit reads in an error."""
    if max_prompt_length is not None:
        return max_prompt_length, f"{max_prompt_length} (max_prompt_length)"
    if not model_positions:
        return 0, ""
    limit = max(model_positions - max_completion_length, 1)
    return limit, (
        f"{limit} (the model's {model_positions} positions less max_completion_length {max_completion_length}; "
        "max_prompt_length sets another)"
    )


def _named(position: int, prompt: Any, clip: int = 60) -> str:
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt or [])
    return f"prompt {position} of this batch ({text[:clip]!r}{'...' if len(text) > clip else ''})"


def check_batch_prompts(prompts: Sequence[Any]) -> None:
    """No prompt of a batch is missing, empty, or neither text nor messages (a stream's rows are not scanned at
    set-up), before tokenization."""
    for position, prompt in enumerate(prompts):
        if is_blank(prompt):
            raise ValueError(f"{_named(position, prompt)} is empty or missing: drop such rows from the dataset.")
        why = why_unreadable(prompt)
        if why is not None:
            raise ValueError(f"prompt {position} of this batch {why}.")


def check_prompt_ids(prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]], limit: int, limit_text: str) -> None:
    """Each tokenized prompt of a batch has a token and at most `limit` (0: no limit) of them, else an error naming
    it (its position in the batch and its start), its length and the limit, before generation."""
    for position, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True)):
        named = _named(position, prompt)
        if not ids:
            raise ValueError(f"{named} has 0 tokens: nothing to generate from. Drop such rows from the dataset.")
        if limit and len(ids) > limit:
            raise ValueError(
                f"{named} has {len(ids)} tokens, more than the limit of {limit_text}. Drop or shorten such rows "
                "(e.g. `dataset.filter(...)` on their token count), or raise max_prompt_length where the model's "
                "context and memory allow."
            )
