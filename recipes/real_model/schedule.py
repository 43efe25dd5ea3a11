"""The runs on the shared device: jobs in the study's order, `slots` processes at once, every finished run kept, so the
same command on the same folder resumes where a call stopped.

Every timed run shares the device alike: while any run that is expected to finish (its estimated time ends before
the call's deadline) is on the device, the free slots are filled, with the next jobs when they fit and otherwise
with *fillers* (the next jobs all the same, stopped when the last expected run ends, and run again by a later call).
So each arm's runs share the device with `slots - 1` others from start to end, the last ones included, and no arm is
timed on an emptier device than another. When each run's process started and ended, and whether it was a filler, is
kept in OUTPUT/schedule.json: the report reads from it how many runs shared the device with each one.

Each run process gets an equal share of the device (`memory_share`): its caching allocator is capped there, so a run
that outgrows it fails alone, and its engines plan their KV pool under the same share. vLLM sizes its memory while it
starts and stops with an error when another process frees memory meanwhile, so no run is started while a run of
TRL's vLLM arm is starting (its record says `building` until its trainer is built).

The estimate of a run is the longest finished run of its kind and cell in this folder, or before there is one, the
prior below, scaled from the first H100 study (2026-12-06: 7 processes at once, 16 prompts x 8 samples per step, a cap
of 256 tokens; per optimizer step DAPO 6.2 s, GRPO's settings 4.4 s, TRL's `GRPOTrainer` 7.7 s, and 4-6 s per
evaluation of 64 x 16 samples) by the square root of the rows and the cap (the decode is launch-bound: it shortens
less than the work).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import trl_dapo
from ablation.store import read_json, write_json

from .arms import vllm_missing
from .config import CELLS, GRPO, NO_DYNAMIC_SAMPLING, TRL_KINDS, TRL_VLLM, RealModelConfig
from .pilot import picked
from .runs import BUILDING, is_done, job_fingerprint, run_file, run_name

RECIPES = Path(__file__).resolve().parent.parent
DEVICE_USABLE = 0.9  # of the device's memory, for the run processes together
CUDA_CONTEXT_BYTES = 0.75 * 2**30  # per process, outside its allocator's cap
STARTS_ALONE = (TRL_VLLM,)  # no other process starts while one of these is building its trainer
# The prior (see the docstring), at the first study's 128 rows per step and 256-token cap
PRIOR_STEP_S = {"dapo": 6.2, "grpo": 4.4, "trl": 7.7}
PRIOR_EVAL_S = 5.0
PRIOR_START_S = 40.0  # the process's imports, the trainer, the engines' first call
POLL_S = 1.0


def arm_jobs(config: RealModelConfig, output: Path, pick: dict) -> list[dict]:
    """Every arm's run in the study's order, each on its cell's task, learning rate and step count (no run on a cell
    the pilot could not pick)."""
    jobs = []
    for cell, kind, seed in config.run_order():
        chosen = picked(pick, cell)
        if chosen is None:
            continue
        jobs.append({
            "name": run_name(cell, kind, seed),
            "cell": cell,
            "kind": kind,
            "arm": kind,
            "seed": seed,
            "task": {key: chosen[key] for key in ("family", "style", "temperature", "cap", "cell")},
            "learning_rate": chosen["learning_rate"],
            "max_steps": chosen["max_steps"],
            "record": str(run_file(output, kind, seed, cell)),
        })  # fmt: skip
    return jobs


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
    """The longest finished run of the job's kind and cell (its time in the process, plus start-up), else the prior."""
    alike = [j for j in jobs if j["kind"] == job["kind"] and j.get("cell", CELLS[0]) == job.get("cell", CELLS[0])]
    finished = [read_json(Path(j["record"])) for j in alike]
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
        self.running: dict[subprocess.Popen, tuple[list[dict], float, bool]] = {}
        self.schedule = read_json(output / "schedule.json") or {}
        (output / "logs").mkdir(parents=True, exist_ok=True)
        (output / "jobs").mkdir(parents=True, exist_ok=True)

    def start(self, batch: list[dict], filler: bool) -> None:
        for job in batch:
            write_json(self.output / "jobs" / f"{job['name']}.json", job)
            if job["kind"] in STARTS_ALONE:  # building until the run process says otherwise
                write_json(Path(job["record"]), {"kind": job["kind"], "seed": job["seed"], "status": BUILDING})
        command = [sys.executable, "-m", "real_model.runs", str(self.output), "--memory-share", str(self.share),
                   *(["--deadline", str(self.deadline)] if self.deadline is not None else []),
                   "--jobs", *(job["name"] for job in batch)]  # fmt: skip
        with (self.output / "logs" / f"{batch[0]['name']}.log").open("a") as log:
            process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # fmt: skip
        self.running[process] = (batch, time.time(), filler)

    def expected_running(self) -> bool:
        """Whether a run that is expected to finish (not a filler) is on the device."""
        return any(not filler for _, _, filler in self.running.values())

    def starting_alone(self) -> bool:
        """Whether a run that must start alone is still building its trainer."""
        return any((read_json(Path(job["record"])) or {}).get("status") == BUILDING
                   for batch, _, _ in self.running.values() for job in batch if job["kind"] in STARTS_ALONE)  # fmt: skip

    def stop_fillers(self) -> None:
        """End the fillers' processes (and what they started): no expected run is left for them to share with."""
        for process, (batch, _, filler) in self.running.items():
            if filler and process.poll() is None:
                print(f"[run] {batch[0]['name']}: filler stopped, left for the next call", flush=True)
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.running:
            process.wait()

    def reap(self) -> list[int]:
        """The exit codes of the expected runs' processes that ended since the last call (every ended process's jobs'
        times recorded)."""
        codes = []
        for process in [p for p in self.running if p.poll() is not None]:
            batch, began, filler = self.running.pop(process)
            ended = time.time()
            for job in batch:
                self.schedule[job["name"]] = {"start": began, "end": ended, "processes_in_batch": len(batch),
                                              "filler": filler}  # fmt: skip
            write_json(self.output / "schedule.json", self.schedule)
            codes += [] if filler else [process.returncode]
        return codes


