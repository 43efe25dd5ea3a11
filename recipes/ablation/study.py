"""Running the study in phases of worker processes that share the device: resumable, within a memory plan and a time
budget, every failure retried once and then reported.

1. *Start points*: one process per seed (up to `workers`) builds the seed's model, warm-starts it and evaluates it
   (step 0 of every variant), and records a digest of the warm-started weights. Only seeds with runs still to do
   need their model.
2. *Runs*: every (seed, variant) pair is one job; the jobs are dealt to `workers` processes, longest first to the
   least loaded, so the device stays shared by about `workers` runs until the end.
3. *Retry*: the runs that failed, or whose worker died, once more in fresh processes (fewer of them, so each gets a
   larger share of the device). A run that fails again is reported as a failure of the study, never left out of a
   mean silently (`report.summarize` counts it).

The regime check (`check.py`) uses the same start points and a phase of its own.

Each worker is a separate process (`python -m ablation.study PHASE CONFIG OUTPUT ... --jobs JOB...`), so a crash in one run
cannot take the others down. Every finished start point and run is its own file under `OUTPUT/runs/seed*/`, so a
study cut short keeps what finished, and rerunning the same command does only what is missing: a start point whose
model is gone (a fresh machine) is warm-started again, deterministically, and must reproduce the recorded digest,
else that seed's earlier runs did not start from it and are set aside (`runs/seed*/stale/`) to be run again.

Memory: each worker may hold its share of the device (`plan.memory_plan`): its caching allocator is capped there, so
a worker that outgrows its share fails alone (and is retried) instead of starving the others, and the paged engine
sizes its cache under the same share. Time: with a time budget, a worker starts a job only if the job's estimate (the
plan's, scaled up by what its earlier jobs took over theirs) ends before the deadline; the next call with the same
command does the rest.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_dapo.evaluation import EvalSettings

from .check import check_job, reproduce_job
from .config import StudyConfig
from .model import build_model, load_tokenizer, warm_start
from .plan import estimate, memory_plan, shared
from .store import (
    START,
    model_dir,
    read_json,
    read_start,
    result_file,
    seed_dir,
    study_data,
    weights_digest,
    write_json,
)
from .task import evaluate_held_out
from .variants import Variant, build_trainer, run_order, variant_named

RECIPES = Path(__file__).resolve().parent.parent
REPORT_MARGIN_S = 30.0  # of a time budget, kept for the summary, the plot and copying the results
REPRODUCE = "reproduce"  # the check's prepare job that warm-starts a seed's start point a second time
# Training metrics kept per optimizer step (TRL's, DAPOTrainer's and the reward's).
TRAIN_METRICS = (
    "entropy",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "reward",
    "study/informative_groups",
    "study/solve_rate",
    "study/truncated",
    "study/length_spread",
    "study/rechecked",
    "dapo/sampling_efficiency",
    "dapo/gen_batches",
    "dapo/partial_batch",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "grad_norm",
)


def eval_settings(config: StudyConfig, seed: int) -> EvalSettings:
    """The same evaluation samples for every variant of a seed at a given step (common random numbers)."""
    return EvalSettings(
        config.eval_k,
        config.eval_temperature,
        config.eval_top_p,
        config.max_completion_length,
        config.eval_max_rows,
        seed,
        config.bf16,
    )


def train_series(log_history: list[dict]) -> dict[str, list[list[float]]]:
    """`metric -> [[step, value], ...]` for the metrics of `TRAIN_METRICS` that were logged."""
    series: dict[str, list[list[float]]] = {}
    for entry in log_history:
        for name in TRAIN_METRICS:
            if isinstance(entry.get(name), int | float):
                series.setdefault(name, []).append([entry["step"], float(entry[name])])
    return series


def prepare_seed(config: StudyConfig, output: Path, seed: int) -> dict:
    """This seed's start point: build and warm-start the model, evaluate it, record the weights' digest. Kept when
    its model is on disk with the recorded digest; rebuilt otherwise, and checked against the recorded digest."""
    recorded, path = read_start(config, output, seed), model_dir(output, seed)
    if recorded and path.exists() and weights_digest(path) == recorded["digest"]:
        print(f"[seed {seed}] start point kept (weights digest {recorded['digest'][:12]})", flush=True)
        return recorded
    data = study_data(config)
    build_model(path, config, seed)
    record: dict[str, Any] = {"seed": seed, "settings": config.start_fingerprint()}
    record["warm_start"] = warm_start(path, config, set(data["test"]["prompt"]), seed)
    record["digest"] = weights_digest(path)
    if recorded and recorded["digest"] == record["digest"]:  # reproduced: the earlier runs' step 0 stays theirs
        record["start_point"], record["step0_eval_s"] = recorded["start_point"], recorded["step0_eval_s"]
    else:
        model = AutoModelForCausalLM.from_pretrained(path).to(config.device)
        began = time.perf_counter()
        record["start_point"] = evaluate_held_out(
            model, load_tokenizer(path), data["test"], eval_settings(config, seed)
        )
        record["step0_eval_s"] = time.perf_counter() - began
        del model
    moved = [
        p for p in seed_dir(output, seed).glob("*.json")
        if p.stem != START and read_json(p).get("start_digest") != record["digest"]
    ]  # fmt: skip
    if moved:
        stale = seed_dir(output, seed) / "stale" / time.strftime("%Y%m%d-%H%M%S")
        stale.mkdir(parents=True, exist_ok=True)
        for run in moved:
            run.replace(stale / run.name)
        print(
            f"[seed {seed}] {len(moved)} earlier runs did not start from these weights (digest "
            f"{record['digest'][:12]}): moved to {stale}, run again",
            flush=True,
        )
    write_json(result_file(output, seed, START), record)
    print(f"[seed {seed}] start point in {record['warm_start']['seconds']:.1f} s", flush=True)
    return record


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HeldOutCurve(TrainerCallback):
    """Evaluates at `eval_steps` and stamps every optimizer step with the training wall-clock: seconds since training
    began, evaluation time left out, so a variant's time axis is its training cost alone."""

    def __init__(self, tokenizer, dataset, settings: EvalSettings, eval_steps: list[int], generated) -> None:
        self.tokenizer, self.dataset, self.settings = tokenizer, dataset, settings
        self.eval_steps = set(eval_steps) - {0}
        self.generated = generated  # what the reward has counted (completions, tokens) so far
        self.points: list[dict[str, Any]] = []
        self.step_seconds: list[float] = []
        self._start = self._excluded = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._excluded = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        device = next(model.parameters()).device
        _synchronize(device)
        elapsed = time.perf_counter() - self._start - self._excluded
        self.step_seconds.append(elapsed)
        if state.global_step in self.eval_steps:
            began = time.perf_counter()
            metrics = evaluate_held_out(model, self.tokenizer, self.dataset, self.settings)
            _synchronize(device)
            self._excluded += time.perf_counter() - began
            self.points.append(
                {"step": state.global_step, "wall_clock_s": elapsed, **self.generated.totals(), **metrics}
            )


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> dict[str, int]:
    """What this process's allocator held at most since the last reset: what the memory plan is checked against."""
    if not torch.cuda.is_available():
        return {}
    return {
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
    }


