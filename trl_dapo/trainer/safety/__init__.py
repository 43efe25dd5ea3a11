"""Keeping a run safe: the checkpoint files DAPO adds (written before the Trainer's, read back whole), the step whose
loss or gradient is not finite (skipped, counted), and each epoch's prompt order when a run resumes. It imports
`training` (the micro-batches a checkpoint holds, the skipped update) and `configuration`, never `collection`; only
the trainer's side imports it."""

from .checkpoint_files import (
    SAMPLING_STATE_FILE,
    checkpoint_to_resume,
    load_checkpoint_file,
    load_generation_batch,
    resume_files,
    sampling_state_path,
    save_checkpoint_file,
    save_generation_batch,
)
from .checkpoint_manifest import full_disk_named, write_manifest
from .epoch_order import EpochOrder, set_resumed_epoch
from .finite_steps import FiniteSteps

__all__ = [
    "SAMPLING_STATE_FILE",
    "EpochOrder",
    "FiniteSteps",
    "checkpoint_to_resume",
    "full_disk_named",
    "load_checkpoint_file",
    "load_generation_batch",
    "resume_files",
    "sampling_state_path",
    "save_checkpoint_file",
    "save_generation_batch",
    "set_resumed_epoch",
    "write_manifest",
]
