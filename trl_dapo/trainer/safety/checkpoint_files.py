"""The files DAPOTrainer adds to a checkpoint beside the Trainer's, writing them safely, reading them back, and which
checkpoint `resume_from_checkpoint=True` resumes from.

`dapo_sampling_state.pt` (the trainer writes it) holds the dynamic-sampling surplus, the extra-prompt stream's
position and the skipped-step count. A checkpoint saved inside a generation batch (`steps_per_generation` larger than
`gradient_accumulation_steps`, a save step inside it) also holds, per process, the micro-batches that process has yet
to train: resumed, the run trains them before it generates the next batch, as the run that saved them would have.
Every file is read with `weights_only=True`; one that cannot be read is an error naming it, never a suggestion to
load it unsafely.

A save can be killed half-way. DAPO's files are written before the Trainer's and each reaches its name only once
written whole (a temporary name, then a rename); the Trainer writes `trainer_state.json` after its other files and
only then deletes older checkpoints (`save_total_limit`). So a checkpoint with a readable `trainer_state.json` and the
sampling state holds every file a resume reads, and an older one is never deleted before a newer one is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from accelerate import Accelerator
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..training import MicroBatch, micro_batch_states, micro_batches_from_states

logger = logging.getLogger(__name__)

SAMPLING_STATE_FILE = "dapo_sampling_state.pt"
GENERATION_BATCH_FILE = "dapo_generation_batch_{rank}.pt"
TRAINER_STATE_FILE = "trainer_state.json"  # the Trainer's, written after its other files


def save_checkpoint_file(value: object, path: str) -> None:
    """`torch.save` under a temporary name, renamed to `path` once written: a save killed half-way leaves no
    truncated file by the name a resume reads."""
    partial = f"{path}.partial"
    try:
        torch.save(value, partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def why_incomplete(checkpoint: str) -> str | None:
    """What `checkpoint` lacks for a resume (a save killed before its end), or None when it is complete."""
    state = os.path.join(checkpoint, TRAINER_STATE_FILE)
    if not os.path.isfile(state):
        return f"no {TRAINER_STATE_FILE}"
    try:
        with open(state) as file:
            json.load(file)
    except ValueError:
        return f"{TRAINER_STATE_FILE} cut short"
    if not os.path.isfile(os.path.join(checkpoint, SAMPLING_STATE_FILE)):
        return f"no {SAMPLING_STATE_FILE}"
    return None


def newest_complete_checkpoint(output_dir: str) -> tuple[str | None, str | None]:
    """The checkpoint `resume_from_checkpoint=True` resumes from: the highest-numbered complete one in `output_dir`,
    or None where there is none (training starts from step 0, as a restarted job's first launch needs); and the
    warning to log where incomplete ones were skipped or none was found."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    numbered = sorted(((int(m.group(1)), name) for name in names if (m := pattern.match(name))), reverse=True)
    folders = [path for _, name in numbered if os.path.isdir(path := os.path.join(output_dir, name))]
    skipped = []
    for folder in folders:
        reason = why_incomplete(folder)
        if reason is None:
            warning = None
            if skipped:
                warning = (
                    f"resume_from_checkpoint=True: resuming from {folder}, the newest complete checkpoint; skipped as "
                    f"incomplete: {', '.join(skipped)}. A save was interrupted: the run overwrites that folder when "
                    "it saves the same step again."
                )
            return folder, warning
        skipped.append(f"{folder} ({reason})")
    found = f"; skipped as incomplete: {', '.join(skipped)}" if skipped else ""
    kind = "complete checkpoint" if skipped else "checkpoint"
    return None, (
        f"resume_from_checkpoint=True found no {kind} in output_dir={output_dir!r}{found}: training starts from step 0."
    )


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
    save_checkpoint_file(batch, os.path.join(folder, GENERATION_BATCH_FILE.format(rank=accelerator.process_index)))


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
