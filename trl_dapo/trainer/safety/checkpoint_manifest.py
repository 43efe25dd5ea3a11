"""What makes a checkpoint complete: its manifest, written last, lists every file the save wrote with its size (and a
SHA-256 for the small ones); a folder whose files do not match it, or without it, is not one to resume from.

Durable, not only whole: a file renamed into place, or a manifest, can reach the disk before the data it stands for,
so a power loss could leave a complete-looking checkpoint of empty files. Every file and folder is fsynced before
the rename or the manifest that vouches for it, and the output folder after the manifest, before older checkpoints
are deleted.

Checksums only where they cost little beside the save: reading a file back to hash it costs about half of writing
it (`benchmarks/bench_checkpoint_save.py`), so the weights and optimizer state are checked by size alone, and the
states, configs and tokenizer files (up to `CHECKSUM_LIMIT` bytes each) by SHA-256 too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

MANIFEST_FILE = "dapo_checkpoint_manifest.json"
MANIFEST_FORMAT = 1
CHECKSUM_LIMIT = 64 * 2**20  # bytes: every state, config and tokenizer file; never the weights of a real model
# what torch.save's writer raises when the disk is full: it finds its file shorter than what it wrote
TORCH_SHORT_WRITE = ("unexpected pos", "file write failed")


@contextlib.contextmanager
def full_disk_named(path: str | os.PathLike) -> Iterator[None]:
    """A full disk while writing `path` raised as an `OSError` (ENOSPC) saying so and naming it, in place of
    torch.save's "[enforce fail at inline_container.cc] unexpected pos"."""
    try:
        yield
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise _no_space(path, error) from error
    except RuntimeError as error:
        if not any(sign in str(error) for sign in TORCH_SHORT_WRITE):
            raise
        raise _no_space(path, error) from error


def _no_space(path: str | os.PathLike, error: Exception) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"no space left while writing {path} ({type(error).__name__}: {error}). The checkpoint is incomplete and "
        "older ones are kept: free space (or set output_dir on a larger disk) and resume.",
    )


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
    """`checkpoint`'s manifest, None where it has none (a save not finished, or one written before manifests)."""
    path = Path(checkpoint) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {"unreadable": True}
    return manifest


def manifest_mismatches(checkpoint: str | os.PathLike, manifest: dict) -> list[str]:
    """What in `checkpoint` differs from its `manifest`: each file missing, of another size, or whose checksum
    differs; empty where the folder holds every file the save wrote, as written."""
    if manifest.get("unreadable"):
        return [f"{MANIFEST_FILE} unreadable"]
    wrong = []
    for name, expected in manifest["files"].items():
        path = Path(checkpoint) / name
        if not path.is_file():
            wrong.append(f"{name} missing")
        elif (size := path.stat().st_size) != expected.get("bytes"):
            wrong.append(f"{name} has {size} bytes, {expected.get('bytes')} written")
        elif "sha256" in expected and _sha256(path) != expected["sha256"]:
            wrong.append(f"{name} differs from the file written (SHA-256)")
    return wrong
