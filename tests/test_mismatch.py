"""The rollout correction's weights for each mode, how they enter the DAPO loss, and the mismatch metrics, against
values derived by hand on small tensors."""

import math

import pytest
import torch

from trl_dapo import dapo_policy_loss
from trl_dapo.trainer.training.mismatch import mismatch_metrics, rollout_correction

# Rollout ratios ρ = π_old / π_rollout per token; row 1 has two padded tokens, row 2 one. Geometric means per
# sequence: row 0 (3 · 1.5 · 0.25 · 1)^(1/4) = 1.125^(1/4), row 1 (0.4 · 0.1)^(1/2) = 0.2, row 2 4. (Their products,
# 1.125, 0.04 and 64, are what a sum of log-ratios would give.)
RHO = [[3.0, 1.5, 0.25, 1.0], [0.4, 0.1, 1.0, 1.0], [4.0, 4.0, 4.0, 1.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
GEO0 = 1.125**0.25


def correction(mode, max_weight, min_weight=None):
    rollout = torch.full((3, 4), -2.0, dtype=torch.float64)
    old = rollout + torch.tensor(RHO, dtype=torch.float64).log()
    padding = ~MASK.bool()
    old, rollout = old.masked_fill(padding, math.nan), rollout.masked_fill(padding, math.inf)  # never read
    return rollout_correction(old, rollout, MASK, mode, max_weight, min_weight)


T, F = True, False
CASES = [
    # TIS: cap at 2, nothing below
    ("token_truncate", 2.0, None, [[2, 1.5, 0.25, 1], [0.4, 0.1, 0, 0], [2, 2, 2, 0]],
     [[T, F, F, F], [F, F, F, F], [T, T, T, F]]),
    # truncate into [0.5, 2]
    ("token_truncate", 2.0, 0.5, [[2, 1.5, 0.5, 1], [0.5, 0.5, 0, 0], [2, 2, 2, 0]],
     [[T, F, T, F], [T, T, F, F], [T, T, T, F]]),
    # MIS: the band [1/2, 2]; kept tokens keep their ratio
    ("token_mask", 2.0, None, [[0, 1.5, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]],
     [[T, F, T, F], [T, T, F, F], [T, T, T, F]]),
    # IcePop's band [0.5, 5]
    ("token_mask", 5.0, 0.5, [[3, 1.5, 0, 1], [0, 0, 0, 0], [4, 4, 4, 0]],
     [[F, F, T, F], [T, T, F, F], [F, F, F, F]]),
    # one geometric-mean weight per sequence, capped at 2
    ("sequence_truncate", 2.0, None, [[GEO0] * 4, [0.2, 0.2, 0, 0], [2, 2, 2, 0]],
     [[F, F, F, F], [F, F, F, F], [T, T, T, F]]),
    # sequences outside [1/2, 2] dropped whole
    ("sequence_mask", 2.0, None, [[GEO0] * 4, [0, 0, 0, 0], [0, 0, 0, 0]],
     [[F, F, F, F], [T, T, F, F], [T, T, T, F]]),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "max_weight", "min_weight", "weights", "corrected"), CASES)
def test_each_mode_weighs_tokens_as_derived_by_hand(mode, max_weight, min_weight, weights, corrected):
    got = correction(mode, max_weight, min_weight)
    torch.testing.assert_close(got.weights, torch.tensor(weights, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert got.corrected.tolist() == corrected
    assert not got.weights.requires_grad


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="rollout correction 'geometric_mask'"):
        correction("geometric_mask", 2.0)


def test_weights_multiply_the_clipped_loss_and_get_no_gradient():
    """Row 0 (A = -2): ratio 5 is capped by the dual clip at c·|A| = 6, weighted 0.5 -> 3, no gradient; ratio 1.1 is
    unclipped, 2.2 weighted 2 -> 4.4, gradient 4.4. Row 1 (A = 2): ratio 1.1 weighted 0 (masked) -> 0; ratio 1.5 is
    clipped high at -1.28·2 = -2.56, weighted 3 -> -7.68, no gradient. The divisor stays the 4 tokens."""
    logp = torch.tensor([[5.0, 1.1], [1.1, 1.5]], dtype=torch.float64).log().requires_grad_()
    weights = torch.tensor([[0.5, 2.0], [0.0, 3.0]], dtype=torch.float64, requires_grad=True)
    loss, stats = dapo_policy_loss(
        logp,
        torch.zeros(2, 2, dtype=torch.float64),
        torch.tensor([-2.0, 2.0], dtype=torch.float64),
        torch.ones(2, 2),
        epsilon_low=0.2,
        epsilon_high=0.28,
        num_tokens=4,
        clip_ratio_c=3.0,
        token_weights=weights,
    )
    loss.backward()
    assert loss.item() == pytest.approx((3.0 + 4.4 + 0.0 - 7.68) / 4, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 4.4 / 4], [0.0, 0.0]], dtype=torch.float64))
    assert weights.grad is None
    # the clip fractions describe the ratio, whatever the weights
    assert stats["clip_ratio/dual_mean"].item() == 0.25 and stats["clip_ratio/high_mean"].item() == 0.25


