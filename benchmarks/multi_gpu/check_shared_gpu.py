"""What several ranks sharing one GPU can run: which process-group backend and collectives on CUDA tensors, and which
of the recipes' sharding strategies (DDP, FSDP2, DeepSpeed ZeRO-2/3) train a step there.

    python3 -m benchmarks.multi_gpu.check_shared_gpu         # 2 ranks on the first GPU
    python3 -m benchmarks.multi_gpu.check_shared_gpu --tiny  # the same on CPU ranks (a check of the script)

Each check starts its own ranks (every one with LOCAL_RANK 0, so all sit on the first device) and must end within
`--timeout` seconds; a rank that fails or hangs marks the check failed with its error. Prints a table last and writes
`benchmarks/results/check_shared_gpu_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).parents[2]  # the repository root: the ranks run from it
CHECKS = {
    "nccl_all_reduce": "NCCL, all_reduce",
    "gloo_all_reduce": "gloo, all_reduce on the device's tensors",
    "gloo_broadcast": "gloo, broadcast",
    "gloo_all_gather": "gloo, all_gather",
    "gloo_all_gather_into_tensor": "gloo, all_gather_into_tensor (FSDP2, ZeRO-3 gather parameters with it)",
    "gloo_reduce_scatter_tensor": "gloo, reduce_scatter_tensor (FSDP2, ZeRO-2/3 reduce gradients with it)",
    "ddp_step": "DDP over gloo: forward, backward, SGD step",
    "fsdp2_step": "FSDP2 (fully_shard) over gloo: forward, backward, SGD step",
    "zero2_step": "DeepSpeed ZeRO-2 over gloo: forward, backward, step",
    "zero3_step": "DeepSpeed ZeRO-3 over gloo: forward, backward, step",
}


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def train_step(module, step) -> float:
    """One forward, backward and optimizer step on a fixed batch; the loss."""
    torch.manual_seed(1 + dist.get_rank())
    inputs = torch.randn(8, 64, device=device())
    loss = module(inputs).square().mean()
    step(loss)
    return float(loss)


def run_check(name: str) -> str:
    """One rank's part of check `name`; what it observed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    where = device()
    if name.startswith("gloo_") or name == "nccl_all_reduce":
        value = torch.full((4,), float(rank + 1), device=where)
        if name in ("gloo_all_reduce", "nccl_all_reduce"):
            dist.all_reduce(value)
            expected = torch.full((4,), world * (world + 1) / 2, device=where)
        elif name == "gloo_broadcast":
            dist.broadcast(value, src=0)
            expected = torch.ones(4, device=where)
        elif name == "gloo_all_gather":
            parts = [torch.empty_like(value) for _ in range(world)]
            dist.all_gather(parts, value)
            value, expected = (
                torch.cat(parts),
                torch.cat([torch.full((4,), r + 1.0, device=where) for r in range(world)]),
            )
        elif name == "gloo_all_gather_into_tensor":
            gathered = torch.empty(4 * world, device=where)
            dist.all_gather_into_tensor(gathered, value)
            value, expected = gathered, torch.cat([torch.full((4,), r + 1.0, device=where) for r in range(world)])
        else:
            whole = torch.arange(4.0 * world, device=where) * (rank + 1)
            value = torch.empty(4, device=where)
            dist.reduce_scatter_tensor(value, whole)
            expected = torch.arange(4.0 * rank, 4.0 * rank + 4, device=where) * world * (world + 1) / 2
        if not torch.equal(value, expected):
            raise AssertionError(f"wrong result: {value.tolist()} instead of {expected.tolist()}")
        return "right result"
    if name == "ddp_step":
        module = torch.nn.parallel.DistributedDataParallel(model().to(where))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        loss = train_step(module, lambda loss: (loss.backward(), optimizer.step()))
        return f"loss {loss:.4f}"
    if name == "fsdp2_step":
        from torch.distributed.fsdp import fully_shard

        module = model().to(where)
        for layer in (module[0], module[2]):
            fully_shard(layer)
        fully_shard(module)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        loss = train_step(module, lambda loss: (loss.backward(), optimizer.step()))
        return f"loss {loss:.4f}"
    import deepspeed

    stage = 2 if name == "zero2_step" else 3
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,  # torch's SGD: no DeepSpeed op to compile
    }
    engine, *_ = deepspeed.initialize(model=model(), config=config, dist_init_required=False)
    loss = train_step(engine, lambda loss: (engine.backward(loss), engine.step()))
    return f"loss {loss:.4f}"


def rank_main(name: str, output: str) -> None:
    backend = "nccl" if name.startswith("nccl") else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    if name.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    try:
        outcome = {"ok": True, "detail": run_check(name)}
    except Exception as error:  # what failed is the result
        outcome = {"ok": False, "detail": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    Path(f"{output}.rank{dist.get_rank()}.json").write_text(json.dumps(outcome))
    os._exit(0)  # a failed collective can leave the group unable to shut down


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(name: str, ranks: int, timeout: int, folder: Path) -> dict:
    """Start the check's ranks; their outcome, or the error of a rank that exited without one or timed out."""
    output, port = folder / name, str(free_port())
    processes = []
    for rank in range(ranks):
        environment = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        }  # fmt: skip
        check = ["--rank-of", name, "--output", str(output)]
        command = [sys.executable, "-m", "benchmarks.multi_gpu.check_shared_gpu", *check]
        log = (folder / f"{name}.rank{rank}.log").open("w")
        processes.append(subprocess.Popen(command, cwd=ROOT, env=environment, stdout=log, stderr=log))
    try:
        for process in processes:
            process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"timed out after {timeout} s (a collective never completed)"}
    finally:
        for process in processes:
            process.kill()
    outcomes = []
    for rank in range(ranks):
        result = Path(f"{output}.rank{rank}.json")
        if result.exists():
            outcomes.append(json.loads(result.read_text()))
        else:
            lines = (folder / f"{name}.rank{rank}.log").read_text().strip().splitlines() or ["no output"]
            outcomes.append({"ok": False, "detail": f"rank {rank} exited: {lines[-1][:300]}"})
    failed = [outcome for outcome in outcomes if not outcome["ok"]]
    return failed[0] if failed else outcomes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--checks", nargs="*", default=list(CHECKS), choices=list(CHECKS))
    parser.add_argument("--timeout", type=int, default=120, help="seconds a check's ranks may take")
    parser.add_argument("--tiny", action="store_true", help="CPU ranks, whatever devices there are")
    parser.add_argument("--output", default=None)
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.rank_of:
        rank_main(args.rank_of, args.output)
        return
    folder = Path(tempfile.mkdtemp())
    rows = [{"check": name, **launch(name, args.ranks, args.timeout, folder)} for name in args.checks]
    where = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    print(f"| {args.ranks} ranks on one {where} device | runs | what it gave |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {CHECKS[row['check']]} | {'yes' if row['ok'] else 'no'} | {row['detail']} |")
    name = torch.cuda.get_device_name(0).split()[-1].lower() if where == "cuda" else "cpu"
    output = Path(args.output or ROOT / "benchmarks" / "results" / f"check_shared_gpu_{name}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"device": where, "ranks": args.ranks, "rows": rows}, indent=2))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