def run_jobs(
    config: RealModelConfig, output: Path, jobs: list[dict], deadline: float | None
) -> tuple[list[dict], list[int]]:
    """Every unfinished job, in order, `slots` processes at a time, the slots kept full while an expected run is on
    the device: the jobs left for a later call and the exit codes of the expected runs' processes."""
    runnable = skip_unrunnable(config, jobs)
    pending = [job for job in runnable if not is_done(config, job)]
    if not pending:
        return [], []
    launcher, codes = Launcher(config, output, deadline), []
    print(f"{len(pending)} runs to do, {config.slots} at a time, {launcher.share:.3f} of the device each", flush=True)
    while pending or launcher.running:
        batch, filler = next_batch(config, launcher, pending, jobs)
        if batch:
            pending = [job for job in pending if job not in batch]
            launcher.start(batch, filler)
            continue
        if not launcher.expected_running():
            launcher.stop_fillers()
            launcher.reap()
            break
        time.sleep(POLL_S)
        codes += launcher.reap()
    left = [job for job in runnable if not is_done(config, job)]
    if left:
        print(f"{len(left)} runs left for the next call: {[job['name'] for job in left]}", flush=True)
    return left, codes


def next_batch(
    config: RealModelConfig, launcher: Launcher, pending: list[dict], jobs: list[dict]
) -> tuple[list[dict], bool]:
    """The next jobs to start now (up to `jobs_per_process`, the first that fit before the deadline) and False; where
    none fits but an expected run is on the device, the next job as a filler and True; else none."""
    if len(launcher.running) >= config.slots or launcher.starting_alone() or not pending:
        return [], False
    batch, left = [], (launcher.deadline - time.time()) if launcher.deadline is not None else math.inf
    for job in pending:
        alone = job["kind"] in STARTS_ALONE
        if alone and batch:
            continue
        if sum(estimate_s(config, j, jobs) for j in (*batch, job)) <= left:
            batch.append(job)
            if alone or len(batch) == config.jobs_per_process:
                break
    if batch:
        return batch, False
    return ([pending[0]], True) if launcher.expected_running() else ([], False)
