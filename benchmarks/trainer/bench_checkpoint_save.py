"""What a checkpoint manifest's checksums would cost beside the save: why only small files get a SHA-256.

    .venv/bin/python -m benchmarks.trainer.bench_checkpoint_save --gib 2

Writes one file as the Trainer writes its weights and optimizer state (`torch.save` of a tensor, then `fsync`, as a
checkpoint is synced before its manifest), then reads it back through SHA-256 (the manifest's checksum) and through
CRC-32 (a cheaper one); above `CHECKSUM_LIMIT` the manifest lists a file by its size alone, one `stat`. The rates are
extrapolated to a save of Qwen2.5-7B as `recipes/configs/qwen2.5_math_7b_dapo.yaml` trains it: bf16 weights and
AdamW's two moments in bf16, 6 bytes a parameter. The file is read back right after it was written, usually from the
page cache, so the checksum times are the hash's own, a floor. Prints a table last and writes
`benchmarks/results/bench_checkpoint_save_<cpu|tiny>.json` (or `--output`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.core.workload import config_path
from trl_dapo.trainer.safety.checkpoint_manifest import CHECKSUM_LIMIT

BYTES_PER_PARAMETER = 2 + 2 * 2  # bf16 weights, AdamW's exp_avg and exp_avg_sq in the weights' dtype


def parameters_7b() -> int:
    """Qwen2.5-7B's parameter count, from its architecture (`configs/qwen2.5-7b.json`), built on the meta device."""
    config = AutoConfig.from_pretrained(config_path("qwen2.5-7b"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def save_synced(tensor: torch.Tensor, path: Path) -> None:
    torch.save(tensor, path)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def read_through(path: Path, update) -> None:
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            update(chunk)


def crc32(path: Path) -> None:
    value = 0
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            value = zlib.crc32(chunk, value)


def measure(size: int, folder: Path) -> dict:
    """Seconds to save and sync `size` bytes, and to read them back through each checksum."""
    path = folder / "state.pt"
    tensor = torch.rand(size // 4)
    seconds = {
        "save_and_fsync": timed(lambda: save_synced(tensor, path)),
        "sha256": timed(lambda: read_through(path, hashlib.sha256().update)),
        "crc32": timed(lambda: crc32(path)),
    }
    return {"bytes": path.stat().st_size, "seconds": seconds}


def table(result: dict, saved_7b: int) -> str:
    rows = ["| what | s for the file | GB/s | s for a 7B save | share of the save |", "|---|---|---|---|---|"]
    size, seconds = result["bytes"], result["seconds"]
    save_7b = saved_7b / size * seconds["save_and_fsync"]
    for what, spent in seconds.items():
        at_7b = saved_7b / size * spent
        rows.append(
            f"| {what} | {spent:.3f} | {size / spent / 1e9 if spent else float('inf'):.2f} | {at_7b:.1f} | "
            f"{at_7b / save_7b:.2f} |"
        )
    rows.append(f"\nfile {size / 1e9:.2f} GB; a 7B save {saved_7b / 1e9:.1f} GB; SHA-256 up to {CHECKSUM_LIMIT} bytes")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the file written and read back")
    parser.add_argument("--folder", default=None, help="where to write it (default: a temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="an 8 MiB file (a smoke run, not a timing)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    size = 8 * 2**20 if args.tiny else int(args.gib * 2**30)
    output = Path(args.output) if args.output else default_output("bench_checkpoint_save", args.tiny, "cpu")
    results = ResultFile(output, "cpu", vars(args))
    saved_7b = parameters_7b() * BYTES_PER_PARAMETER
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = measure(size, Path(folder))
    results.data.update(result, saved_7b_bytes=saved_7b, bytes_per_parameter=BYTES_PER_PARAMETER)
    results.save()
    finish(table(result, saved_7b), output, 0, "measurements")


if __name__ == "__main__":
    main()
