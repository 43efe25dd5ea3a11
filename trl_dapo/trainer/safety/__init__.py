"""Keeping a run safe: the checkpoint files DAPO adds (written before the Trainer's, read back whole), the step whose
loss or gradient is not finite (skipped, counted), and each epoch's prompt order when a run resumes. It imports
`training` (the micro-batches a checkpoint holds, the skipped update) and `configuration`, never `collection`; only
the trainer's side imports it."""

from .checkpoint_files import (
    SAMPLING_STATE_FILE,
    load_checkpoint_file,
    load_generation_batch,
    newest_complete_checkpoint,
    save_checkpoint_file,
    save_generation_batch,
)
from .epoch_order import EpochOrder, set_resumed_epoch
from .finite_steps import FiniteSteps

__all__ = [
    "SAMPLING_STATE_FILE",
    "EpochOrder",
    "FiniteSteps",
    "load_checkpoint_file",
    "load_generation_batch",
    "newest_complete_checkpoint",
    "save_checkpoint_file",
    "save_generation_batch",
    "set_resumed_epoch",
]
