"""The DAPO loss against hand-derived values, every clip branch, and finite differences."""

import math

import pytest
import torch

from trl_dapo import dapo_policy_loss

EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0


def one_token(ratio: float, advantage: float, clip_ratio_c=C):
    """Loss, stats and d(loss)/d(logp) for a single token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, stats = dapo_policy_loss(
        logp,
        old,
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1),
        epsilon_low=EPS_LOW,
        epsilon_high=EPS_HIGH,
        num_tokens=1,
        clip_ratio_c=clip_ratio_c,
    )
    loss.backward()
    return loss.item(), stats, logp.grad.item()


# ratio, advantage, expected loss, expected gradient d/dlogp (= d/dr * r), active clip flag
BRANCHES = [
    # A > 0: unclipped below 1+eps_high: loss = -r*A, grad = -r*A
    (1.1, 2.0, -2.2, -2.2, None),
    # A > 0, r > 1.28: loss = -(1.28)*A, no gradient (high clip)
    (1.5, 2.0, -2.56, 0.0, "clip_ratio/high_mean"),
    # A > 0, r < 0.8: min(r*A, 0.8*A) = r*A (lower clip does not bind for A > 0), gradient flows
    (0.5, 2.0, -1.0, -1.0, None),
    # A < 0, r < 0.8: max(-r*A, -0.8*A) = 0.8*|A| = 1.6 (low clip), no gradient
    (0.5, -2.0, 1.6, 0.0, "clip_ratio/low_mean"),
    # A < 0, 0.8 <= r: unclipped, loss = r*|A|, grad = r*|A|
    (1.1, -2.0, 2.2, 2.2, None),
    # A < 0, r > 1.28 but below c: upper clip does not bind for A < 0: loss = r*|A|
    (2.0, -2.0, 4.0, 4.0, None),
    # A < 0, r > c: dual clip caps the loss at c*|A| = 6, no gradient
    (5.0, -2.0, 6.0, 0.0, "clip_ratio/dual_mean"),
]


@pytest.mark.parametrize(("ratio", "advantage", "loss", "grad", "flag"), BRANCHES)
def test_every_clip_branch(ratio, advantage, loss, grad, flag):
    got_loss, stats, got_grad = one_token(ratio, advantage)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_grad == pytest.approx(grad, abs=1e-12)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/dual_mean"):
        assert stats[name].item() == (1.0 if name == flag else 0.0), name
    assert stats["ratio_mean"].item() == pytest.approx(ratio)


def test_dual_clip_disabled_lets_the_loss_grow():
    loss, stats, grad = one_token(5.0, -2.0, clip_ratio_c=None)
    assert loss == pytest.approx(10.0)
    assert grad == pytest.approx(10.0)
    assert stats["clip_ratio/dual_mean"].item() == 0.0


def test_masked_sum_over_given_token_count_and_clip_fractions():
    # Two sequences; the second has one padded token that must not count.
    logps = torch.log(torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.1, 9.0]], dtype=torch.float64))
    old = torch.zeros_like(logps)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, stats = dapo_policy_loss(
        logps, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.28, num_tokens=10, clip_ratio_c=10.0
    )
    # row 0 (A=1): -1.0, -1.28 (high clip), -0.5 ; row 1 (A=-1): 0.8 (low clip), 1.1 ; pad ignored
    assert loss.item() == pytest.approx((-1.0 - 1.28 - 0.5 + 0.8 + 1.1) / 10)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    ratios = torch.tensor([1.0, 1.5, 0.5, 0.7, 1.1], dtype=torch.float64)
    assert stats["ratio_mean"].item() == pytest.approx(ratios.mean().item())
    assert stats["ratio_std"].item() == pytest.approx(ratios.std(correction=0).item())
    assert stats["num_active_tokens"].item() == 5


def test_ratio_is_against_rollout_logprobs_not_a_detached_copy():
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    _, stats = dapo_policy_loss(
        logps, rollout, torch.tensor([1.0]), torch.ones(1, 2), epsilon_low=0.2, epsilon_high=0.28, num_tokens=2
    )
    expected = torch.exp(logps.detach() - rollout)
    assert stats["ratio_mean"].item() == pytest.approx(expected.mean().item())
    assert stats["clip_ratio/high_mean"].item() == 0.5  # exp(0.5) = 1.65 > 1.28 with A > 0


def test_gradient_matches_finite_differences():
    torch.manual_seed(0)
    logps = (torch.randn(3, 5, dtype=torch.float64) * 0.4 - 1.0).requires_grad_()
    old = logps.detach() + torch.randn(3, 5, dtype=torch.float64) * 0.3
    advantages = torch.tensor([1.3, -0.7, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])

    def loss_of(x):
        return dapo_policy_loss(
            x, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.28, num_tokens=12, clip_ratio_c=3.0
        )[0]

    loss_of(logps).backward()
    step = 1e-6
    numeric = torch.zeros_like(logps)
    for index in torch.cartesian_prod(torch.arange(3), torch.arange(5)):
        i, j = index.tolist()
        plus, minus = logps.detach().clone(), logps.detach().clone()
        plus[i, j] += step
        minus[i, j] -= step
        numeric[i, j] = (loss_of(plus) - loss_of(minus)) / (2 * step)
    torch.testing.assert_close(logps.grad, numeric, atol=1e-7, rtol=1e-6)
    assert logps.grad[1, 3:].abs().sum() == 0  # padding gets no gradient


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
def test_non_finite_rollout_logprobs_outside_the_mask_change_nothing(garbage):
    """Padding or tool tokens may carry any value (vLLM gives NaN for what it did not score): the loss, its gradient
    and every metric must be what they are with finite values there. Hand value: token (0, 0) has ratio
    e^(-0.5 + 1) = e^0.5 > 1.28 with A = 1 (clipped at 1.28), token (0, 1) ratio 1 with A = 1, token (1, 0) ratio 1
    with A = -1: loss = (-1.28 - 1 + 1) / 3."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def run(old_fill: float):
        logp = torch.tensor([[-0.5, -1.0, -2.0], [-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
        old = torch.tensor([[-1.0, -1.0, old_fill], [-1.0, old_fill, old_fill]], dtype=torch.float64)
        loss, stats = dapo_policy_loss(
            logp,
            old,
            torch.tensor([1.0, -1.0], dtype=torch.float64),
            mask,
            epsilon_low=EPS_LOW,
            epsilon_high=EPS_HIGH,
            num_tokens=3,
            clip_ratio_c=C,
        )
        loss.backward()
        return loss, stats, logp.grad

    loss, stats, grad = run(garbage)
    clean_loss, clean_stats, clean_grad = run(0.0)
    assert loss.item() == pytest.approx((-1.28 - 1 + 1) / 3)
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert torch.isfinite(grad).all() and grad[0, 2] == 0 and grad[1, 1:].abs().sum() == 0
    for name, value in clean_stats.items():
        torch.testing.assert_close(stats[name], value, msg=name)
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.5) + 1 + 1) / 3)
