"""Running the study in two phases of worker processes that share the device, resumable.

1. *Start points*: one process per seed (up to `workers`) builds the seed's model, warm-starts it and evaluates it
   (step 0 of every variant), and records a digest of the warm-started weights.
2. *Runs*: every (seed, variant) pair is one job; the jobs are dealt to `workers` processes, longest first to the
   least loaded, so the device stays shared by about `workers` runs until the end.

Each worker is a separate process (`python -m ablation.study PHASE CONFIG OUTPUT JOB...`), so a crash in one run
cannot take the others down; the models are small and their steps launch-bound, so the GPU is mostly idle inside any
one of them. Every finished start point and run is its own file under `OUTPUT/runs/seed*/`, so a study cut short
keeps what finished, and rerunning the same command does only what is missing: a start point whose model is gone
(a fresh machine) is warm-started again, deterministically, and must reproduce the recorded digest, else that
seed's earlier runs did not start from it and are set aside (`runs/seed*/stale/`) to be run again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from trl_dapo.data.addition import addition_splits

from .config import StudyConfig
from .evaluation import EvalSettings, HeldOutCurve, evaluate
from .model import build_model, load_tokenizer, warm_start
from .variants import Variant, build_trainer, run_order, variant_named

RECIPES = Path(__file__).resolve().parent.parent
START = "start"  # the start point's file name beside the runs' (no variant is called so)
# Training metrics kept per optimizer step (TRL's, DAPOTrainer's and the reward's).
TRAIN_METRICS = (
    "entropy",
    "completions/mean_length",
    "completions/clipped_ratio",
    "reward",
    "study/informative_groups",
    "study/solve_rate",
    "dapo/sampling_efficiency",
    "dapo/gen_batches",
    "dapo/partial_batch",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "grad_norm",
)


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


def study_data(config: StudyConfig) -> dict:
    return addition_splits(config.num_train, config.test_per_bucket, config.buckets, config.data_seed)


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
    recorded, path = read_json(result_file(output, seed, START)), model_dir(output, seed)
    if recorded and recorded.get("settings") != config.fingerprint():
        recorded = None  # recorded under other settings: nothing of it is reused
    if recorded and path.exists() and weights_digest(path) == recorded["digest"]:
        print(f"[seed {seed}] start point kept (weights digest {recorded['digest'][:12]})", flush=True)
        return recorded
    data = study_data(config)
    build_model(path, config, seed)
    record: dict[str, Any] = {"seed": seed, "settings": config.fingerprint()}
    record["warm_start"] = warm_start(path, config, set(data["test"]["prompt"]), seed)
    record["digest"] = weights_digest(path)
    if recorded and recorded["digest"] == record["digest"]:  # reproduced: the earlier runs' step 0 stays theirs
        record["start_point"], record["step0_eval_s"] = recorded["start_point"], recorded["step0_eval_s"]
    else:
        model = AutoModelForCausalLM.from_pretrained(path).to(config.device)
        began = time.perf_counter()
        record["start_point"] = evaluate(model, load_tokenizer(path), data["test"], eval_settings(config, seed))
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


def run_variant(variant: Variant, config: StudyConfig, seed: int, output: Path, data, start_point: dict) -> dict:
    """One RL run from the seed's start point; a failure is recorded with its traceback and the other runs go on."""
    began, trainer = time.perf_counter(), None
    try:
        path = model_dir(output, seed)
        tokenizer = load_tokenizer(path)
        output_dir = output / "trainer" / f"seed{seed}" / variant.name
        trainer, reward = build_trainer(variant, config, seed, path, tokenizer, data["train"], output_dir)
        built = time.perf_counter()
        curve = HeldOutCurve(tokenizer, data["test"], eval_settings(config, seed), config.eval_steps(), reward)
        trainer.add_callback(curve)
        trainer.train()
        engine = getattr(trainer, "rollout_engine", None)
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
        }
    except Exception:
        return {"status": "failed", "error": traceback.format_exc(), "total_s": time.perf_counter() - began}
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_job(config: StudyConfig, output: Path, seed: int, name: str) -> None:
    start = read_json(result_file(output, seed, START))
    if weights_digest(model_dir(output, seed)) != start["digest"]:  # a rebuild that died before recording itself
        result = {"status": "failed", "error": "the seed's model is not its recorded start point", "total_s": 0.0}
    else:
        point = {"step": 0, "wall_clock_s": 0.0, "generated_completions": 0, "generated_tokens": 0}
        result = run_variant(
            variant_named(name), config, seed, output, study_data(config), point | start["start_point"]
        )
    result["start_digest"], result["settings"] = start["digest"], config.fingerprint()
    write_json(result_file(output, seed, name), result)
    print(f"[seed {seed}] {name}: {result['status']} in {result['total_s']:.1f} s", flush=True)


