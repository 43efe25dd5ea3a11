"""The DAPO policy loss (arXiv 2503.14476, Eq. 8), as a pure function.

    r_t   = π_θ(o_t) / π_old(o_t)                              importance ratio against the old policy
                                                               (1 on tokens outside the mask, whatever they hold)
    ℓ_t   = -min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A)         Clip-Higher (ε_high > ε_low)
    ℓ_t   = min(ℓ_t, -c·A)            where A < 0                dual clip of the reference recipe (c = clip_ratio_c)
    ℓ_t   = w_t · ℓ_t                 with token_weights          rollout correction (`mismatch.py`), detached
    loss  = Σ_{active t} ℓ_t / num_tokens                       token-level mean over the whole optimizer step

π_old is `old_per_token_logps`: the rollout policy's logprobs with `old_logprobs="rollout"` (the default), the
training model's recomputation before the generation batch's first update with `old_logprobs="recompute"`
(`docs/design.md`, "The old policy and the train/rollout mismatch").

`num_tokens` is passed in rather than counted here: it is the response-token count of the whole optimizer step (all
micro-batches, all ranks), which no single micro-batch can see. A token weighted 0 (masked by the rollout correction)
still counts in it, as in IcePop's objective: the weight changes what a token contributes, not the mean's size.
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
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return `(loss, stats)`: the summed clipped per-token loss over `num_tokens`, and detached means over active tokens.

    Shapes: logps, mask and `token_weights` `(B, T)`, advantages `(B,)` or `(B, T)`. `token_weights` multiply each
    token's clipped loss (Clip-Higher and dual clip included) and get no gradient. `stats` holds `clip_ratio/low_mean`,
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
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = (per_token_loss * mask).sum() / num_tokens

    with torch.no_grad():
        active = mask.bool()
        num_active = active.sum()
        ratio_mean = active_mean(ratio, active)
        stats = {
            **clip_fractions(ratio, advantages, active, epsilon_low, epsilon_high, clip_ratio_c, "clip_ratio"),
            "ratio_mean": torch.where(num_active > 0, ratio_mean, 1.0),
            "ratio_std": active_mean((ratio - ratio_mean) ** 2, active).sqrt(),
            "num_active_tokens": num_active.float(),
        }
    return loss, stats


def active_mean(values: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Mean over the active tokens, as a masked sum: no boolean indexing, so no host synchronisation."""
    return (values.expand_as(active) * active).sum() / active.sum().clamp(min=1)


@torch.no_grad()
def clip_fractions(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    active: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    clip_ratio_c: float | None,
    prefix: str,
) -> dict[str, torch.Tensor]:
    """Shares of the active tokens each clip acts on, for a `ratio` (the loss's own, or another one to compare):
    `low` (A < 0, r < 1 - ε_low), `high` (A > 0, r > 1 + ε_high), `region` (both) and `dual` (A < 0, r > c)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    negative = advantages < 0
    low = active_mean(negative & (ratio < 1 - epsilon_low), active)
    high = active_mean((advantages > 0) & (ratio > 1 + epsilon_high), active)
    dual = active_mean(negative & (ratio > clip_ratio_c), active) if clip_ratio_c is not None else low.new_zeros(())
    return {
        f"{prefix}/low_mean": low,
        f"{prefix}/high_mean": high,
        f"{prefix}/region_mean": low + high,
        f"{prefix}/dual_mean": dual,
    }
