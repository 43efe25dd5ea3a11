"""Each integrity check rejects its bad input with an error naming the field."""

import math

import numpy as np
import pytest
import torch

from trl_dapo.integrity import (
    MAX_ABS_REWARD,
    RolloutIntegrityError,
    check_completions,
    check_groups,
    check_reward_values,
    check_rewards,
    check_weighted_total,
)

NAMES = ["accuracy", "overlong_penalty"]


def test_good_rewards_pass_including_nan_for_a_function_that_does_not_apply():
    check_rewards(torch.tensor([[1.0, math.nan], [0.0, -0.5]]), 2, NAMES)


@pytest.mark.parametrize(
    ("rewards", "count", "message"),
    [
        (torch.tensor([[1.0, 0.0]]), 2, "rewards: got shape"),
        (torch.tensor([[1.0, math.inf], [0.0, 0.0]]), 2, "'overlong_penalty' returned inf for completion 0"),
        (torch.tensor([[1.0, 0.0], [math.nan, math.nan]]), 2, r"rewards: completion 1 got no reward"),
        (torch.tensor([[math.nan, math.nan]] * 3), 3, r"rewards: completion 0 \(and 2 more\) got no reward"),
    ],
)
def test_bad_rewards(rewards, count, message):
    with pytest.raises(RolloutIntegrityError, match=message):
        check_rewards(rewards, count, NAMES)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (10**400, r"'judge' returned 1.000e\+400 for completion 1; rewards beyond ±1e\+15"),
        (-(10**15) - 1, r"'judge' returned -1000000000000001 for completion 1; rewards beyond"),
        (1.00000001e15, r"'judge' returned 1000000010000000.0 for completion 1; rewards beyond"),
        (np.float64(-2e15), r"'judge' returned -2000000000000000.0 for completion 1"),
        (torch.tensor(math.inf), r"'judge' returned inf for completion 1; return a finite number"),
    ],
    ids=["10**400", "an int past the bound", "rounded to the bound by float32", "numpy", "an infinite tensor"],
)
def test_reward_values_are_compared_before_the_float32_cast(value, message):
    """float32 rounds 1.00000001e15 to 1e15 and 10**400 does not convert: each is named as the function returned
    it."""
    assert torch.tensor(1.00000001e15, dtype=torch.float32).item() <= MAX_ABS_REWARD  # what the cast hid
    check_reward_values([1.0, 10**15, -1e15, None, math.nan, np.True_, torch.tensor(2.0)], "judge")
    with pytest.raises(RolloutIntegrityError, match=message):
        check_reward_values([0.0, value], "judge")


def test_groups_must_be_whole_and_hold_one_prompt():
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    check_groups(prompts, mask, 2)
    with pytest.raises(RolloutIntegrityError, match="prompt_ids: 4 rows is not a whole number"):
        check_groups(prompts, mask, 3)
    with pytest.raises(RolloutIntegrityError, match="prompt_ids: group 0 mixes prompts"):
        check_groups(prompts, mask, 4)


def test_padding_differences_do_not_count_as_different_prompts():
    prompts = torch.tensor([[9, 5, 6], [0, 5, 6]])  # same prompt, different pad value left of the mask
    check_groups(prompts, torch.tensor([[0, 1, 1], [0, 1, 1]]), 2)


def test_completion_alignment_and_finite_logprobs():
    ids = torch.tensor([[4, 5, 0], [6, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logps = torch.tensor([[-1.0, -2.0, math.nan], [-0.5, math.inf, 0.0]])  # non-finite only on padding
    check_completions(ids, mask, logps)
    with pytest.raises(RolloutIntegrityError, match="completion_mask: shape"):
        check_completions(ids, mask[:, :2], logps)
    with pytest.raises(RolloutIntegrityError, match="old_per_token_logps: shape"):
        check_completions(ids, mask, logps[:, :2])
    with pytest.raises(RolloutIntegrityError, match="completion_mask: row 1 has active tokens after padding"):
        check_completions(ids, torch.tensor([[1, 1, 0], [1, 0, 1]]), logps.nan_to_num())
    bad = logps.clone()
    bad[0, 1] = math.nan
    with pytest.raises(RolloutIntegrityError, match="old_per_token_logps: value nan at completion 0, token 1"):
        check_completions(ids, mask, bad)


def test_a_weighted_total_beyond_the_bound_is_refused_naming_the_weights():
    rewards = torch.tensor([[1e10, 0.0], [0.0, 1.0]])
    check_weighted_total(rewards, torch.tensor([1.0, 1.0]))  # within the bound
    with pytest.raises(RolloutIntegrityError, match=r"completion 0's weighted reward 1e\+20 .* reward_weights"):
        check_weighted_total(rewards, torch.tensor([1e10, 1.0]))
