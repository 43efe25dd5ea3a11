"""The sampling head of a rollout engine: next token and its logprob from the last hidden state.

Sampling is Gumbel-max over `logits / temperature` after top-k / top-p truncation: the same distribution as softmax
sampling, with no host synchronisation, so it can run inside a CUDA graph. The logprob returned for each sampled
token is `log_softmax(logits / temperature)` over the full vocabulary, the quantity TRL's training forward computes,
so it is the old policy directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int = 0
    greedy: bool = False


def sampling_noise(rows: int, vocab_size: int, settings: SamplingSettings, device) -> torch.Tensor | None:
    """Uniform noise for Gumbel-max, drawn outside compiled code so graph replays advance the generator."""
    return None if settings.greedy else torch.rand(rows, vocab_size, device=device)


def pick_tokens(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    noise: torch.Tensor | None,
    settings: SamplingSettings,
    eos: torch.Tensor,
    generated: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its logprob; EOS is blocked for rows with fewer than `min_new_tokens` `generated`.

    hidden (rows, hidden), lm_head (vocab, hidden), noise (rows, vocab) uniform or None (greedy), eos (n,) ids,
    generated (rows,) or a scalar: tokens each row has generated so far.
    """
    logits = F.linear(hidden, lm_head).float()
    if settings.min_new_tokens:
        blocked = (generated < settings.min_new_tokens).float() * -1e9
        logits[:, eos] += blocked.reshape(-1, 1) if blocked.dim() else blocked
    if noise is None:
        token = logits.argmax(dim=-1)
        return token, torch.log_softmax(logits, dim=-1).gather(1, token[:, None]).squeeze(1)
    logits = logits / settings.temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    candidates = logits
    if settings.top_k or settings.top_p < 1.0:
        candidates = truncate(logits, settings)
    token = (candidates - torch.log(-torch.log(noise.clamp(1e-10, 1.0)))).argmax(dim=-1)
    return token, logprobs.gather(1, token[:, None]).squeeze(1)


def truncate(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Top-k then top-p filtering, without host synchronisation."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if settings.top_k:
        drop[:, settings.top_k :] = True
    if settings.top_p < 1.0:
        probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > settings.top_p
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, -math.inf))