def run_variant(
    variant: Variant, config: StudyConfig, seed: int, output: Path, data, start_point: dict, memory_share: float
) -> dict:
    """One RL run from the seed's start point; a failure is recorded with its traceback and the other runs go on."""
    began, trainer = time.perf_counter(), None
    _reset_peak_memory()
    try:
        path = model_dir(output, seed)
        tokenizer = load_tokenizer(path)
        output_dir = output / "trainer" / f"seed{seed}" / variant.name
        trainer, reward = build_trainer(
            variant, config, seed, path, tokenizer, data["train"], output_dir, memory_share
        )
        built = time.perf_counter()
        curve = HeldOutCurve(tokenizer, data["test"], eval_settings(config, seed), config.eval_steps(), reward)
        trainer.add_callback(curve)
        trainer.train()
        engine = getattr(trainer, "paged_engine", None)
        return {
            "status": "ok",
            "trainer": type(trainer).__name__,
            "rollout_engine": type(engine).__name__ if engine is not None else "transformers generate",
            "build_s": built - began,
            "train_s": curve.step_seconds[-1],
            "total_s": time.perf_counter() - began,
            "curve": [start_point, *curve.points],
            "step_wall_clock_s": curve.step_seconds,
            "train": train_series(trainer.state.log_history),
            **_peak_memory(),
        }
    except Exception:
        return {
            "status": "failed",
            "error": traceback.format_exc(),
            "total_s": time.perf_counter() - began,
            **_peak_memory(),
        }
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_job(config: StudyConfig, output: Path, seed: int, name: str, memory_share: float) -> None:
    start = read_start(config, output, seed)
    previous = read_json(result_file(output, seed, name))
    if weights_digest(model_dir(output, seed)) != start["digest"]:  # a rebuild that died before recording itself
        result = {"status": "failed", "error": "the seed's model is not its recorded start point", "total_s": 0.0}
    else:
        point = {"step": 0, "wall_clock_s": 0.0, "generated_completions": 0, "generated_tokens": 0}
        result = run_variant(
            variant_named(name), config, seed, output, study_data(config), point | start["start_point"], memory_share
        )
    same_start = previous is not None and previous.get("start_digest") == start["digest"]
    failed_before = same_start and previous["status"] == "failed" and previous.get("settings") == config.fingerprint()
    result["attempts"] = previous.get("attempts", 1) + 1 if failed_before else 1
    result["start_digest"], result["settings"], result["memory_share"] = (
        start["digest"],
        config.fingerprint(),
        memory_share,
    )
    write_json(result_file(output, seed, name), result)
    print(f"[seed {seed}] {name}: {result['status']} in {result['total_s']:.1f} s", flush=True)


