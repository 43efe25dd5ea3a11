"""Does generating with the rollout engine slow the eager training step that follows it?

    python3 -m benchmarks.rollout.check_host_overhead --model qwen2.5-0.5b

A small-model training step is bound by the host launching kernels, so anything that makes the host slower (busy
background processes, a changed thread affinity) shows up as a slower step. This measures, in one process, the host
cost of a kernel launch and of one training forward + backward: fresh, after generating with the paged engine's
decode steps as CUDA graphs of eager kernels, after generating with its compiled layer and sampling head, after the
compile workers are shut down and with the garbage collector's existing objects frozen.
Prints a table last and writes `benchmarks/results/check_host_overhead.json` (or `--output`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.core.timing import synchronize
from benchmarks.core.workload import BENCHMARKS, config_path, random_model
from trl_dapo.rollout import PagedRolloutEngine, TokenSampling


def launch_us(device: str, launches: int = 20_000) -> float:
    """Host microseconds per tiny kernel launch (the device finishes each long before the next is issued)."""
    x = torch.zeros(1, device=device)
    synchronize()
    start = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    synchronize()
    return (time.perf_counter() - start) / launches * 1e6


def train_step_ms(model, ids: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """Median host time to issue one forward + backward, and its time to completion."""
    issued, completed = [], []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        issued.append(time.perf_counter() - start)
        synchronize()
        completed.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"issue_ms": statistics.median(issued) * 1e3, "step_ms": statistics.median(completed) * 1e3}


def child_processes() -> int:
    own = str(os.getpid())
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                count += stat.read().rsplit(")", 1)[1].split()[1] == own
        except (OSError, IndexError):
            continue
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, default=32, help="rows of one training micro-batch")
    parser.add_argument("--tokens", type=int, default=288, help="tokens per training row")
    parser.add_argument("--generate-rows", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(config_path(args.model), device, torch.bfloat16 if device == "cuda" else None)
    model.train()
    ids = torch.randint(3, 1000, (args.rows, args.tokens), device=device)
    prompts = [list(range(3, 43))] * args.generate_rows
    settings = TokenSampling(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    rows = []

    def measure(label: str) -> None:
        train_step_ms(model, ids, repeats=2)  # warm-up
        rows.append(
            {
                "state": label,
                "launch_us": launch_us(device),
                **train_step_ms(model, ids),
                "child_processes": child_processes(),
                "cpu_affinity": len(os.sched_getaffinity(0)),
                "torch_threads": torch.get_num_threads(),
            }
        )
        print(rows[-1], flush=True)

    measure("fresh")
    measure("fresh, again")  # the drift between two identical measurements
    for label, compile_decode in (("after graph engine", False), ("after compiled engine", True)):
        engine = PagedRolloutEngine(
            model, eos_token_ids=[2], pad_token_id=0, dtype=model.dtype, cuda_graph=device == "cuda",
            compile_decode=compile_decode,
        )  # fmt: skip
        for _ in range(2):
            engine.generate(prompts, settings)
        measure(label)
        del engine
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    measure("compile workers shut down")
    gc.collect()
    gc.freeze()  # the objects compilation left behind no longer walked by each garbage collection
    measure("garbage collector frozen")

    output = Path(args.output or BENCHMARKS / "results" / "check_host_overhead.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"device": device, "model": args.model, "rows": rows}, indent=2))
    print("| state | launch us | issue ms | step ms | children | affinity | threads |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['state']} | {r['launch_us']:.2f} | {r['issue_ms']:.1f} | {r['step_ms']:.1f} | "
            f"{r['child_processes']} | {r['cpu_affinity']} | {r['torch_threads']} |"
        )


if __name__ == "__main__":
    main()
