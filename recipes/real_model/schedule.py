"""The runs on the shared device: jobs in the study's order, at most `slots` processes at once, each started only if
its estimated time ends before the call's deadline, every finished run kept, so the same command on the same folder
resumes where a call stopped.

Each run process gets an equal share of the device (`memory_share`): its caching allocator is capped there, so a run
that outgrows it fails alone, and its engines plan their KV pool under the same share. The vLLM arm runs alone
(`EXCLUSIVE_KINDS`): vLLM sizes its memory from the device's free memory at start-up, which other runs change. When
each run started and ended is kept in OUTPUT/schedule.json: the report reads from it how many runs shared the device
with each one (wall-clock is only comparable between runs that shared it alike).

The estimate of a run is the longest finished run of its kind in this folder, or before there is one, the prior
below, scaled from the first H100 study (2026-12-06: 7 processes at once, 16 prompts x 8 samples per step, a cap of
256 tokens; per optimizer step DAPO 6.2 s, GRPO's settings 4.4 s, TRL's `GRPOTrainer` 7.7 s, and 4-6 s per
evaluation of 64 x 16 samples) by the square root of the rows and the cap (the decode is launch-bound: it shortens
less than the work).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import trl_dapo
from ablation.store import read_json, write_json

from .arms import vllm_missing
from .config import GRPO, NO_DYNAMIC_SAMPLING, TRL_KINDS, TRL_VLLM, RealModelConfig
from .runs import is_done, job_fingerprint, run_file

RECIPES = Path(__file__).resolve().parent.parent
DEVICE_USABLE = 0.9  # of the device's memory, for the run processes together
CUDA_CONTEXT_BYTES = 0.75 * 2**30  # per process, outside its allocator's cap
EXCLUSIVE_KINDS = (TRL_VLLM,)
# The prior (see the docstring), at the first study's 128 rows per step and 256-token cap
PRIOR_STEP_S = {"dapo": 6.2, "grpo": 4.4, "trl": 7.7}
PRIOR_EVAL_S = 5.0
PRIOR_START_S = 40.0  # the process's imports, the trainer, the engines' first call
POLL_S = 1.0


def arm_jobs(config: RealModelConfig, output: Path, pick: dict) -> list[dict]:
    """Every arm's run in the study's order, on the pick's task, learning rate and step count."""
    task = {key: pick[key] for key in ("family", "style", "temperature", "cap", "cell")}
    return [
        {
            "name": f"{kind}-seed{seed}",
            "kind": kind,
            "arm": kind,
            "seed": seed,
            "task": task,
            "learning_rate": pick["learning_rate"],
            "max_steps": pick["max_steps"],
            "record": str(run_file(output, kind, seed)),
        }
        for kind, seed in config.run_order()
    ]


def memory_share(config: RealModelConfig) -> float:
    """Each run process's share of the device (its allocator's cap and its engines' budget); 1 on the CPU."""
    if config.device != "cuda":
        return 1.0
    total = torch.cuda.get_device_properties(0).total_memory
    return (DEVICE_USABLE * total / config.slots - CUDA_CONTEXT_BYTES) / total


def prior_s(config: RealModelConfig, job: dict) -> float:
    kind = job.get("arm", job["kind"])
    family = "trl" if kind in TRL_KINDS else "grpo" if kind in (GRPO, NO_DYNAMIC_SAMPLING) else "dapo"
    scale = math.sqrt(config.rows_per_step / 128 * job["task"]["cap"] / 256)
    evaluations = len(config.eval_steps(job["max_steps"]))
    return PRIOR_START_S + job["max_steps"] * PRIOR_STEP_S[family] * scale + evaluations * PRIOR_EVAL_S * scale


def estimate_s(config: RealModelConfig, job: dict, jobs: list[dict]) -> float:
    """The longest finished run of the job's kind (its time in the process, plus start-up), else the prior."""
    kind = job["kind"]
    finished = [read_json(Path(j["record"])) for j in jobs if j["kind"] == kind]
    seconds = [r["total_s"] for r in finished if r and r.get("status") == "ok" and "total_s" in r]
    return PRIOR_START_S + max(seconds) if seconds else prior_s(config, job)


