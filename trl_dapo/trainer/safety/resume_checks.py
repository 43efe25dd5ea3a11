"""Reading a checkpoint back: every file a resume reads is checked before its values are used, and a file that cannot
be used is an error naming it, the checkpoint, the field and the way on, never torch's or safetensors' bare
exception (a `KeyError: 'param_groups'`, "PytorchStreamReader failed", torch's advice to load with
`weights_only=False`, which would run code from the file).

What a checkpoint lacks is never dropped silently: a missing tensor is an error (a tied one, which a save stores
once, is no loss and no longer logged as missing), and a checkpoint without the optimizer, scheduler or RNG state
(`save_only_model=True`, or those files deleted since) resumes with a warning naming each state that starts fresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
from collections.abc import Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch import nn
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_pt_utils import safe_globals

logger = logging.getLogger(__name__)

# what the Trainer's files hold (by the name's start), for the warning that a resume without them starts it fresh
FRESH_WITHOUT = {
    "optimizer": "the optimizer's state (AdamW's moments, for one)",
    "scheduler": "the learning-rate schedule (from its first step, warmup included)",
    "rng_state": "the random state (sampling draws other numbers than the saved run would)",
}
RNG_FIELDS = ("python", "numpy", "cpu")
WEIGHTS_FILES = (  # the first one present names the weights in an error
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
FOREIGN_OBJECT = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_checkpoint_file(
    path: str,
    checkpoint: str,
    way_on: str,
    required: Iterable[str] = (),
    device: str | torch.device = "cpu",
    mmap: bool = False,
) -> dict:
    """A file of `checkpoint`, as tensors and plain values only (numpy's RNG state allowed, as the Trainer reads it),
    holding each `required` field; one that cannot be read, or lacks a field, is an error naming it, the checkpoint
    and how to go on without it (`way_on`). `mmap`: the tensors are mapped, not read (a check of a large file)."""
    name = os.path.basename(path)
    try:
        with safe_globals():
            try:
                state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
            except Exception:
                if not mmap:
                    raise
                state = torch.load(path, map_location=device, weights_only=True)  # the error a plain read meets
    except Exception as error:  # truncated (EOFError, RuntimeError, OSError), damaged or foreign (UnpicklingError)
        raise RuntimeError(
            f"{name} of resume_from_checkpoint={checkpoint!r} cannot be read ({_why_unreadable(error)}): the file "
            f"is truncated, damaged or not one this trainer wrote. {way_on}"
        ) from None
    check_fields(state, required, name, checkpoint, way_on)
    return state


def check_fields(state: object, required: Iterable[str], name: str, checkpoint: str, way_on: str) -> None:
    """Each `required` field in `state` (the file `name`), or an error naming the ones it lacks."""
    missing = [field for field in required if not (isinstance(state, dict) and field in state)]
    if missing:
        raise RuntimeError(_lacks(name, checkpoint, missing, way_on))


@contextlib.contextmanager
def fields_named(name: str, checkpoint: str, way_on: str) -> Iterator[None]:
    """A field a state read from the file `name` lacks (a `KeyError` while it is applied) as an error naming it."""
    try:
        yield
    except KeyError as error:
        raise RuntimeError(_lacks(name, checkpoint, [error.args[0]], way_on)) from None


def _lacks(name: str, checkpoint: str, fields: list, way_on: str) -> str:
    listed = ", ".join(repr(field) for field in fields)
    return (
        f"{name} of resume_from_checkpoint={checkpoint!r} lacks the field{'s' if len(fields) > 1 else ''} {listed}: "
        f"the file is damaged or not one this trainer wrote. {way_on}"
    )


def _why_unreadable(error: Exception) -> str:
    """The gist of a load's error, never torch's advice to load with `weights_only=False`."""
    if isinstance(error, pickle.UnpicklingError):
        found = FOREIGN_OBJECT.search(str(error))
        if found:
            return f"it holds a {found.group(1)}, not only tensors and plain values; loading it would run code"
        return "UnpicklingError: not a file torch.save wrote"
    first = str(error).split(". ")[0].strip() or "the file ended early"
    if "weights_only" in first:  # torch's word for a file that is no zip archive, with its advice
        first = "not a zip archive as torch.save writes"
    return f"{type(error).__name__}: {first}"


def trainer_files(sharded: bool, scheduler: Any, world_size: int) -> dict[str, tuple[str, ...]]:
    """The Trainer's files a resume reads besides the weights, each with the fields it needs: the optimizer and
    scheduler states (DeepSpeed and FSDP keep theirs their own way) and each process's RNG state."""
    files = {}
    if not sharded:
        schedule = ("last_epoch", *sorted({"lr_lambdas", "base_lrs"} & scheduler.state_dict().keys()))
        files = {OPTIMIZER_NAME: ("state", "param_groups"), SCHEDULER_NAME: schedule}
    ranks = [f"rng_state_{rank}.pth" for rank in range(world_size)] if world_size > 1 else ["rng_state.pth"]
    return files | dict.fromkeys(ranks, RNG_FIELDS)


def check_trainer_files(checkpoint: str, files: dict[str, tuple[str, ...]]) -> str | None:
    """Each of `files` (`trainer_files`) in `checkpoint` read before the Trainer reads it (its tensors mapped, not
    read): one it cannot use is an error naming it and the field. Those absent (`save_only_model=True`, or deleted
    since) start fresh, which the Trainer does silently: the warning to log, naming each, or None."""
    way_on = (
        "Resume from an earlier checkpoint, or start a new run from this checkpoint's weights (model=<the folder>)."
    )
    absent = []
    for name, fields in files.items():
        path = os.path.join(checkpoint, name)
        if os.path.isfile(path):
            load_checkpoint_file(path, checkpoint, way_on, fields, mmap=True)
        else:
            absent.append(name)
    if not absent:
        return None
    fresh = dict.fromkeys(text for prefix, text in FRESH_WITHOUT.items() for name in absent if name.startswith(prefix))
    return (
        f"resume_from_checkpoint={checkpoint!r} holds no {', '.join(absent)} (saved with save_only_model=True, or "
        f"deleted since): the weights, the step and DAPO's sampling state are restored, but these start fresh: "
        f"{'; '.join(fresh)}. The run does not go on as the one that saved it would have."
    )


class MissingTensors(ValueError):
    """Tensors of the model that the resumed weights lack (named with the checkpoint by `weights_named`)."""


def untied_missing_keys(model: nn.Module, missing_keys: list[str]) -> list[str]:
    """The `missing_keys` of a weights load that name no tensor shared with one loaded: tied embeddings share one
    tensor (`lm_head.weight` is `model.embed_tokens.weight`), which a safetensors save stores under one name."""
    tensors = dict(chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    missing = set(missing_keys)
    loaded = {id(tensor) for name, tensor in tensors.items() if name not in missing}
    return [key for key in missing_keys if key not in tensors or id(tensors[key]) not in loaded]


@contextlib.contextmanager
def weights_named(checkpoint: str) -> Iterator[None]:
    """A weights file of `checkpoint` that cannot be read, or lacks a tensor of the model, as an error naming it."""
    name = next((n for n in WEIGHTS_FILES if os.path.isfile(os.path.join(checkpoint, n))), "the weights")
    way_on = "Resume from an earlier checkpoint of this run."
    try:
        yield
    except MissingTensors as error:
        keys = error.args[0]
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        raise ValueError(
            f"{name} of resume_from_checkpoint={checkpoint!r} lacks {len(keys)} tensor(s) of the model ({shown}): the "
            f"file is damaged or holds another model, and these would train on as initialised. {way_on}"
        ) from None
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise RuntimeError(
            f"{name} of resume_from_checkpoint={checkpoint!r} cannot be read ({_why_unreadable(error)}): the file "
            f"is truncated, damaged or holds another model. {way_on}"
        ) from None
    except Exception as error:
        if type(error).__name__ != "SafetensorError":
            raise
        raise RuntimeError(
            f"{name} of resume_from_checkpoint={checkpoint!r} cannot be read ({_why_unreadable(error)}): the file "
            f"is truncated or damaged. {way_on}"
        ) from None
