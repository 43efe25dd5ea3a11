"""trl-dapo: DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) on TRL's GRPOTrainer."""

from .trainer import DAPOConfig, DAPOTrainer, dapo_policy_loss

__version__ = "0.1.0"
__all__ = ["DAPOConfig", "DAPOTrainer", "__version__", "dapo_policy_loss"]