def is_done(config: StudyConfig, start: dict, run: dict | None) -> bool:
    """A successful run from this start point under these settings."""
    return bool(
        run
        and run["status"] == "ok"
        and run.get("start_digest") == start["digest"]
        and run.get("settings") == config.fingerprint()
    )


def pending_jobs(config: StudyConfig, output: Path) -> list[tuple[int, str]]:
    """The (seed, variant) runs without a successful result from the seed's current start point under these
    settings; a seed without a start point (its warm start failed) has none to run."""
    jobs = []
    for seed in config.seeds:
        start = read_start(config, output, seed)
        if start is None:
            continue
        for variant in run_order(config):
            if not is_done(config, start, read_json(result_file(output, seed, variant.name))):
                jobs.append((seed, variant.name))
    return jobs


def seeds_to_prepare(config: StudyConfig, output: Path) -> list[int]:
    """Seeds without a start point, or with runs still to do (those need the model on disk): on a fresh machine a
    seed whose runs are all done is not warm-started again."""
    pending = {seed for seed, _ in pending_jobs(config, output)}
    return [seed for seed in config.seeds if read_start(config, output, seed) is None or seed in pending]


def deal(jobs: list[tuple[int, str]], cost: dict[str, float], workers: int) -> list[list[tuple[int, str]]]:
    """Longest job first to the least loaded worker, so the workers end at about the same time; each worker then
    runs its share in the order of `cost` (run order: a compiling engine after every run on TRL's path)."""
    shares: list[list[tuple[int, str]]] = [[] for _ in range(min(workers, len(jobs)))]
    loads = [0.0] * len(shares)
    for job in sorted(jobs, key=lambda job: -cost[job[1]]):
        least = loads.index(min(loads))
        shares[least].append(job)
        loads[least] += cost[job[1]]
    order = list(cost)
    return [sorted(share, key=lambda job: (order.index(job[1]), job[0])) for share in shares]


def device_memory_bytes(config: StudyConfig) -> int | None:
    """The device's memory, or None on the CPU (no plan to keep; also when a GPU study is summarised on the CPU)."""
    if config.device != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def memory_share(config: StudyConfig, processes: int) -> float:
    """The share of the device each of `processes` workers may hold (1 on the CPU); raises when it cannot fit."""
    device_bytes = device_memory_bytes(config)
    return 1.0 if device_bytes is None else memory_plan(config, device_bytes, processes)["share"]


class Launcher:
    """Starts phases of worker processes for one study directory and follows their progress lines."""

    def __init__(self, config: StudyConfig, output: Path, deadline: float | None) -> None:
        self.config, self.output, self.deadline = config, output, deadline
        output.mkdir(parents=True, exist_ok=True)
        self.config_path = output / "study_config.json"
        config.save(self.config_path)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RECIPES), self.env.get("PYTHONPATH")]))
        self.env.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
        self.env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(config.torch_threads))  # compile workers per process
        self.env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the warm start
        (output / "logs").mkdir(exist_ok=True)

    def time_left(self) -> bool:
        return self.deadline is None or time.time() < self.deadline

    def phase(self, phase: str, shares: list[list[str]]) -> list[int]:
        """One worker per share, all at once, each with the memory share of that many processes; their exit codes."""
        if not shares:
            return []
        share = memory_share(self.config, len(shares))
        workers = []
        for index, jobs in enumerate(shares):
            log = self.output / "logs" / f"{phase}{index}.log"
            command = [
                sys.executable, "-m", "ablation.study", phase, str(self.config_path), str(self.output),
                "--processes", str(len(shares)), "--memory-share", str(share),
                *(["--deadline", str(self.deadline)] if self.deadline is not None else []), "--jobs", *jobs,
            ]  # fmt: skip
            with log.open("a") as stream:
                process = subprocess.Popen(command, env=self.env, stdout=stream, stderr=subprocess.STDOUT)
            workers.append((process, log))
        return _follow(workers)

    def prepare(self, seeds: list[int], second_warm_start: int | None = None) -> list[int]:
        """One worker per seed (up to `workers`); `second_warm_start`: that seed's start point is made a second time
        beside them, in a process of its own where the workers allow one (the check's reproducibility test)."""
        workers = self.config.workers
        shares = [[str(s) for s in seeds[i::workers]] for i in range(min(workers, len(seeds)))]
        if second_warm_start is not None:
            job = f"{second_warm_start}:{REPRODUCE}"
            shares = [*shares, [job]] if len(shares) < workers else [*shares[:-1], [*shares[-1], job]]
        return self.phase("prepare", shares)


