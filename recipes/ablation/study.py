"""Running the study: worker processes that each take some seeds, and per seed the warm start and every variant.

Each worker is a separate process (`python -m ablation.study CONFIG OUTPUT SEED...`), so a crash in one seed's runs
cannot take the others down, and several workers can share one GPU: the models are small and their steps
launch-bound, so the GPU is mostly idle inside any one of them. A worker rewrites its seed's JSON after every run, so
a study cut short keeps what finished.
"""

from __future__ import annotations

import gc
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
from .variants import Variant, build_trainer, run_order

RECIPES = Path(__file__).resolve().parent.parent
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


def seed_file(output: Path, seed: int) -> Path:
    return output / "runs" / f"seed{seed}.json"


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


def run_variant(variant: Variant, config: StudyConfig, seed: int, model_dir: Path, data, start_point: dict) -> dict:
    """One RL run; a failure is recorded with its traceback and the other runs go on."""
    began, trainer = time.perf_counter(), None
    try:
        tokenizer = load_tokenizer(model_dir)
        output_dir = model_dir.parent.parent / "trainer" / f"seed{seed}" / variant.name
        trainer, reward = build_trainer(variant, config, seed, model_dir, tokenizer, data["train"], output_dir)
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


def run_seed(config: StudyConfig, output: Path, seed: int) -> dict:
    """Build and warm-start this seed's model, evaluate it (step 0 of every variant), then run every variant."""
    data = addition_splits(config.num_train, config.test_per_bucket, config.buckets, config.data_seed)
    model_dir = output / "models" / f"seed{seed}"
    build_model(model_dir, config, seed)
    record: dict[str, Any] = {"seed": seed}
    record["warm_start"] = warm_start(model_dir, config, set(data["test"]["prompt"]), seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(config.device)
    began = time.perf_counter()
    start = evaluate(model, load_tokenizer(model_dir), data["test"], eval_settings(config, seed))
    record["step0_eval_s"] = time.perf_counter() - began
    del model
    start_point = {"step": 0, "wall_clock_s": 0.0, "generated_completions": 0, "generated_tokens": 0, **start}
    record["runs"] = {}
    path = seed_file(output, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    for variant in run_order(config):
        result = run_variant(variant, config, seed, model_dir, data, start_point)
        record["runs"][variant.name] = result
        path.write_text(json.dumps(record, indent=2))
        print(f"[seed {seed}] {variant.name}: {result['status']} in {result['total_s']:.1f} s", flush=True)
    return record


def launch_workers(config: StudyConfig, output: Path) -> list[int]:
    """Deal the seeds round-robin to `workers` processes, stream their logs, and return their exit codes."""
    output.mkdir(parents=True, exist_ok=True)
    config_path = output / "study_config.json"
    config.save(config_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RECIPES), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", str(config.torch_threads))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(config.torch_threads))  # compile workers per process
    shares = [config.seeds[i :: config.workers] for i in range(min(config.workers, len(config.seeds)))]
    (output / "logs").mkdir(exist_ok=True)
    workers = []
    for share in shares:
        log = output / "logs" / f"seeds{'-'.join(map(str, share))}.log"
        command = [sys.executable, "-m", "ablation.study", str(config_path), str(output), *map(str, share)]
        with log.open("w") as stream:
            workers.append((subprocess.Popen(command, env=env, stdout=stream, stderr=subprocess.STDOUT), log))
    return _follow(workers)


def _follow(workers: list[tuple[subprocess.Popen, Path]]) -> list[int]:
    """Print the workers' progress lines as they come, until every worker has exited."""
    offsets = dict.fromkeys((log for _, log in workers), 0)
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
    return [json.loads(seed_file(output, s).read_text()) for s in config.seeds if seed_file(output, s).exists()]


def _worker_main(argv: list[str]) -> None:
    config = StudyConfig.load(argv[0])
    torch.set_num_threads(config.torch_threads)
    for seed in map(int, argv[2:]):
        run_seed(config, Path(argv[1]), seed)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