def _environment(config: RealModelConfig) -> dict[str, str]:
    package_root = str(Path(trl_dapo.__file__).resolve().parent.parent)  # the runs import the same trl_dapo
    paths = [str(RECIPES), package_root, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    env.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(config.torch_threads))
    # HF generate's growing KV cache fragmented TRL's run until its share ran out (3 of 9.4 GiB reserved, unused)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def skip_unrunnable(config: RealModelConfig, jobs: list[dict]) -> list[dict]:
    """The jobs that can run here; the vLLM arm's record says why it was skipped where vLLM cannot run."""
    why = vllm_missing(config.device)
    runnable = []
    for job in jobs:
        if job["kind"] == TRL_VLLM and why:
            write_json(Path(job["record"]), {"kind": job["kind"], "seed": job["seed"], "status": "skipped",
                                             "reason": why, "curve": [], "settings": job_fingerprint(config, job)})  # fmt: skip
            print(f"[run] {job['name']}: skipped: {why}", flush=True)
        else:
            runnable.append(job)
    return runnable


class Launcher:
    """Run processes on the device, each over a batch of jobs, and when each job's process ran."""

    def __init__(self, config: RealModelConfig, output: Path, deadline: float | None) -> None:
        self.config, self.output, self.deadline = config, output, deadline
        self.share, self.env = memory_share(config), _environment(config)
        self.running: dict[subprocess.Popen, tuple[list[dict], float]] = {}
        self.schedule = read_json(output / "schedule.json") or {}
        (output / "logs").mkdir(parents=True, exist_ok=True)
        (output / "jobs").mkdir(parents=True, exist_ok=True)

    def start(self, batch: list[dict]) -> None:
        for job in batch:
            write_json(self.output / "jobs" / f"{job['name']}.json", job)
        command = [sys.executable, "-m", "real_model.runs", str(self.output), "--memory-share", str(self.share),
                   *(["--deadline", str(self.deadline)] if self.deadline is not None else []),
                   "--jobs", *(job["name"] for job in batch)]  # fmt: skip
        with (self.output / "logs" / f"{batch[0]['name']}.log").open("a") as log:
            process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.running[process] = (batch, time.time())

    def reap(self) -> list[int]:
        """The exit codes of the processes that ended since the last call (their jobs' times recorded)."""
        codes = []
        for process in [p for p in self.running if p.poll() is not None]:
            batch, began = self.running.pop(process)
            ended = time.time()
            for job in batch:
                self.schedule[job["name"]] = {"start": began, "end": ended, "processes_in_batch": len(batch)}
            write_json(self.output / "schedule.json", self.schedule)
            codes.append(process.returncode)
        return codes


def run_jobs(
    config: RealModelConfig, output: Path, jobs: list[dict], deadline: float | None
) -> tuple[list[dict], list[int]]:
    """Every unfinished job, in order, `slots` processes at a time: the jobs left for a later call (none fitted
    before the deadline) and the processes' exit codes."""
    pending = [job for job in skip_unrunnable(config, jobs) if not is_done(config, job)]
    if not pending:
        return [], []
    launcher, codes = Launcher(config, output, deadline), []
    print(f"{len(pending)} runs to do, {config.slots} at a time, {launcher.share:.3f} of the device each", flush=True)
    while pending or launcher.running:
        batch = next_batch(config, launcher, pending, jobs)
        if batch:
            pending = [job for job in pending if job not in batch]
            launcher.start(batch)
            continue
        if not launcher.running:
            break  # nothing left fits before the deadline
        time.sleep(POLL_S)
        codes += launcher.reap()
    if pending:
        print(f"{len(pending)} runs left for the next call: {[job['name'] for job in pending]}", flush=True)
    return pending, codes


def next_batch(config: RealModelConfig, launcher: Launcher, pending: list[dict], jobs: list[dict]) -> list[dict]:
    """The next jobs to start now (up to `jobs_per_process`, the first that fit before the deadline), or none."""
    busy = len(launcher.running)
    if busy >= config.slots or any(j["kind"] in EXCLUSIVE_KINDS for b, _ in launcher.running.values() for j in b):
        return []
    batch, left = [], (launcher.deadline - time.time()) if launcher.deadline is not None else math.inf
    for job in pending:
        exclusive = job["kind"] in EXCLUSIVE_KINDS
        if exclusive and (busy or batch):
            continue
        needed = sum(estimate_s(config, j, jobs) for j in (*batch, job))
        if needed <= left:
            batch.append(job)
            if exclusive or len(batch) == config.jobs_per_process:
                break
    return batch
