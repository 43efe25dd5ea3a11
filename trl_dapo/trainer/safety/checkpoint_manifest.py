"""What makes a checkpoint complete: its manifest, written last, lists every file the save wrote with its size (and a
SHA-256 for the small ones); a folder whose files do not match it, or without it, is not one to resume from.

Durable, not only whole: a file renamed into place, or a manifest, can reach the disk before the data it stands for,
so a power loss could leave a complete-looking checkpoint of empty files. Every file and folder is fsynced before
the rename or the manifest that vouches for it, and the output folder after the manifest, before older checkpoints
are deleted.

Checksums only where they cost little beside the save: reading a file back to hash it costs about half of writing
it (`benchmarks/trainer/bench_checkpoint_save.py`), so the weights and optimizer state are checked by size alone, and
the states, configs and tokenizer files (up to `CHECKSUM_LIMIT` bytes each) by SHA-256 too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

MANIFEST_FILE = "dapo_checkpoint_manifest.json"
MANIFEST_FORMAT = 1
CHECKSUM_LIMIT = 64 * 2**20  # bytes: every state, config and tokenizer file; never the weights of a real model
# what torch.save's writer (its file shorter than what it wrote) and safetensors' (the OS error quoted) raise where
# the disk is full; torch's stream failing as it closes ("basic_ios::clear") says no more than that the write failed
FULL_DISK_SIGNS = ("unexpected pos", "file write failed", "No space left", "os error 28")
WRITE_FAILED_SIGNS = (*FULL_DISK_SIGNS, "basic_ios::clear")
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_BELOW = 2**20  # bytes free under which a failed write is said to have met a full disk


@contextlib.contextmanager
def full_disk_named(path: str | os.PathLike) -> Iterator[None]:
    """A write into `path` (a file, or a checkpoint folder the Trainer writes) that fails for want of space raised as
    an `OSError` naming the checkpoint folder, the file and the space left, in place of torch's "unexpected pos" or
    "basic_ios::clear" and safetensors' "Error while serializing", which name neither."""
    try:
        yield
    except OSError as error:
        if error.errno not in NO_SPACE_ERRNOS:
            raise
        raise _write_failed(path, error) from error
    except RuntimeError as error:
        if not any(sign in str(error) for sign in WRITE_FAILED_SIGNS):
            raise
        raise _write_failed(path, error) from error
    except Exception as error:
        if type(error).__name__ != "SafetensorError" or "I/O error" not in str(error):
            raise
        raise _write_failed(path, error) from error


def _write_failed(path: str | os.PathLike, error: Exception) -> OSError:
    """The error for a write into `path` that failed: the folder, the file (in a folder the Trainer writes: the
    weights where safetensors failed, which deletes its file; else the newest file, the one being written) and the
    space left on the disk."""
    path = Path(path)
    folder, file = (path, _file_being_written(path, error)) if path.is_dir() else (path.parent, path.name)
    free = shutil.disk_usage(folder).free
    full = getattr(error, "errno", None) in NO_SPACE_ERRNOS or any(sign in str(error) for sign in FULL_DISK_SIGNS)
    full = full or free < FULL_BELOW
    what = f"{file} into checkpoint {folder}"
    said = f"no space left on the disk while writing {what}" if full else f"writing {what} failed"
    return OSError(
        errno.ENOSPC if full else errno.EIO,
        f"{said} ({free} bytes free; {type(error).__name__}: {error}). The checkpoint is incomplete and older ones "
        "are kept: free space (or set output_dir on a larger disk) and resume.",
    )


def _file_being_written(folder: Path, error: Exception) -> str:
    if type(error).__name__ == "SafetensorError":
        return "the model weights (*.safetensors)"
    newest = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns, default=None)
    return newest.relative_to(folder).as_posix() if newest else "its first file"


def fsync_path(path: str | os.PathLike) -> None:
    """`path`'s data (a file) or its entries (a folder) on the disk. Folders are synced on POSIX systems only."""
    if os.path.isdir(path) and os.name != "posix":
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_folder_tree(folder: str | os.PathLike) -> None:
    """Every file under `folder`, then each folder (deepest first, `folder` last): the data before the names."""
    folders = []
    for here, _, names in os.walk(folder):
        folders.append(here)
        for name in sorted(names):
            fsync_path(os.path.join(here, name))
    for here in reversed(folders):
        fsync_path(here)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _describe(path: Path) -> dict:
    size = path.stat().st_size
    return {"bytes": size, "sha256": _sha256(path)} if size <= CHECKSUM_LIMIT else {"bytes": size}


def write_manifest(checkpoint: str | os.PathLike) -> None:
    """The manifest of every file now in `checkpoint`, written last: files and folders synced, then the manifest
    under a temporary name, synced, renamed, and the folder and its parent synced."""
    folder = Path(checkpoint)
    sync_folder_tree(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {"format": MANIFEST_FORMAT, "files": {p.relative_to(folder).as_posix(): _describe(p) for p in files}}
    path = folder / MANIFEST_FILE
    partial = path.with_name(f"{MANIFEST_FILE}.partial")
    with full_disk_named(path):
        with open(partial, "w") as file:
            json.dump(manifest, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    fsync_path(folder)
    fsync_path(folder.parent)


def read_manifest(checkpoint: str | os.PathLike) -> dict | None:
    """`checkpoint`'s manifest, None where it has none (a save not finished, or one written before manifests). One
    that cannot be read is an error: the manifest is written whole or not at all, so it was damaged after the save,
    and the folder is neither resumed (its files cannot be checked) nor passed over (a run starting from an older
    checkpoint would delete it with `save_total_limit`)."""
    path = Path(checkpoint) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:  # cut short, or not text
        manifest = None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and "bytes" in e for e in files.values()):
        raise ValueError(
            f"{checkpoint}: its {MANIFEST_FILE} is damaged ({path.stat().st_size} bytes that are not a manifest), so "
            "the files its save wrote cannot be checked: it is neither resumed nor deleted. If its files are whole "
            "(the save ended and only the manifest was damaged), write a new manifest of them with python -c "
            f"\"from trl_dapo.trainer.safety import write_manifest; write_manifest('{checkpoint}')\" and resume; "
            "otherwise move the folder out of output_dir, and resume_from_checkpoint=True takes the next older "
            "complete checkpoint (none: step 0)."
        )
    return manifest


def manifest_mismatches(checkpoint: str | os.PathLike, manifest: dict) -> list[str]:
    """What in `checkpoint` differs from its `manifest`: each file missing, of another size, or whose checksum
    differs; empty where the folder holds every file the save wrote, as written."""
    wrong = []
    for name, expected in manifest["files"].items():
        path = Path(checkpoint) / name
        if not path.is_file():
            wrong.append(f"{name} missing")
        elif (size := path.stat().st_size) != expected["bytes"]:
            wrong.append(f"{name} has {size} bytes, {expected['bytes']} written")
        elif "sha256" in expected and _sha256(path) != expected["sha256"]:
            wrong.append(f"{name} differs from the file written (SHA-256)")
    return wrong
