"""Metrics of the batch that is trained rather than of a candidate round: TRL's completion and reward metrics, and
DAPO's rollout metrics.

TRL logs its own inside `_generate_and_score_completions`, once per call: with dynamic sampling that is once per
candidate round, filtered groups included. DAPOTrainer removes those entries and logs these instead, with the same
names and definitions (TRL 1.16, `sum_then_normalize` aggregation with per-group statistics, the only one dynamic
sampling allows), over the accepted groups. DAPO's rollout metrics (`rollout_metrics`) are computed once per
generation batch over the same rows, whatever the mode, with the age of the policies that sampled them.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd

from ...rewards.overlong import OVERLONG_REWARD_NAME
from ...rollout_batch import SAMPLING_STEP, RolloutBatch, loss_mask, rollout_logprobs

COMPLETION_METRICS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)
REWARD_METRICS = ("reward", "reward_std", "frac_reward_zero_std")


def trained_batch_metric_names(reward_func_names: list[str]) -> list[str]:
    per_function = [f"rewards/{name}/{stat}" for name in reward_func_names for stat in ("mean", "std")]
    return [*COMPLETION_METRICS, *per_function, *REWARD_METRICS]


def trained_batch_metrics(
    batch: RolloutBatch, reward_weights: torch.Tensor, reward_func_names: list[str], num_generations: int
) -> dict[str, torch.Tensor]:
    """The metrics of `trained_batch_metric_names` for a global batch of whole groups, as device scalars."""
    lengths = batch["completion_lengths"].float()
    terminated = ~batch["truncated"]
    count = terminated.sum()
    none_terminated = count == 0
    metrics = {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/clipped_ratio": batch["truncated"].float().mean(),
        # like TRL: 0 when no completion terminated
        "completions/mean_terminated_length": (lengths * terminated).sum() / count.clamp(min=1),
        "completions/min_terminated_length": torch.where(
            none_terminated, 0.0, torch.where(terminated, lengths, torch.inf).min()
        ),
        "completions/max_terminated_length": torch.where(
            none_terminated, 0.0, torch.where(terminated, lengths, -torch.inf).max()
        ),
    }
    rewards_per_func = batch["rewards"]
    for column, name in enumerate(reward_func_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, column])
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, column])
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func.device)).nansum(dim=1)
    rewards = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, rewards)  # unscorable rows, as TRL
    group_std = nanstd(rewards.view(-1, num_generations), dim=1)
    metrics["reward"] = torch.nanmean(rewards)
    metrics["reward_std"] = nanstd(rewards)
    metrics["frac_reward_zero_std"] = torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()
    return metrics


def rollout_metrics(
    batch: RolloutBatch, reward_func_names: list[str], step: int, num_generations: int
) -> dict[str, torch.Tensor]:
    """DAPO's metrics of the rollout for a global batch trained from optimizer step `step` on, as device scalars: the
    mean logprob of the trained tokens under the policy that sampled them, the share of completions cut at the length
    limit, the mean overlong penalty, and how old the policies that sampled them are (surplus groups and partial
    rollouts train tokens an earlier step's weights sampled): the share of such tokens, the mean age of a trained
    token in optimizer steps, and the mean and largest age of a trained group (since its first token was sampled)."""
    mask = loss_mask(batch)
    tokens = mask.sum().clamp(min=1)
    age = (step - batch[SAMPLING_STEP]) * mask
    first_sampled = torch.where(mask.bool(), batch[SAMPLING_STEP], step).amin(dim=1)
    group_age = (step - first_sampled.view(-1, num_generations).amin(dim=1)).float()
    metrics = {
        "rollout_logprobs_mean": (rollout_logprobs(batch) * mask).sum() / tokens,
        "dapo/truncated_ratio": batch["truncated"].float().mean(),
        "dapo/old_policy_token_share": (age > 0).sum() / tokens,
        "dapo/token_age_mean": age.sum() / tokens,
        "dapo/trained_group_age_mean": group_age.mean(),
        "dapo/trained_group_age_max": group_age.max(),
    }
    if OVERLONG_REWARD_NAME in reward_func_names:
        column = reward_func_names.index(OVERLONG_REWARD_NAME)
        metrics["dapo/overlong_penalty_mean"] = batch["rewards"][:, column].mean()
    return metrics


def append_metrics(metrics: dict[str, list[float]], values: dict[str, float | torch.Tensor]) -> None:
    """Append to TRL's metric lists (averaged per logging window by its `log`); values held on the device are read
    back in one host synchronisation (each `.item()` would be one)."""
    on_device = [name for name, value in values.items() if isinstance(value, torch.Tensor)]
    read = (
        dict(zip(on_device, torch.stack([values[n].float().reshape(()) for n in on_device]).tolist(), strict=True))
        if on_device
        else {}
    )
    for name, value in values.items():
        metrics[name].append(float(read.get(name, value)))
