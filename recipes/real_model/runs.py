"""One run of the study (a pilot run or an arm) in a process of its own on the shared device:

    python -m real_model.runs OUTPUT --memory-share S [--deadline T] --jobs NAME...

runs the jobs OUTPUT/jobs/NAME.json in turn (`schedule.py` writes them), each from the model copy. Every `eval_every`
optimizer steps the held-out avg@k and what `scoring.cap_scores` reads beside it are measured with an evaluation
engine of the run's own, its time taken out of the run's wall-clock, and the run's record rewritten, so a run cut
short keeps its curve. A deadline stops a run cleanly after the step that passes it (status `stopped`; a later call
restarts it from the model copy: no trainer checkpoints are kept, a run is minutes long).
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, TrainerCallback

from ablation.store import read_json, write_json
from trl_dapo.data.tasks import task_splits
from trl_dapo.rewards.math import dapo_math_reward

from .arms import ACCURACY, evaluation_plan, trainer_args
from .config import CELLS, RealModelConfig, digest
from .scoring import EngineScorer

# Training metrics kept per optimizer step (TRL's, DAPOTrainer's and the reward's over every generated completion).
TRAIN_METRICS = (
    "reward",
    "math/accuracy",
    "completions/mean_length",
    "completions/clipped_ratio",
    "entropy",
    "clip_ratio/high_mean",
    "clip_ratio/low_mean",
    "dapo/gen_batches",
    "dapo/generated_groups",
    "dapo/qualified_groups",
    "logprob_gap_mean",
    "grad_norm",
    "study/truncated",
    "study/informative_groups",
    "study/mean_length",
)


class CountingMathReward:
    """DAPO's math reward (+1 / -1 on the `Answer:` line), counting the completions and tokens it scored and logging,
    per call, over every completion generated (TRL's completion metrics describe only the trained groups under
    dynamic sampling): the share cut at the cap (no end token), the mean length and the share of informative groups
    (some but not all samples right)."""

    def __init__(self, group_size: int, end_tokens: frozenset[int]) -> None:
        self.__name__ = ACCURACY  # TRL names a reward by `__name__`; dynamic sampling filters on it
        self.group_size, self.end_tokens = group_size, end_tokens
        self.completions = self.tokens = 0

    def __call__(self, completions, answer, completion_ids, log_metric=None, **kwargs: Any) -> list[float]:
        rewards = dapo_math_reward(completions, answer, log_metric=log_metric, **kwargs)
        size, lengths = self.group_size, [len(ids) for ids in completion_ids]
        if log_metric is not None and completion_ids:
            truncated = sum(not ids or ids[-1] not in self.end_tokens for ids in completion_ids)
            log_metric("study/truncated", truncated / len(completion_ids))
            log_metric("study/mean_length", sum(lengths) / len(lengths))
            right = [sum(r > 0 for r in rewards[i : i + size]) for i in range(0, len(rewards), size)]
            log_metric("study/informative_groups", sum(0 < r < size for r in right) / len(right))
        self.completions += len(completions)
        self.tokens += sum(lengths)
        return rewards


BUILDING = "building"  # a run's status while its trainer is built, before its first evaluation


def model_copy(output: Path) -> Path:
    return output / "model"


def run_name(cell: str, kind: str, seed: int) -> str:
    """A run's name in the study folder: the first cell's runs unprefixed (as the first studies named them)."""
    return f"{kind}-seed{seed}" if cell == CELLS[0] else f"{cell}-{kind}-seed{seed}"


def run_file(output: Path, kind: str, seed: int, cell: str = CELLS[0]) -> Path:
    return output / "runs" / f"{run_name(cell, kind, seed)}.json"


def job_fingerprint(config: RealModelConfig, job: dict) -> str:
    """What a run's record depends on: the study's settings and the job's arm, seed, task, rate and length."""
    keys = ("kind", "arm", "seed", "task", "learning_rate", "max_steps")
    return digest({"config": config.fingerprint(), **{key: job.get(key) for key in keys}})


def is_done(config: RealModelConfig, job: dict) -> bool:
    previous = read_json(Path(job["record"]))
    return bool(previous and previous["status"] == "ok" and previous["settings"] == job_fingerprint(config, job))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HeldOutCurve(TrainerCallback):
    """Held-out scores at the evaluation steps, the training wall-clock without them, and the deadline."""

    def __init__(self, eval_steps, scorer, test, job: dict, reward, record, deadline) -> None:
        self.eval_steps, self.scorer, self.test, self.job = eval_steps, scorer, test, job
        self.reward, self.record, self.deadline = reward, record, deadline
        self.excluded = 0.0
        self.began = time.perf_counter()

    def evaluate(self, model, step: int) -> None:
        _synchronize()  # the step's queued kernels count as training, not evaluation
        began = time.perf_counter()
        scores = self.scorer.score(model, self.test, self.job["task"]["temperature"], self.job["seed"])
        _synchronize()
        wall_clock = 0.0 if step == 0 else began - self.began - self.excluded
        self.excluded += time.perf_counter() - began
        self.record({"step": step, "wall_clock_s": wall_clock, "generated_completions": self.reward.completions,
                     "generated_tokens": self.reward.tokens, **scores})  # fmt: skip

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.began = time.perf_counter()
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.eval_steps:
            self.evaluate(model, state.global_step)
        if self.deadline is not None and time.time() > self.deadline:
            control.should_training_stop = True
            if state.global_step not in self.eval_steps:
                self.evaluate(model, state.global_step)


