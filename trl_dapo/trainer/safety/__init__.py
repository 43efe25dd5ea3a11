"""Keeping a run safe: the checkpoint files DAPO adds (written before the Trainer's, read back whole), the step whose
loss or gradient is not finite (skipped, counted), and each epoch's prompt order when a run resumes. It imports
`training` (the micro-batches a checkpoint holds, the skipped update) and `configuration`, never `collection`; only
the trainer's side imports it."""

from .checkpoint_files import (
    SAMPLING_STATE_FILE,
    checkpoint_to_resume,
    load_carried,
    load_generation_batch,
    older_checkpoints_kept,
    read_sampling_state,
    resume_files,
    sampling_state_path,
    save_checkpoint_file,
    save_generation_batch,
)
from .checkpoint_manifest import full_disk_named, write_manifest
from .epoch_order import EpochOrder, set_resumed_epoch
from .finite_steps import FiniteSteps
from .resume_checks import MissingTensors, check_trainer_files, trainer_files, untied_missing_keys, weights_named

__all__ = [
    "SAMPLING_STATE_FILE",
    "EpochOrder",
    "FiniteSteps",
    "MissingTensors",
    "check_trainer_files",
    "checkpoint_to_resume",
    "full_disk_named",
    "load_carried",
    "load_generation_batch",
    "older_checkpoints_kept",
    "read_sampling_state",
    "resume_files",
    "sampling_state_path",
    "save_checkpoint_file",
    "save_generation_batch",
    "set_resumed_epoch",
    "trainer_files",
    "untied_missing_keys",
    "weights_named",
    "write_manifest",
]
