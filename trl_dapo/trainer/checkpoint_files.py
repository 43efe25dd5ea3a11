"""The files DAPOTrainer adds to a checkpoint beside the Trainer's, and reading them back.

`dapo_sampling_state.pt` (the trainer writes it) holds the dynamic-sampling surplus, the extra-prompt stream's
position and the skipped-step count. A checkpoint saved inside a generation batch (`steps_per_generation` larger than
`gradient_accumulation_steps`, a save step inside it) also holds, per process, the micro-batches that process has yet
to train: resumed, the run trains them before it generates the next batch, as the run that saved them would have.
Every file is read with `weights_only=True`; one that cannot be read is an error naming it, never a suggestion to
load it unsafely.
"""

from __future__ import annotations

import logging
import os

import torch
from accelerate import Accelerator

from .micro_batches import MicroBatch, micro_batch_states, micro_batches_from_states

logger = logging.getLogger(__name__)

GENERATION_BATCH_FILE = "dapo_generation_batch_{rank}.pt"


def load_checkpoint_file(path: str, checkpoint: str, without_it: str, device: str | torch.device = "cpu") -> dict:
    """A file DAPOTrainer saved with `checkpoint`, as tensors and plain values only; one that cannot be read is an
    error naming it and the checkpoint, and how to go on without it (`without_it`)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # truncated (EOFError, RuntimeError), damaged or foreign (UnpicklingError)
        raise RuntimeError(
            f"{os.path.basename(path)} of resume_from_checkpoint={checkpoint!r} cannot be read "
            f"({type(error).__name__}): the file is truncated, damaged or not one DAPOTrainer wrote. {without_it}"
        ) from None


def save_generation_batch(
    folder: str, accelerator: Accelerator, position: int, micro_batches: list[MicroBatch]
) -> None:
    """This process's `micro_batches`, `position` of them trained, into the checkpoint `folder` (every process)."""
    os.makedirs(folder, exist_ok=True)
    batch = {
        "position": position,
        "processes": accelerator.num_processes,
        "micro_batches": micro_batch_states(micro_batches),
    }
    torch.save(batch, os.path.join(folder, GENERATION_BATCH_FILE.format(rank=accelerator.process_index)))


def load_generation_batch(
    checkpoint: str, accelerator: Accelerator, inside_batch: bool
) -> tuple[list[MicroBatch], int] | None:
    """This process's saved micro-batches and how many were trained, or None where the checkpoint has none (saved
    between generation batches; or inside one by an earlier version, said in a warning: a new batch is drawn)."""
    name = GENERATION_BATCH_FILE.format(rank=accelerator.process_index)
    path = os.path.join(checkpoint, name)
    if not os.path.exists(path):
        if inside_batch:
            logger.warning(
                "resume_from_checkpoint=%r was saved inside a generation batch without its micro-batches (%s): a new "
                "generation batch is drawn now, and the rest of the saved one is not trained.",
                checkpoint,
                name,
            )
        return None
    without_it = (
        "Delete it to resume with a new generation batch drawn at this step (the rest of the saved one is not "
        "trained), or resume from an earlier checkpoint."
    )
    batch = load_checkpoint_file(path, checkpoint, without_it, device=accelerator.device)
    if batch["processes"] != accelerator.num_processes:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} was saved inside a generation batch on {batch['processes']} "
            f"processes, each holding its share of it: resume on {batch['processes']} processes, or delete its "
            f"{GENERATION_BATCH_FILE.format(rank='*')} files to draw a new generation batch at this step."
        )
    return micro_batches_from_states(batch["micro_batches"]), batch["position"]