def build(config: RealModelConfig, output: Path, job: dict, share: float):
    """The job's trainer over the model copy, its counting reward and its held-out problems."""
    tokenizer = AutoTokenizer.from_pretrained(model_copy(output))
    task = job["task"]
    data = task_splits(task["family"], task["style"], config.num_train, config.num_test, config.data_seed)
    ends = frozenset({tokenizer.eos_token_id, tokenizer.pad_token_id})
    trainer_class, args = trainer_args(config, job, str(output / "trainer" / job["name"]), share)
    reward = CountingMathReward(config.num_generations, ends)
    trainer = trainer_class(model=str(model_copy(output)), reward_funcs=[reward], args=args,
                            train_dataset=data["train"], processing_class=tokenizer)  # fmt: skip
    return trainer, reward, tokenizer, data["test"]


def run(config: RealModelConfig, output: Path, job: dict, share: float, deadline: float | None) -> dict:
    """One run from the model copy; its record is rewritten after every evaluation."""
    path, began = Path(job["record"]), time.perf_counter()
    result: dict[str, Any] = {"kind": job["kind"], "arm": job.get("arm", job["kind"]), "seed": job["seed"],
                              "task": job["task"]["cell"], "learning_rate": job["learning_rate"],
                              "max_steps": job["max_steps"], "settings": job_fingerprint(config, job),
                              "memory_share": share, "status": "running", "curve": []}  # fmt: skip

    def record(point: dict) -> None:
        result["curve"].append(point)
        write_json(path, result)

    trainer, reward, tokenizer, test = build(config, output, job, share)
    plan = evaluation_plan(config, job, share)
    scorer = EngineScorer(trainer.model, tokenizer, config.k, job["task"]["cap"], plan["max_rows"],
                          plan["memory_fraction"], config.device, plan["max_cache_tokens"])  # fmt: skip
    result["evaluation_plan"] = plan | memory_now()
    eval_steps = config.eval_steps(job["max_steps"])
    trainer.add_callback(HeldOutCurve(eval_steps, scorer, test, job, reward, record, deadline))
    trainer.train()
    last, engine = result["curve"][-1], getattr(trainer, "paged_engine", None)
    history = trainer.state.log_history
    result |= {
        "status": "ok" if trainer.state.global_step >= job["max_steps"] else "stopped",
        "trainer": type(trainer).__name__,
        "steps": trainer.state.global_step,
        "train_s": last["wall_clock_s"],
        "total_s": time.perf_counter() - began,
        "generated_completions": reward.completions,
        "generated_tokens": reward.tokens,
        "padding_free": getattr(trainer, "padding_free", False),  # DAPOTrainer's resolved choice; TRL's: padded
        # float32 unless the generation path cast the trained weights (TRL's continuous batching under bf16)
        "trained_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters()}),
        "rollout_engine": rollout_engine(trainer, engine),
        "train": {name: [[e["step"], e[name]] for e in history if name in e] for name in TRAIN_METRICS},
    }
    if torch.cuda.is_available():
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    write_json(path, result)
    return result


def memory_now() -> dict:
    """The process's device memory when its evaluation engine was built (beside vLLM's, a collision shows here)."""
    if not torch.cuda.is_available():
        return {}
    return {"allocated_bytes": torch.cuda.memory_allocated(), "reserved_bytes": torch.cuda.memory_reserved()}


def rollout_engine(trainer, engine) -> str:
    if engine is not None:
        return type(engine).__name__
    if getattr(trainer, "use_vllm", False):
        return "vLLM colocated"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "transformers continuous batching"
    return "transformers generate"


def run_job(config: RealModelConfig, output: Path, job: dict, share: float, deadline: float | None) -> str:
    """The job's status after running it; a failure is recorded with its traceback, never raised."""
    try:
        status = run(config, output, job, share, deadline)["status"]
    except Exception:
        failed = read_json(Path(job["record"])) or {"curve": []}
        status = "failed"
        write_json(Path(job["record"]), {**failed, "kind": job["kind"], "seed": job["seed"], "status": status,
                                         "error": traceback.format_exc(), "settings": job_fingerprint(config, job)})  # fmt: skip
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(f"[run] {job['name']}: {status}", flush=True)
    return status


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="real_model.runs")
    parser.add_argument("output", type=Path)
    parser.add_argument("--memory-share", type=float, required=True)
    parser.add_argument("--deadline", type=float)
    parser.add_argument("--jobs", nargs="+", required=True)
    args = parser.parse_args(argv)
    config = RealModelConfig.load(args.output / "study_config.json")
    torch.set_num_threads(config.torch_threads)
    if config.device == "cuda":  # a run that outgrows its share fails alone, not the others
        torch.cuda.set_per_process_memory_fraction(args.memory_share)
    statuses = []
    for name in args.jobs:
        if args.deadline is not None and time.time() > args.deadline:
            print(f"[run] {name}: left for the next call (deadline passed)", flush=True)
            continue
        job = read_json(args.output / "jobs" / f"{name}.json")
        statuses.append(run_job(config, args.output, job, args.memory_share, args.deadline))
    return int("failed" in statuses)


if __name__ == "__main__":
    raise SystemExit(_main())
