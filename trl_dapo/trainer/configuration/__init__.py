"""Configuration and the checks that need no model: `DAPOConfig` (its fields' types and ranges, the `GRPOConfig`
fields it honours, its choices, its batch sizes, activation checkpointing under transformers' new names), each
prompt's check, the warning for bf16 emulated on a CPU, the type-and-range rules a script's own arguments reuse
(`Rule`, `check_rules`, `short_repr`), and `TRLView`, the built trainer's values the other sub-packages read;
`reference.py`, run as a script, writes the config's reference page from them. It imports none of the trainer's other
modules: every other part may import it."""

from .checkpointing import quiet_trl_checkpointing_calls
from .choices import CORRECTION_MODES
from .config import DAPOConfig
from .cpu_bf16 import warn_if_cpu_bf16_is_emulated
from .field_rules import Rule, check_rules, short_repr
from .prompts import check_batch_prompts, check_dataset_prompts, check_prompt_ids, prompt_token_limit
from .view import TRLView

__all__ = [
    "CORRECTION_MODES",
    "DAPOConfig",
    "Rule",
    "TRLView",
    "check_batch_prompts",
    "check_dataset_prompts",
    "check_prompt_ids",
    "check_rules",
    "prompt_token_limit",
    "quiet_trl_checkpointing_calls",
    "short_repr",
    "warn_if_cpu_bf16_is_emulated",
]
