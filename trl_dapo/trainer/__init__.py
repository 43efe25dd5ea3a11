"""The DAPO trainer: configuration, the pure loss, and the GRPOTrainer subclass that wires them into TRL."""

from .config import DAPOConfig
from .loss import dapo_policy_loss
from .trainer import DAPOTrainer

__all__ = ["DAPOConfig", "DAPOTrainer", "dapo_policy_loss"]
