"""Which collector a config asks for: the one choice among the collection strategies, read by the set-up checks
(each strategy's own `check`) and by the trainer's side, which builds the collector (`trl_view.collector`)."""

from __future__ import annotations

from ..configuration import DAPOConfig
from .collect import CandidateRounds, Collector, OneRound
from .partial import PartialCandidateRounds, PartialRounds
from .streamed import StreamedGroups


def collection_strategy(args: DAPOConfig) -> type[Collector]:
    """The collector `dynamic_sampling`, `dynamic_sampling_mode` and `partial_rollouts` ask for (`collect.py`)."""
    if not args.dynamic_sampling:
        return PartialRounds if args.partial_rollouts else OneRound
    if args.dynamic_sampling_mode == "rounds":
        return PartialCandidateRounds if args.partial_rollouts else CandidateRounds
    return StreamedGroups  # which carries the rows in flight itself with partial rollouts
