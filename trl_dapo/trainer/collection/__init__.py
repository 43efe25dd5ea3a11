"""Collecting one generation batch: the collectors (one round, candidate rounds, streamed groups, partial rollouts),
one round through TRL's method, the scoring of a streamed group, and the choice of generation path with the rollout
engine's weights. It imports `configuration` alone of the trainer's parts; the trainer's side (`trainer.py`,
`trl_view.py`, `set_up.py`) imports it, `training` and `safety` never do."""

from .collect import CandidateRounds, Collector, OneRound
from .engine_choice import (
    EngineSetUp,
    EngineWeights,
    check_rollout_precision,
    select_rollout_engine,
    token_sampling,
    unusable_engine,
    why_settings_rule_out_engine,
)
from .partial import PartialCandidateRounds, PartialRoundRunner, PartialRounds
from .round import TRLRounds, round_scores
from .scoring import FilterMetric, GroupScorer
from .strategy import collection_strategy
from .streamed import StreamedGroups
from .vllm_path import check_vllm_server_logprobs, check_vllm_set_up

__all__ = [
    "CandidateRounds",
    "Collector",
    "EngineSetUp",
    "EngineWeights",
    "FilterMetric",
    "GroupScorer",
    "OneRound",
    "PartialCandidateRounds",
    "PartialRoundRunner",
    "PartialRounds",
    "StreamedGroups",
    "TRLRounds",
    "check_rollout_precision",
    "check_vllm_server_logprobs",
    "check_vllm_set_up",
    "collection_strategy",
    "round_scores",
    "select_rollout_engine",
    "token_sampling",
    "unusable_engine",
    "why_settings_rule_out_engine",
]
