"""The DAPO trainer: `DAPOTrainer`, the `GRPOTrainer` subclass whose hooks (`trainer.py`) hand their work to four
sub-packages, with `trl_view.py` handing them what they read of TRL, and `set_up.py` checking a set-up before any
model loads. `configuration/` holds `DAPOConfig` and its checks, `collection/` collects a generation batch,
`training/` runs its passes and the DAPO loss, `safety/` keeps a run safe (checkpoint files, non-finite steps, the
resumed epoch's order); `docs/design.md` draws the map and says where a new piece goes."""

from .configuration import DAPOConfig
from .trainer import DAPOTrainer
from .training import dapo_policy_loss

__all__ = ["DAPOConfig", "DAPOTrainer", "dapo_policy_loss"]
