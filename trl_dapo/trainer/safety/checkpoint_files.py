"""The files DAPOTrainer adds to a checkpoint beside the Trainer's, writing them safely, reading them back, and which
checkpoint `resume_from_checkpoint=True` resumes from.

`dapo_sampling_state.pt` (the trainer writes it) holds the dynamic-sampling surplus, the extra-prompt stream's
position, the skipped-step counts and that its save writes a manifest. A checkpoint saved inside a generation batch
(`steps_per_generation` larger than `gradient_accumulation_steps`, a save step inside it) also holds, per process,
the micro-batches that process has yet to train: resumed, the run trains them before it generates the next batch,
as the run that saved them would have.
Every file is read with `weights_only=True`; one that cannot be read, or lacks a field, is an error naming it, never a
suggestion to load it unsafely (`resume_checks.py`).

A save can be killed half-way, or the power lost. DAPO's files are written first, each under a temporary name renamed
once written whole and synced; then the Trainer's; then the manifest of every file (`checkpoint_manifest.py`), the
files and folder synced before it; only then are older checkpoints deleted (`save_total_limit`). So a checkpoint is
complete when its files match its manifest, and an older one is never deleted before a newer one is complete. A
checkpoint saved before manifests existed (an earlier trl-dapo, or TRL's Trainer) is checked by name: a
`trainer_state.json` holding a Trainer state (a `global_step` of 0 or more) and the files a resume reads; one whose
sampling state says its save writes a manifest, found without it, was interrupted.

`resume_from_checkpoint=True` passes over incomplete checkpoints for the newest complete one, whose steps the run then
trains and saves again. It never passes over one it cannot judge or would lose: a damaged manifest (written whole or
not at all, so damaged after the save) stops the run, naming the checkpoint and how to repair or move it, and so does
a checkpoint saved whole but changed since when no complete one is left: training from step 0 would delete it
(`save_total_limit`) or overwrite it.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..training import MicroBatch, micro_batch_states, micro_batches_from_states
from .checkpoint_manifest import MANIFEST_FILE, fsync_path, full_disk_named, manifest_mismatches, read_manifest
from .resume_checks import fields_named, load_checkpoint_file

logger = logging.getLogger(__name__)

SAMPLING_STATE_FILE = "dapo_sampling_state.pt"
GENERATION_BATCH_FILE = "dapo_generation_batch_{rank}.pt"
GENERATION_BATCH_FIELDS = ("position", "processes", "micro_batches")
TRAINER_STATE_FILE = "trainer_state.json"  # the Trainer's, written after its other files


def save_checkpoint_file(value: object, path: str) -> None:
    """`torch.save` under a temporary name, synced, renamed to `path` and the folder synced: a save killed or a power
    lost half-way leaves no truncated file by the name a resume reads. A full disk is an error naming `path`."""
    partial = f"{path}.partial"
    try:
        with full_disk_named(path):
            torch.save(value, partial)
        fsync_path(partial)
        os.replace(partial, path)
        fsync_path(os.path.dirname(path) or ".")
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@contextlib.contextmanager
def older_checkpoints_kept(trainer: Any) -> Iterator[None]:
    """The Trainer's save ends deleting older checkpoints (`save_total_limit`): while it runs, the trainer's own `args`
    (a copy of the caller's) are swapped for a copy without the limit, so they go only after the manifest."""
    args = trainer.args
    trainer.args = copy.copy(args)
    trainer.args.save_total_limit = None
    try:
        yield
    finally:
        trainer.args = args


def why_incomplete(checkpoint: str, resume_files: tuple[str, ...]) -> str | None:
    """What is wrong with `checkpoint` for a resume, or None when it is complete: its files against its manifest, or,
    saved before manifests, a Trainer state and each of `resume_files` (glob patterns) present."""
    state = trainer_state_problem(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is not None:
        return "; ".join(manifest_mismatches(checkpoint, manifest)) or state
    if state:
        return state
    missing = [pattern for pattern in resume_files if not glob.glob(os.path.join(glob.escape(checkpoint), pattern))]
    if missing:
        return f"no {', '.join(missing)}"
    if _writes_manifest(checkpoint):
        return f"no {MANIFEST_FILE}: the save was interrupted before its end"
    return None


def trainer_state_problem(checkpoint: str) -> str | None:
    """What keeps `checkpoint`'s trainer_state.json from being a Trainer state, or None."""
    path = os.path.join(checkpoint, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        return f"no {TRAINER_STATE_FILE}"
    try:
        with open(path) as file:
            state = json.load(file)
    except ValueError:
        return f"{TRAINER_STATE_FILE} cut short"
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return f"{TRAINER_STATE_FILE} holds no Trainer state (no global_step)"
    if step < 0:  # the Trainer would train from it up to max_steps: more steps than asked for
        return f"{TRAINER_STATE_FILE} holds global_step={step}, below 0"
    return None


def _writes_manifest(checkpoint: str) -> bool:
    """Whether the save that wrote `checkpoint`'s sampling state (written first) writes a manifest last."""
    path = os.path.join(checkpoint, SAMPLING_STATE_FILE)
    try:
        return os.path.isfile(path) and torch.load(path, weights_only=True).get("writes_manifest", False)
    except Exception:  # unreadable: a save killed while writing it (before manifests: left for the load to name)
        return False


def newest_complete_checkpoint(output_dir: str, resume_files: tuple[str, ...]) -> tuple[str | None, str | None]:
    """The checkpoint `resume_from_checkpoint=True` resumes from: the highest-numbered complete one in `output_dir`
    (`why_incomplete`, with the sampling state among `resume_files`), or None where there is none (training starts
    from step 0, as a restarted job's first launch needs); and the warning to log where incomplete ones were skipped
    or none was found."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    numbered = sorted(((int(m.group(1)), name) for name in names if (m := pattern.match(name))), reverse=True)
    folders = [path for _, name in numbered if os.path.isdir(path := os.path.join(output_dir, name))]
    skipped, saved_whole = [], []
    for folder in folders:
        reason = why_incomplete(folder, resume_files)
        if reason is None:
            warning = None
            if skipped:
                warning = (
                    f"resume_from_checkpoint=True: resuming from {folder}, the newest complete checkpoint; skipped as "
                    f"incomplete: {', '.join(skipped)}. A save was interrupted or its files changed since: the run "
                    "overwrites such a folder when it saves the same step again."
                )
            return folder, warning
        skipped.append(f"{folder} ({reason})")
        if read_manifest(folder) is not None:
            saved_whole.append(skipped[-1])
    if saved_whole:  # training from step 0 would delete them (save_total_limit) or overwrite them
        raise ValueError(
            f"resume_from_checkpoint=True found no complete checkpoint in output_dir={output_dir!r}, and "
            f"{'these were' if len(saved_whole) > 1 else 'this one was'} saved whole (a {MANIFEST_FILE} lists its "
            f"files) but changed since: {', '.join(saved_whole)}. Starting from step 0 would delete or overwrite "
            "it. Restore the files named, or move the folder out of output_dir to start from step 0 (its weights "
            "can start a new run: model=<the folder>)."
        )
    found = f"; skipped as incomplete: {', '.join(skipped)}" if skipped else ""
    kind = "complete checkpoint" if skipped else "checkpoint"
    return None, (
        f"resume_from_checkpoint=True found no {kind} in output_dir={output_dir!r}{found}: training starts from step 0."
    )


def checkpoint_to_resume(
    requested: str | bool | None, output_dir: str, resume_files: tuple[str, ...]
) -> tuple[str | bool | None, list[str]]:
    """The checkpoint a resume reads and the warnings to log: with True the newest complete one in `output_dir`
    (none: None, step 0); a path is refused with the reason where it is incomplete. `resume_files`: the Trainer's
    files a resume reads on this set-up, checked where a checkpoint has no manifest."""
    if requested is True:
        checkpoint, warning = newest_complete_checkpoint(output_dir, (*resume_files, SAMPLING_STATE_FILE))
        warnings = [warning] if warning else []
    elif isinstance(requested, str | os.PathLike):
        checkpoint, warnings = os.fspath(requested), []
        if reason := why_incomplete(checkpoint, resume_files):
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} is not a complete checkpoint: {reason}. Resume from another "
                "checkpoint (resume_from_checkpoint=True takes the newest complete one in output_dir)."
            )
    else:
        return requested, []
    if checkpoint is not None and read_manifest(checkpoint) is None:
        warnings.append(
            f"resume_from_checkpoint={checkpoint!r} has no {MANIFEST_FILE} (saved by an earlier trl-dapo or by TRL): "
            "its files are checked by name only, not by size."
        )
    return checkpoint, warnings


def resume_files(save_only_model: bool, sharded: bool) -> tuple[str, ...]:
    """The Trainer's files a resume reads on this set-up (DeepSpeed and FSDP keep the optimizer their own way),
    checked in a checkpoint saved without a manifest."""
    if save_only_model:
        return ()
    if sharded:
        return ("rng_state*.pth",)
    return (OPTIMIZER_NAME, SCHEDULER_NAME, "rng_state*.pth")


def sampling_state_path(checkpoint: str | None, needed: bool) -> str | None:
    """The checkpoint's `SAMPLING_STATE_FILE` (None without a checkpoint); its absence is an error where dynamic
    sampling or partial rollouts would otherwise restart their state from zero."""
    path = os.path.join(checkpoint, SAMPLING_STATE_FILE) if checkpoint else None
    if path and needed and not os.path.exists(path):
        raise FileNotFoundError(
            f"resume_from_checkpoint={checkpoint!r} has no {SAMPLING_STATE_FILE} (a GRPOTrainer checkpoint, or "
            "not saved by DAPOTrainer): with dynamic_sampling=True or partial_rollouts=True, resuming would "
            "restart the surplus and carried groups, the extra-prompt stream (its prompts drawn again from the "
            "start) and dapo/skipped_steps from zero. Resume from a checkpoint DAPOTrainer saved, start a new run "
            "from its weights (model=<the checkpoint folder>), or resume with dynamic_sampling=False and "
            "partial_rollouts=False."
        )
    return path


SAMPLING_STATE_WAY_ON = (
    "Resume from an earlier checkpoint of this run, or start a new run from this checkpoint's weights (model=<the "
    "checkpoint folder>); with dynamic_sampling=False and partial_rollouts=False, delete the file and resume (it "
    "holds the dynamic-sampling surplus, the carried groups of partial rollouts, the extra-prompt stream's position "
    "and dapo/skipped_steps)."
)


@contextlib.contextmanager
def read_sampling_state(path: str, checkpoint: str) -> Iterator[dict]:
    """The checkpoint's `SAMPLING_STATE_FILE`, to apply inside the block: a field it lacks (a `KeyError` there) is an
    error naming it, as is a file that cannot be read."""
    state = load_checkpoint_file(path, checkpoint, SAMPLING_STATE_WAY_ON, ("buffer", "prompt_stream", "skipped_steps"))
    with fields_named(SAMPLING_STATE_FILE, checkpoint, SAMPLING_STATE_WAY_ON):
        yield state


def load_carried(carried: Any, every_rank: list[dict] | None, checkpoint: str, accelerator: Accelerator) -> None:
    """Each rank's carried groups (partial rollouts: `carried`, None without) back from the checkpoint, dealt anew on
    another number of ranks; a checkpoint saved without partial rollouts has none, which a resumed run with them
    starts from, as the log says."""
    if carried is None:
        return
    if every_rank is None:
        logger.warning(
            "resume_from_checkpoint=%r was saved without partial rollouts: no groups are carried into the first "
            "generation batch after it.",
            checkpoint,
        )
        return
    carried.load_state_dict(every_rank, accelerator.process_index, accelerator.num_processes)


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
    batch = load_checkpoint_file(path, checkpoint, without_it, GENERATION_BATCH_FIELDS, device=accelerator.device)
    if batch["processes"] != accelerator.num_processes:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} was saved inside a generation batch on {batch['processes']} "
            f"processes, each holding its share of it: resume on {batch['processes']} processes, or delete its "
            f"{GENERATION_BATCH_FILE.format(rank='*')} files to draw a new generation batch at this step."
        )
    with fields_named(name, checkpoint, without_it):
        return micro_batches_from_states(batch["micro_batches"]), batch["position"]
