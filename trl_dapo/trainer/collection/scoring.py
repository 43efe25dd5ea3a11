"""What a row's rewards become, and how stream mode scores one group on its own rank.

`FilterMetric`: the per-row value dynamic sampling filters groups on, in rounds and in the stream.

`GroupScorer`: stream mode scores each group as its last row ends, on its rank alone, while the other ranks decode.
TRL's `_calculate_rewards` cannot serve there: it gathers the rewards over the ranks (a collective, which ranks
finishing groups at different times would block in) and times itself into the metrics; the way TRL turns completion
ids into what reward functions read is inline in `_generate`, not a method it could call. So the scorer calls each
reward function with what TRL passes it; stream mode refuses at set-up what it would build differently from TRL (a
tokenizer with a response template or schema, whose completions TRL parses rather than decodes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerState
from trl.data_utils import is_conversational

from ...integrity import RolloutIntegrityError, check_rewards

logger = logging.getLogger(__name__)


class FilterMetric:
    """What dynamic sampling filters a row on: one reward function's column (`column`), or the weighted total."""

    def __init__(self, column: int | None, reward_weights: torch.Tensor) -> None:
        self.column, self.reward_weights = column, reward_weights

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.column is None:
            return (rewards * self.reward_weights.to(rewards.device)).nansum(dim=1)
        return rewards[:, self.column]


class GroupScorer:
    """One finished group's rewards on its rank, as TRL scores rows (each reward function with the prompts, the
    completions as text or as one assistant message of the decoded text, their ids, the dataset's columns,
    `trainer_state`, `log_metric` and `log_extra`, whose columns are not kept: a warning says so once), and its filter
    metric. No collective: ranks finish groups at different times."""

    def __init__(
        self,
        functions: list[Callable],
        names: list[str],
        num_task_rewards: int,
        decode: Callable[..., list[str]],
        log_metric: Callable[[str, float], None],
        state: Callable[[], TrainerState],
        filter_metric: FilterMetric,
    ) -> None:
        """`functions` and `names`: the trainer's reward functions, the first `num_task_rewards` of them the task's
        (the overlong penalty follows); `decode`: the processing class's `batch_decode`; `log_metric`: TRL's, handed
        to the reward functions; `state()`: the Trainer's state they get as `trainer_state`."""
        self.functions, self.names = functions, names
        self.tasks = slice(0, num_task_rewards)
        self.decode, self.filter_metric = decode, filter_metric
        self.extra = dict(log_extra=self._log_extra, log_metric=log_metric)
        self.state = state
        self.warned_log_extra = False

    def _log_extra(self, column: str, values: list) -> None:
        """`log_extra` in stream mode: the groups scored are not the rows TRL logs, so the column is not kept."""
        if not self.warned_log_extra:
            logger.warning(
                "A reward function called log_extra(%r, ...): dynamic_sampling_mode='stream' scores groups before "
                "they are kept, so log_extra columns are not logged in stream mode (log_metric is). Use "
                "dynamic_sampling_mode='rounds' to keep them.",
                column,
            )
            self.warned_log_extra = True

    def __call__(
        self, rows: list[dict[str, Any]], prompt_ids: list[int], completion_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = [row["prompt"] for row in rows]
        texts = self.decode(completion_ids, skip_special_tokens=True)
        completions = (
            [[{"role": "assistant", "content": text}] for text in texts]
            if is_conversational({"prompt": prompts[0]})
            else texts
        )
        columns = {
            key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")
        }
        rewards = torch.full((len(rows), len(self.functions)), torch.nan)
        for column, function in enumerate(self.functions):
            values = function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                trainer_state=self.state(), **self.extra,
            )  # fmt: skip
            if len(values) != len(rows):
                raise RolloutIntegrityError(
                    f"reward function {self.names[column]!r} returned {len(values)} rewards for {len(rows)} "
                    "completions; each completion needs one."
                )
            rewards[:, column] = torch.tensor([torch.nan if v is None else float(v) for v in values])
        check_rewards(rewards[:, self.tasks], len(rows), self.names[self.tasks])
        return rewards, self.filter_metric(rewards)