def prepare_start_points(launcher: Launcher, seeds: list[int], second_warm_start: int | None = None) -> list[int]:
    """The seeds' start points, and once more those a failed or lost worker left without one."""
    codes = launcher.prepare(seeds, second_warm_start)
    missing = [seed for seed in seeds if read_start(launcher.config, launcher.output, seed) is None]
    if missing and launcher.time_left():
        codes += launcher.prepare(missing)
    return codes


def launch_workers(config: StudyConfig, output: Path, cost: dict[str, float], deadline: float | None) -> list[int]:
    """The start points, the runs and one retry round; the workers' progress lines are printed as they come.
    `cost`: estimated seconds per variant's run, in run order. Returns every worker's exit code."""
    launcher = Launcher(config, output, deadline)
    codes = prepare_start_points(launcher, seeds_to_prepare(config, output))
    for _ in range(2):  # the runs, then the failed (or lost) ones once more, in as many processes as they need
        jobs = pending_jobs(config, output)
        if not jobs or not launcher.time_left():
            break
        shares = deal(jobs, cost, config.workers)
        codes += launcher.phase("run", [[f"{s}:{n}" for s, n in share] for share in shares])
    return codes


def _follow(workers: list[tuple[subprocess.Popen, Path]]) -> list[int]:
    """Print the workers' progress lines as they come, until every worker has exited."""
    offsets = {log: log.stat().st_size for _, log in workers}
    while True:
        done = all(process.poll() is not None for process, _ in workers)
        for log in offsets:
            text = log.read_text(errors="replace")
            complete = text.rfind("\n") + 1  # a line still being written waits for the next poll
            for line in text[offsets[log] : complete].splitlines():
                if line.startswith("[seed "):
                    print(line, flush=True)
            offsets[log] = max(offsets[log], complete)
        if done:
            return [process.returncode for process, _ in workers]
        time.sleep(2)


def load_seed_records(config: StudyConfig, output: Path) -> list[dict]:
    """Per seed with a start point: its warm start and every run from that start point (`runs` by variant)."""
    records = []
    for seed in config.seeds:
        start = read_start(config, output, seed)
        if start is None:
            continue
        runs = {}
        for variant in run_order(config):
            run = read_json(result_file(output, seed, variant.name))
            if run is not None and run.get("start_digest") == start["digest"]:
                runs[variant.name] = run
        records.append({**start, "runs": runs})
    return records


def job_estimate_s(config: StudyConfig, phase: str, job: str, processes: int) -> float:
    """The plan's seconds for one job with `processes` workers sharing the device (0: no estimate, always start)."""
    plan = estimate(config)
    if phase == "run":
        return plan["runs"][job.split(":")[1]]["total_s"] * shared(processes)
    if phase == "check":
        return plan["check_s"] * shared(processes)
    return 0.0


def _worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="ablation.study")
    parser.add_argument("phase", choices=("prepare", "run", "check"))
    parser.add_argument("config", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--memory-share", type=float, required=True)
    parser.add_argument("--deadline", type=float)
    parser.add_argument("--jobs", nargs="+", required=True, help="seeds (prepare) or SEED:VARIANT / SEED:RATE")
    args = parser.parse_args(argv)
    config, output = StudyConfig.load(args.config), args.output
    torch.set_num_threads(config.torch_threads)
    if config.device == "cuda":  # a worker that outgrows its share fails alone, not the others
        torch.cuda.set_per_process_memory_fraction(args.memory_share)
    if args.phase == "prepare":  # a start point rebuilt on a fresh machine must reproduce the recorded weights
        torch.use_deterministic_algorithms(True, warn_only=True)
    slower = 1.0  # how much longer this worker's jobs took than planned, at most
    for job in args.jobs:
        planned = job_estimate_s(config, args.phase, job, args.processes)
        if args.deadline is not None and planned and time.time() + planned * slower > args.deadline:
            seed, name = job.split(":")
            print(
                f"[seed {seed}] {name}: left for the next call ({planned * slower:.0f} s would pass the time budget)",
                flush=True,
            )
            continue
        began = time.perf_counter()
        if args.phase == "prepare" and job.endswith(f":{REPRODUCE}"):
            reproduce_job(config, output, int(job.split(":")[0]))
        elif args.phase == "prepare":
            prepare_seed(config, output, int(job))
        elif args.phase == "run":
            seed, name = job.split(":")
            run_job(config, output, int(seed), name, args.memory_share)
        else:
            seed, learning_rate = job.split(":")
            check_job(config, output, int(seed), float(learning_rate), args.memory_share)
        if planned:
            slower = max(slower, (time.perf_counter() - began) / planned)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
