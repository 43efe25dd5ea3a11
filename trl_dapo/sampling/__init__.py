"""Dynamic sampling: group filters, the buffer that fills a generation batch with informative groups, the stream that
scores groups as they end (`stream.py`) and its state across batches (`stream_state.py`), and the prompt stream for
extra prompts. Nothing here imports the trainer."""

from .buffer import DynamicSamplingBuffer, DynamicSamplingLimitError, full_pass_message, plan_round_groups
from .filters import GroupFilter, filter_groups, group_outcomes, solve_rate
from .prompt_stream import IterablePromptStream, PromptStream, make_prompt_stream
from .stats import GenerationStats, SamplingStats

__all__ = [
    "DynamicSamplingBuffer",
    "DynamicSamplingLimitError",
    "GenerationStats",
    "GroupFilter",
    "IterablePromptStream",
    "PromptStream",
    "SamplingStats",
    "filter_groups",
    "full_pass_message",
    "group_outcomes",
    "make_prompt_stream",
    "plan_round_groups",
    "solve_rate",
]
