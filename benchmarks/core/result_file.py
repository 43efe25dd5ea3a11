"""Where a benchmark's results go: one JSON file with the run's metadata, rewritten after every measurement so a run
cut short keeps what it measured."""

from __future__ import annotations

import json
import subprocess
import time
from importlib import metadata
from pathlib import Path

import torch

from benchmarks.core.workload import BENCHMARKS

PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft")


def git_commit() -> str | None:
    """The checked-out commit (with "-dirty" for uncommitted changes), or None outside a git checkout."""
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=BENCHMARKS, capture_output=True, text=True
        )
    except OSError:
        return None
    return described.stdout.strip() or None


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


class ResultFile:
    """`data` (run metadata + whatever the benchmark adds), written to `path` by `save()`."""

    def __init__(self, path: str | Path, device: str, settings: dict) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "versions": {package: version(package) for package in PACKAGES},
            "commit": git_commit(),
            "setup": {k: str(v) for k, v in settings.items()},
        }

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def default_output(script: str, tiny: bool, device: str) -> Path:
    return BENCHMARKS / "results" / f"{script}_{'tiny' if tiny else device}.json"


def finish(table: str, path: Path, failures: int, what: str) -> None:
    """Print the last table and where the results are; exit non-zero when `failures` of `what` failed."""
    print(table)
    print(f"wrote {path}")
    if failures:
        raise SystemExit(f"{failures} {what} failed (see the tracebacks above)")
