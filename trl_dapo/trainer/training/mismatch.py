"""The train/rollout mismatch: the rollout correction between a recomputed old policy and the rollout logprobs, and
the metrics that show the mismatch.

The generation engine and the training forward compute the same policy with different kernels, so the logprobs of
the sampled tokens differ by rounding. With `old_logprobs="recompute"` three policies meet in the loss, as in
decoupled PPO (Hilton et al. 2021, arXiv 2110.00641) and verl's rollout correction: π_rollout sampled the tokens
(the engine's logprobs), π_old is the training model's own recomputation before any update (the anchor the DAPO
ratio π_θ / π_old is clipped around), π_θ is trained. The correction weighs each token's clipped loss by a detached
function of the rollout ratio

    ρ_t   = π_old(o_t) / π_rollout(o_t)                          token level
    ρ_seq = exp(mean_t log ρ_t), t over the response's tokens    sequence level: the geometric mean, on every token

    truncate:  w = min(ρ, max)            (clamped below at min too when min is set)   TIS
    mask:      w = ρ · 1[min ≤ ρ ≤ max]   (min defaults to 1 / max)                      MIS / IcePop

Truncation is the truncated importance sampling of Yao et al. ("Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training", 2025): keep every token, cap its weight. Masking is IcePop's (Ring-1T report, arXiv
2510.18855, band [0.5, 5]) and masked importance sampling's (Liu, Li et al., "When Speed Kills Stability", 2025):
tokens the two engines disagree on beyond the band get no gradient, the others their importance weight. TRL's
`vllm_importance_sampling_mode` defines the same four modes, but its sequence level multiplies the token ratios
(exp of their sum), as verl's `rollout_is: sequence` does. Here the sequence level takes their geometric mean, as
verl's `rollout_rs: geometric` and GSPO (arXiv 2507.18071) do: DAPO's responses run to 20,480 tokens, and a product
of that many ratios each a little off 1 leaves any band for length alone, so a threshold would mean something else
at 100 tokens and at 20,000.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..configuration import CORRECTION_MODES
from .loss import MAX_LOG_RATIO, active_mean, clip_fractions


class RolloutCorrection(NamedTuple):
    weights: torch.Tensor  # (B, T) detached weight of each token's loss, 0 outside the mask
    corrected: torch.Tensor  # (B, T) bool: tokens whose weight was capped or masked (a sequence's every token)


def masked_log_ratio(logps: torch.Tensor, reference: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """log(π / π_reference) on the active tokens, 0 elsewhere (whatever those hold), bounded before any exp()."""
    return torch.where(active, logps - reference, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


@torch.no_grad()
def rollout_correction(
    old_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    max_weight: float,
    min_weight: float | None = None,
) -> RolloutCorrection:
    """The weight of each token's loss for `mode` (one of `CORRECTION_MODES`), from the recomputed old policy's and
    the rollout's logprobs of the sampled tokens, `(B, T)` each; `mask` marks the response tokens that count."""
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction {mode!r}: use one of {CORRECTION_MODES}.")
    level, action = mode.split("_")
    active = mask.bool()
    log_rho = masked_log_ratio(old_logps, rollout_logps, active)
    if level == "sequence":
        tokens = active.sum(dim=1, keepdim=True).clamp(min=1)
        log_rho = (log_rho.sum(dim=1, keepdim=True) / tokens).expand_as(log_rho)
    rho = log_rho.exp()
    if action == "truncate":
        lower = 0.0 if min_weight is None else min_weight
        weights, corrected = rho.clamp(min=lower, max=max_weight), (rho > max_weight) | (rho < lower)
    else:
        lower = 1.0 / max_weight if min_weight is None else min_weight
        keep = (rho >= lower) & (rho <= max_weight)
        weights, corrected = rho * keep, ~keep
    return RolloutCorrection(weights * active, corrected & active)


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(q ‖ p) from tokens sampled from q, with `log_ratio` = log(p / q): r - 1 - log r.

    Unbiased like k1 (-log r), but never negative and of lower variance when p and q are close (Schulman, "Approximating
    KL Divergence", 2020), the regime of a numerical mismatch; verl logs the same estimate as `rollout_corr/k3_kl`."""
    return log_ratio.exp() - 1 - log_ratio


class MismatchMetrics(NamedTuple):
    token_means: dict[str, torch.Tensor]  # means over the active tokens
    sequence_means: dict[str, torch.Tensor]  # means over the rows that have active tokens
    maxima: dict[str, torch.Tensor]
    sequences: torch.Tensor  # rows with active tokens: the weight of the sequence means


@torch.no_grad()
def mismatch_metrics(
    train_logps: torch.Tensor,
    old_logps: torch.Tensor,
    rollout_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    clip_ratio_c: float | None,
    recomputed: bool,
    correction: RolloutCorrection | None = None,
) -> MismatchMetrics:
    """How far the training forward (`train_logps`, this micro-batch's) and, when the old policy was `recomputed`, the
    recomputation (`old_logps`) are from the rollout logprobs on the response tokens.

    Always: `logprob_gap_mean` / `logprob_gap_max` (|train - rollout|) and `rollout_kl` (k3 estimate of
    KL(π_rollout ‖ π_train) per token). Recomputed: `old_logprob_gap_mean` / `old_logprob_gap_max` and
    `old_rollout_kl` (the same against the recomputation: the mismatch before any update), and
    `clip_ratio_rollout/*`, the clip fractions of π_θ / π_rollout (what DAPO's clip would do with the mismatch
    visible; `clip_ratio/*` are those of the loss's π_θ / π_old). With a correction: `rollout_correction/weight_mean`,
    the shares of tokens (`token_fraction`) and of sequences (`sequence_fraction`, a sequence with any such token)
    whose weight was capped or masked.
    """
    active = mask.bool()
    train_log_ratio = masked_log_ratio(train_logps, rollout_logps, active)
    token_means = {
        "logprob_gap_mean": active_mean(train_log_ratio.abs(), active),
        "rollout_kl": active_mean(k3_kl(train_log_ratio), active),
    }
    maxima = {"logprob_gap_max": (train_log_ratio.abs() * active).amax()}
    sequence_means: dict[str, torch.Tensor] = {}
    if recomputed:
        old_log_ratio = masked_log_ratio(old_logps, rollout_logps, active)
        token_means["old_logprob_gap_mean"] = active_mean(old_log_ratio.abs(), active)
        token_means["old_rollout_kl"] = active_mean(k3_kl(old_log_ratio), active)
        maxima["old_logprob_gap_max"] = (old_log_ratio.abs() * active).amax()
        token_means.update(
            clip_fractions(
                train_log_ratio.exp(),
                advantages,
                active,
                epsilon_low,
                epsilon_high,
                clip_ratio_c,
                "clip_ratio_rollout",
            )
        )
    rows = active.any(dim=1)
    if correction is not None:
        token_means["rollout_correction/weight_mean"] = active_mean(correction.weights, active)
        token_means["rollout_correction/token_fraction"] = active_mean(correction.corrected, active)
        sequence_means["rollout_correction/sequence_fraction"] = active_mean(correction.corrected.any(dim=1), rows)
    return MismatchMetrics(token_means, sequence_means, maxima, rows.sum().float())