def pending_jobs(config: StudyConfig, output: Path) -> list[tuple[int, str]]:
    """The (seed, variant) runs without a successful result from the seed's current start point under these
    settings; a seed without a start point (its warm start failed) has none to run."""
    jobs, settings = [], config.fingerprint()
    for seed in config.seeds:
        start = read_json(result_file(output, seed, START))
        if start is None or start.get("settings") != settings:
            continue
        for variant in run_order(config):
            done = read_json(result_file(output, seed, variant.name))
            if not (done and done["status"] == "ok" and done.get("start_digest") == start["digest"]
                    and done.get("settings") == settings):  # fmt: skip
                jobs.append((seed, variant.name))
    return jobs


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


def launch_workers(config: StudyConfig, output: Path, cost: dict[str, float]) -> list[int]:
    """Both phases; the workers' progress lines are printed as they come. `cost`: estimated seconds per variant's
    run, in run order. Returns every worker's exit code."""
    output.mkdir(parents=True, exist_ok=True)
    config_path = output / "study_config.json"
    config.save(config_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RECIPES), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(config.torch_threads))  # compile workers per process
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the warm start
    (output / "logs").mkdir(exist_ok=True)

    def start(phase: str, shares: list[list[str]]) -> list[int]:
        workers = []
        for index, share in enumerate(shares):
            log = output / "logs" / f"{phase}{index}.log"
            command = [sys.executable, "-m", "ablation.study", phase, str(config_path), str(output), *share]
            with log.open("a") as stream:
                workers.append((subprocess.Popen(command, env=env, stdout=stream, stderr=subprocess.STDOUT), log))
        return _follow(workers)

    seeds = [str(seed) for seed in config.seeds]
    codes = start("prepare", [seeds[i :: config.workers] for i in range(min(config.workers, len(seeds)))])
    jobs = pending_jobs(config, output)
    return codes + start("run", [[f"{s}:{n}" for s, n in share] for share in deal(jobs, cost, config.workers)])


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
        start = read_json(result_file(output, seed, START))
        if start is None or start.get("settings", config.fingerprint()) != config.fingerprint():
            continue  # (results recorded before settings fingerprints are read as the study's)
        runs = {}
        for variant in run_order(config):
            run = read_json(result_file(output, seed, variant.name))
            if run is not None and run.get("start_digest") == start["digest"]:
                runs[variant.name] = run
        records.append({**start, "runs": runs})
    return records


def _worker_main(argv: list[str]) -> None:
    phase, config, output = argv[0], StudyConfig.load(argv[1]), Path(argv[2])
    torch.set_num_threads(config.torch_threads)
    if phase == "prepare":  # a start point rebuilt on a fresh machine must reproduce the recorded weights
        torch.use_deterministic_algorithms(True, warn_only=True)
    for job in argv[3:]:
        if phase == "prepare":
            prepare_seed(config, output, int(job))
        else:
            seed, name = job.split(":")
            run_job(config, output, int(seed), name)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
