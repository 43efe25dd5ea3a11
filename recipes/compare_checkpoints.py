"""How far training moved a model's weights, and whether two checkpoints hold the same state to the bit.

    .venv/bin/python recipes/compare_checkpoints.py --start RUN/tiny-model --end RUN/checkpoint-5 --other RUN2/checkpoint-5

`--start` and `--end` are folders holding `model.safetensors` (a model folder or a checkpoint): the largest change of
any weight between them says the run trained (a check that compares two runs whose every step was skipped compares
the starting weights with themselves). `--other`, a second checkpoint of the same run (resumed after a kill, say),
is compared with `--end` file by file: the weights, and the optimizer, scheduler, RNG and DAPO sampling states. The
exit status is 1 when the weights did not move or the two checkpoints differ, so the check fails where it would
prove nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

WEIGHTS = "model.safetensors"
STATE_PATTERNS = ("optimizer.pt", "scheduler.pt", "rng_state*.pth", "dapo_*.pt")


@dataclass
class Comparison:
    """Two states' numbers (tensors and arrays) and other values, matched by their path in the structure."""

    tensors: int = 0
    largest: float = 0.0  # the largest absolute difference of any number
    unequal: list[str] = field(default_factory=list)  # paths whose values differ in a bit, a shape, a type or a value

    @property
    def equal(self) -> bool:
        return not self.unequal


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}/{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}/{index}")
    else:
        yield path, value


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous()
    return torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else None


def compare(first: Any, second: Any) -> Comparison:
    """Every number of `first` against `second`'s at the same path: equal means the same bits, not only close."""
    result = Comparison()
    theirs = dict(_leaves(second))
    ours = dict(_leaves(first))
    result.unequal += sorted(set(ours) ^ set(theirs))
    for path in sorted(set(ours) & set(theirs)):
        a, b = _as_tensor(ours[path]), _as_tensor(theirs[path])
        if a is None or b is None:
            if a is not None or b is not None or ours[path] != theirs[path]:
                result.unequal.append(path)
            continue
        result.tensors += 1
        if a.dtype != b.dtype or a.shape != b.shape:
            result.unequal.append(path)
            continue
        if a.numel() and a.dtype != torch.bool:
            result.largest = max(result.largest, (a.double() - b.double()).abs().max().item())
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            result.unequal.append(path)
    return result


def _load(path: Path) -> Any:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=False)  # this run's own RNG and sampling states


def state_files(folder: Path) -> list[str]:
    """The checkpoint's weights and state files, by name."""
    names = {path.name for pattern in (WEIGHTS, *STATE_PATTERNS) for path in folder.glob(pattern)}
    return sorted(names)


def _line(name: str, result: Comparison) -> str:
    verdict = "equal to the bit" if result.equal else f"DIFFERENT at {len(result.unequal)}: {result.unequal[:3]}"
    return f"  {name}: max |difference| {result.largest:.3e} over {result.tensors} tensors; {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=Path, required=True, help="Folder of the weights training started from.")
    parser.add_argument("--end", type=Path, required=True, help="Folder of the weights it ended with.")
    parser.add_argument("--other", type=Path, help="A second checkpoint to compare with --end, file by file.")
    args = parser.parse_args(argv)
    moved = compare(_load(args.start / WEIGHTS), _load(args.end / WEIGHTS))
    print(f"weights moved from --start to --end: max |dW| {moved.largest:.3e} over {moved.tensors} tensors")
    failed = moved.largest == 0.0
    if failed:
        print("  no weight moved: every step was skipped or the learning rate is 0, so a comparison proves nothing")
    if args.other is not None:
        names = state_files(args.end)
        missing = sorted(set(names) ^ set(state_files(args.other)))
        print(f"--end against --other ({len(names)} files{f'; in one only: {missing}' if missing else ''}):")
        failed = failed or bool(missing)
        for name in names:
            if name in missing:
                continue
            result = compare(_load(args.end / name), _load(args.other / name))
            print(_line(name, result))
            failed = failed or not result.equal
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
