"""Activation checkpointing under the names transformers now reads, so a correct run prints none of its deprecation
warnings.

transformers 5.25 renamed `gradient_checkpointing` (and `_kwargs`) to `activation_checkpointing` (`transformers>=5.0`
admits versions with either) and warns when a config sets the old name but not the new one. TRL's configs set the old
one (default True), so every run warned: `hand_on_checkpointing` gives its value to the new name before
`TrainingArguments` looks, as transformers itself would, minus the warning. Where transformers has no new name there
is nothing to do.

TRL 1.16 reads the model's `is_gradient_checkpointing` and calls `gradient_checkpointing_disable`/`_enable` around
each generation and no-grad scoring pass, each a deprecated alias that warns, and no argument avoids those calls:
`quiet_trl_checkpointing_calls` hides exactly these three messages, no other warning.
"""

from __future__ import annotations

import warnings
from typing import Any

ALIASES = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)
TRL_CALLS = r"`(is_gradient_checkpointing|gradient_checkpointing_disable|gradient_checkpointing_enable)` is deprecated"


def hand_on_checkpointing(config: Any) -> None:
    """The old names' values on the new names, where transformers has them and they are unset."""
    for old, new in ALIASES:
        if hasattr(config, new) and getattr(config, new) is None and getattr(config, old) is not None:
            setattr(config, new, getattr(config, old))


def quiet_trl_checkpointing_calls() -> None:
    """Hide transformers' FutureWarning for the three aliases TRL calls (matched by message, category and module)."""
    warnings.filterwarnings(
        "ignore", message=TRL_CALLS, category=FutureWarning, module=r"transformers\.modeling_utils"
    )
