"""The DAPO policy loss (arXiv 2503.14476, Eq. 8), as a pure function.

    r_t   = π_θ(o_t) / π_rollout(o_t)                          importance ratio against the rollout policy
                                                               (1 on tokens outside the mask, whatever they hold)
    ℓ_t   = -min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A)         Clip-Higher (ε_high > ε_low)
    ℓ_t   = min(ℓ_t, -c·A)            where A < 0                dual clip of the reference recipe (c = clip_ratio_c)
    loss  = Σ_{active t} ℓ_t / num_tokens                       token-level mean over the whole optimizer step

`num_tokens` is passed in rather than counted here: it is the response-token count of the whole optimizer step (all
micro-batches, all ranks), which no single micro-batch can see.
"""

from __future__ import annotations

import torch

# Bound on |log r| before exponentiation, as in the reference framework: keeps exp() finite when a token's
# probability collapses. Tokens that far out are clipped in every branch except A < 0 without dual clip.
MAX_LOG_RATIO = 20.0


def dapo_policy_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    num_tokens: float | torch.Tensor,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `(loss, stats)`: the summed clipped per-token loss over `num_tokens`, and detached means over active tokens.

    Shapes: logps and mask `(B, T)`, advantages `(B,)` or `(B, T)`. `stats` holds `clip_ratio/low_mean`,
    `clip_ratio/high_mean`, `clip_ratio/region_mean`, `clip_ratio/dual_mean`, `ratio_mean`, `ratio_std` and
    `num_active_tokens` (the weight to combine these means across micro-batches and ranks).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mask = completion_mask.to(per_token_logps.dtype)
    # Masked before anything is summed, as the reference recipe does: a NaN or inf logprob on a token that does not
    # count (padding, tool output) must not reach the loss, its gradient or the metrics.
    log_ratio = torch.where(completion_mask.bool(), per_token_logps - old_per_token_logps, 0.0)
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    negative = advantages < 0
    if clip_ratio_c is not None:
        per_token_loss = torch.where(
            negative, torch.minimum(per_token_loss, -advantages * clip_ratio_c), per_token_loss
        )
    loss = (per_token_loss * mask).sum() / num_tokens

    with torch.no_grad():  # masked sums, not boolean indexing: no host synchronisation inside the loss
        active = mask.bool()
        num_active = active.sum()
        count = num_active.clamp(min=1)

        def active_mean(values: torch.Tensor) -> torch.Tensor:
            return (values.expand_as(active) * active).sum() / count

        low = active_mean(negative & (ratio < 1 - epsilon_low))
        high = active_mean((advantages > 0) & (ratio > 1 + epsilon_high))
        dual = active_mean(negative & (ratio > clip_ratio_c)) if clip_ratio_c is not None else low.new_zeros(())
        ratio_mean = active_mean(ratio)
        ratio_std = active_mean((ratio - ratio_mean) ** 2).sqrt()
        stats = {
            "clip_ratio/low_mean": low,
            "clip_ratio/high_mean": high,
            "clip_ratio/region_mean": low + high,
            "clip_ratio/dual_mean": dual,
            "ratio_mean": torch.where(num_active > 0, ratio_mean, 1.0),
            "ratio_std": ratio_std,
            "num_active_tokens": num_active.to(low.dtype),
        }
    return loss, stats
