"""What the study's phases (`study.py`) and the regime check (`check.py`) share: where a study directory keeps its
start points' models and every run's record, how records are read and written, and the data every job uses."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from .config import StudyConfig
from .task import addition_splits

START = "start"  # the start point's file name beside the runs' (no variant is called so)


def seed_dir(output: Path, seed: int) -> Path:
    return output / "runs" / f"seed{seed}"


def result_file(output: Path, seed: int, name: str) -> Path:
    """The start point's record (`name=START`) or one variant's run."""
    return seed_dir(output, seed) / f"{name}.json"


def model_dir(output: Path, seed: int) -> Path:
    return output / "models" / f"seed{seed}"


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path: Path, value: dict) -> None:
    """Whole or not at all: a worker killed while writing leaves no half file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value, indent=2))
    partial.replace(path)


def weights_digest(path: Path) -> str:
    """SHA-256 of the saved model's tensors, by name: equal digests, equal start points."""
    model = AutoModelForCausalLM.from_pretrained(path)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def study_data(config: StudyConfig) -> dict:
    return addition_splits(config.num_train, config.test_per_bucket, config.buckets, config.data_seed)


def read_start(config: StudyConfig, output: Path, seed: int) -> dict | None:
    """The seed's recorded start point, if it was made under these settings."""
    start = read_json(result_file(output, seed, START))
    return start if start is not None and start.get("settings") == config.start_fingerprint() else None