def test_mismatch_metrics_as_derived_by_hand():
    """Log-ratios to the rollout, train: row 0 (A = 1) [0.5, -0.1, 0], row 1 (A = -1) [-0.4, 0.1]; recomputed old:
    [0.2, 0, -0.3], [0.1, 0.1]; row 1's last token is padding full of NaN. Against the rollout, e^0.5 > 1.28 with
    A > 0 is clipped high, e^-0.4 < 0.8 with A < 0 clipped low. token_mask in [1/1.2, 1.2] masks e^0.2 and e^-0.3."""
    rollout = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, math.nan]], dtype=torch.float64)
    train = rollout + torch.tensor([[0.5, -0.1, 0.0], [-0.4, 0.1, 0.0]], dtype=torch.float64)
    old = rollout + torch.tensor([[0.2, 0.0, -0.3], [0.1, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = rollout_correction(old, rollout, mask, "token_mask", 1.2)
    got = mismatch_metrics(
        train, old, rollout, torch.tensor([1.0, -1.0]), mask, epsilon_low=0.2, epsilon_high=0.28, clip_ratio_c=10.0,
        recomputed=True, correction=weights,
    )  # fmt: skip

    def k3(values):
        return sum(math.exp(d) - 1 - d for d in values) / 5

    expected = {
        "logprob_gap_mean": 1.1 / 5,
        "rollout_kl": k3([0.5, -0.1, 0.0, -0.4, 0.1]),
        "old_logprob_gap_mean": 0.7 / 5,
        "old_rollout_kl": k3([0.2, 0.0, -0.3, 0.1, 0.1]),
        "clip_ratio_rollout/low_mean": 1 / 5,
        "clip_ratio_rollout/high_mean": 1 / 5,
        "clip_ratio_rollout/region_mean": 2 / 5,
        "clip_ratio_rollout/dual_mean": 0.0,
        "rollout_correction/weight_mean": (1 + 2 * math.exp(0.1)) / 5,
        "rollout_correction/token_fraction": 2 / 5,
    }
    assert set(got.token_means) == set(expected)
    for name, value in expected.items():
        assert got.token_means[name].item() == pytest.approx(value, abs=1e-7), name  # shares in float32
    assert {k: v.item() for k, v in got.maxima.items()} == pytest.approx(
        {"logprob_gap_max": 0.5, "old_logprob_gap_max": 0.3}
    )
    assert {k: v.item() for k, v in got.sequence_means.items()} == {"rollout_correction/sequence_fraction": 0.5}
    assert got.sequences.item() == 2


def test_without_recomputation_only_the_train_rollout_gap_is_reported():
    rollout = torch.tensor([[-1.0, -2.0]])
    got = mismatch_metrics(
        rollout + torch.tensor([[0.3, -0.1]]), rollout, rollout, torch.tensor([1.0]), torch.ones(1, 2),
        epsilon_low=0.2, epsilon_high=0.28, clip_ratio_c=None, recomputed=False,
    )  # fmt: skip
    assert set(got.token_means) == {"logprob_gap_mean", "rollout_kl"} and not got.sequence_means
    assert got.token_means["logprob_gap_mean"].item() == pytest.approx(0.2)
    assert got.maxima["logprob_gap_max"].item() == pytest.approx(0.3)
