"""Token sampling in the rollout engine (not dynamic sampling, `trl_dapo/sampling/`): the sampling head, next token
and its logprob from the last hidden state.

Sampling is Gumbel-max over `logits / temperature` after top-k / top-p truncation: the same distribution as softmax
sampling, with no host synchronisation, so it can run inside a CUDA graph. The logprob returned for each sampled
token is `log_softmax(logits / temperature)` over the full vocabulary, the quantity TRL's training forward computes,
so it is the old policy directly. The logits are computed in the precision the training forward's head uses: rounded
to the weights' dtype (bf16) like TRL's default head, or kept in float32 (`fp32_logits`) like its head with
`cast_lm_head_to_fp32=True`; two heads that round differently disagree by up to half a bf16 step of each logit.
The vocabulary-wide reductions (the sampled token, the logsumexp) run over chunks of each row: a decode batch has
tens of rows, and the compiled full-row `log_softmax` took 1.1 ms of a 6.1 ms 7B decode step on an H200. Up to 256
chunks: Qwen2.5-7B's 152,064 entries then come in chunks of 594 rather than 2,376, and the head at 64 rows (its
product and noise included) took 339 us instead of 387 (H200, 2026-12-04).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

VOCAB_CHUNKS = 256


@dataclass(frozen=True)
class TokenSampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int = 0
    greedy: bool = False
    fp32_logits: bool = False  # float32 logits from the bf16 head, accumulated without rounding them to bf16


def stop_table(stop_token_ids: list[int], vocab_size: int, device) -> torch.Tensor:
    """(vocab_size,) bool, True at the ids that end a row: whether a token ends its row is one lookup, whatever the
    number of ids. `torch.isin` sorts once the ids outnumber a few, which a CUDA graph cannot capture (the capture
    of a decode step with 24 ids failed), and its comparison grows with the ids. Ids past the vocabulary are never
    sampled."""
    if any(token < 0 for token in stop_token_ids):
        raise ValueError(f"stop token ids must be non-negative, got {sorted(set(stop_token_ids))}.")
    table = torch.zeros(vocab_size, dtype=torch.bool)
    table[[token for token in stop_token_ids if token < vocab_size]] = True
    return table.to(device)


def sampling_noise(rows: int, vocab_size: int, settings: TokenSampling, device) -> torch.Tensor | None:
    """Uniform noise for Gumbel-max, drawn outside compiled code so graph replays advance the generator."""
    return None if settings.greedy else torch.rand(rows, vocab_size, device=device)


def pick_tokens(
    hidden: torch.Tensor,
    lm_head: torch.Tensor,
    noise: torch.Tensor | None,
    settings: TokenSampling,
    stops: torch.Tensor,
    generated: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its logprob; the stop tokens are blocked for rows with fewer than `min_new_tokens`
    `generated`.

    hidden (rows, hidden), lm_head (vocab, hidden), noise (rows, vocab) uniform or None (greedy), stops (vocab,) bool
    (`stop_table`), generated (rows,) or a scalar: tokens each row has generated so far.
    """
    logits = head_logits(hidden, lm_head, settings.fp32_logits)
    if settings.min_new_tokens:
        # a mask, not an in-place add to the stop columns: that would make the compiler write the float32 logits out
        blocked = (generated < settings.min_new_tokens).reshape(-1, 1) & stops
        logits = logits + blocked.float() * -1e9
    candidates = logits
    if noise is not None:
        logits = logits / settings.temperature
        candidates = truncate(logits, settings) if settings.top_k or settings.top_p < 1.0 else logits
        candidates = candidates - torch.log(-torch.log(noise.clamp(1e-10, 1.0)))
    token = chunked_argmax(candidates)
    return token, logits.gather(1, token[:, None]).squeeze(1) - chunked_logsumexp(logits)


def vocab_chunks(vocab_size: int) -> int:
    """Chunks each row's vocabulary is reduced in: the largest power of two up to VOCAB_CHUNKS dividing it (by
    remainders, not `math.gcd`: under `torch.compile` the size may be symbolic)."""
    chunks = VOCAB_CHUNKS
    while vocab_size % chunks:
        chunks //= 2
    return chunks


def chunked_argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(dim=-1)` of (rows, vocab), first index on ties, as a reduction over chunks of the vocabulary
    and then over the chunks' maxima: a decode batch has few rows, and a reduction with one program per row (what
    the compiled head generated for a full-vocabulary `log_softmax`) leaves most of the GPU idle."""
    rows, vocab = values.shape
    chunks = vocab_chunks(vocab)
    chunk_max, chunk_index = values.view(rows, chunks, vocab // chunks).max(dim=-1)
    best = chunk_max.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (best * (vocab // chunks) + chunk_index.gather(1, best)).squeeze(1)


def chunked_logsumexp(values: torch.Tensor) -> torch.Tensor:
    """`values.logsumexp(dim=-1)` of finite (rows, vocab) float32, chunk by chunk (see `chunked_argmax`). Each chunk
    is shifted by its own maximum, so its sum depends on that chunk alone (a shift by the row's maximum would let the
    compiler merge the two stages back into one reduction per row)."""
    rows, vocab = values.shape
    chunks = vocab_chunks(vocab)
    parts = values.view(rows, chunks, vocab // chunks)
    chunk_max = parts.amax(dim=-1, keepdim=True)  # (rows, chunks, 1)
    chunk_sum = torch.exp(parts - chunk_max).sum(dim=-1)  # (rows, chunks)
    top = chunk_max.squeeze(-1).amax(dim=-1, keepdim=True)  # (rows, 1)
    return torch.log((chunk_sum * torch.exp(chunk_max.squeeze(-1) - top)).sum(dim=-1)) + top.squeeze(1)


def head_logits(hidden: torch.Tensor, lm_head: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Float32 logits of `hidden` (rows, hidden) under `lm_head` (vocab, hidden). Unless `fp32`, the product is
    rounded to the weights' dtype first. With `fp32`, the bf16 products accumulate into float32 outputs: on CUDA one
    matrix product with a float32 output (no float32 copy of the head, the same bytes read as in bf16), elsewhere
    through float32 copies (on the CPU the engine runs in float32 anyway)."""
    if not fp32 or lm_head.dtype == torch.float32:
        return F.linear(hidden, lm_head).float()
    if hidden.device.type == "cuda":
        return torch.mm(hidden, lm_head.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), lm_head.float())


def truncate(logits: torch.Tensor, settings: TokenSampling) -> torch.Tensor:
    """Top-k then top-p filtering, without host synchronisation."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if settings.top_k:
        drop[:, settings.top_k :] = True
    if settings.top_p < 1.0:
        probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > settings.top_p
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, -math.inf))
