"""trl-dapo: DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) on TRL's GRPOTrainer.

The names below load the trainer (and with it torch, transformers and TRL) on first use, so a module of the package
that needs none of them starts in a fraction of a second (`python -m trl_dapo.smollm2` prints a path).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import DAPOConfig, DAPOTrainer, dapo_policy_loss

__version__ = "0.1.0"
__all__ = ["DAPOConfig", "DAPOTrainer", "__version__", "dapo_policy_loss"]
_TRAINER_NAMES = ("DAPOConfig", "DAPOTrainer", "dapo_policy_loss")


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        return getattr(importlib.import_module(".trainer", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
