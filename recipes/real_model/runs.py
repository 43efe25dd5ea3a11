"""The study's runs, each its own process on the shared device (`python -m real_model.runs CONFIG OUTPUT KIND SEED`):

- `dapo`: DAPOTrainer, full DAPO: Clip-Higher (0.2/0.28), dynamic sampling on accuracy, the token-mean loss, the soft
  overlong punishment, the paged rollout engine and padding-free training passes (where flash attention runs);
- `grpo_settings`: the same trainer, engine and passes with GRPO's settings: symmetric clip 0.2, no dynamic
  sampling, no overlong punishment (the loss stays DAPOTrainer's token-mean, its only loss);
- `trl_grpo`: TRL's `GRPOTrainer` with its defaults, on its transformers `generate` path: the wall-clock reference.

All three share the model copy, the data, the learning rate, the batch, the temperature and the length limit. Every
`eval_every` optimizer steps the held-out avg@k is measured with an evaluation engine (`scoring.py`), its time taken
out of the run's wall-clock, and the run's record (OUTPUT/runs/KIND-seedN.json) rewritten, so a run cut short keeps
its curve. A time budget stops a run cleanly after the step that passes it (status `stopped`); a rerun of the study
restarts such a run from the model copy (no trainer checkpoints are kept: a run is minutes long).
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
from trl import GRPOConfig, GRPOTrainer

from ablation.store import read_json, write_json
from ablation.variants import machinery_fields
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.data.tasks import task_splits
from trl_dapo.rewards.math import dapo_math_reward

from .config import DAPO, GRPO, TRL_GRPO, RealModelConfig
from .scoring import EngineScorer

ACCURACY = "accuracy"
TRAIN_METRICS = ("reward", "math/accuracy", "completions/mean_length", "completions/clipped_ratio", "entropy",
                 "clip_ratio/high_mean", "clip_ratio/low_mean", "dapo/gen_batches", "grad_norm")  # fmt: skip


class CountingMathReward:
    """DAPO's math reward (+1 / -1 on the `Answer:` line), counting the completions and tokens it scored."""

    def __init__(self) -> None:
        self.__name__ = ACCURACY  # TRL names a reward by `__name__`; dynamic sampling filters on it
        self.completions = self.tokens = 0

    def __call__(self, completions, answer, completion_ids, **kwargs: Any) -> list[float]:
        self.completions += len(completions)
        self.tokens += sum(len(ids) for ids in completion_ids)
        return dapo_math_reward(completions, answer, **kwargs)


# Of a process's share of the device, what its rollout engines may plan their KV pool in: the rest is headroom for the
# sampling head's chunks and the allocator's slack, as the engines' default 0.85 of a whole device leaves. Planned in
# the whole share, every DAPO run of the first H100 study ran out of memory in an evaluation's sampling head.
ENGINE_PART = 0.75


def run_file(output: Path, kind: str, seed: int) -> Path:
    return output / "runs" / f"{kind}-seed{seed}.json"


def model_copy(output: Path) -> Path:
    return output / "model"


def study_data(config: RealModelConfig, task: dict):
    return task_splits(task["family"], task["style"], config.num_train, config.num_test, config.data_seed)


def shared_fields(config: RealModelConfig, seed: int, output_dir: Path, temperature: float) -> dict[str, Any]:
    """The fields every run shares: model precision, data order, batch geometry, optimizer, sampling."""
    return dict(
        output_dir=str(output_dir),
        seed=seed,
        data_seed=seed,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=config.micro_batch_rows,
        gradient_checkpointing=True,  # both trainers' default, set so the study does not follow a changed default
        gradient_accumulation_steps=config.accumulation_steps,
        steps_per_generation=config.accumulation_steps * config.optimizer_steps_per_generation,
        num_generations=config.num_generations,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_completion_length=config.max_completion_length,
        temperature=temperature,
        top_p=1.0,
        **machinery_fields(config.bf16, config.device),
    )


def trainer_args(config: RealModelConfig, kind: str, seed: int, output_dir: Path, temperature: float, share: float):
    """The run's trainer class and its config."""
    values = shared_fields(config, seed, output_dir, temperature)
    if kind == TRL_GRPO:
        return GRPOTrainer, GRPOConfig(**values)
    dapo = kind == DAPO
    return DAPOTrainer, DAPOConfig(
        **values,
        beta=0.0,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high if dapo else config.epsilon,
        clip_ratio_c=None,  # the dual clip is in neither the paper's objective nor GRPO's
        dynamic_sampling=dapo,
        dynamic_sampling_metric=ACCURACY,
        dynamic_sampling_oversample="auto",
        dynamic_sampling_max_oversample=2.0,
        max_num_gen_batches=config.max_num_gen_batches,
        overlong_buffer_len=config.overlong_buffer_len if dapo else 0,
        rollout_engine="paged",
        rollout_memory_fraction=ENGINE_PART * share,
        padding_free=None,  # on where flash attention runs (CUDA, bf16)
    )


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HeldOutCurve(TrainerCallback):
    """Held-out avg@k at the evaluation steps, the training wall-clock without them, and the time budget."""

    def __init__(self, config, scorer, test, temperature: float, seed: int, reward, record, deadline) -> None:
        self.config, self.scorer, self.test, self.temperature, self.seed = config, scorer, test, temperature, seed
        self.reward, self.record, self.deadline = reward, record, deadline
        self.excluded = 0.0
        self.began = time.perf_counter()

    def evaluate(self, model, step: int) -> None:
        _synchronize()  # the step's queued kernels count as training, not evaluation
        began = time.perf_counter()
        scores = self.scorer.score(model, self.test, self.temperature, self.seed)
        _synchronize()
        wall_clock = 0.0 if step == 0 else began - self.began - self.excluded
        self.excluded += time.perf_counter() - began
        point = {"step": step, "wall_clock_s": wall_clock, "generated_completions": self.reward.completions,
                 "generated_tokens": self.reward.tokens, **scores}  # fmt: skip
        self.record(point)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.began = time.perf_counter()
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step in self.config.eval_steps():
            self.evaluate(model, state.global_step)
        if self.deadline is not None and time.time() > self.deadline:
            control.should_training_stop = True
            if state.global_step not in self.config.eval_steps():
                self.evaluate(model, state.global_step)


def run(config: RealModelConfig, output: Path, task: dict, kind: str, seed: int, share: float, deadline) -> dict:
    """One run from the model copy; its record is rewritten after every evaluation."""
    path, began = run_file(output, kind, seed), time.perf_counter()
    result: dict[str, Any] = {"kind": kind, "seed": seed, "task": task["cell"], "settings": config.fingerprint(),
                              "status": "running", "curve": []}  # fmt: skip

    def record(point: dict) -> None:
        result["curve"].append(point)
        write_json(path, result)

    tokenizer = AutoTokenizer.from_pretrained(model_copy(output))
    data = study_data(config, task)
    trainer_class, args = trainer_args(config, kind, seed, output / "trainer" / f"{kind}-seed{seed}",
                                       task["temperature"], share)  # fmt: skip
    reward = CountingMathReward()
    trainer = trainer_class(model=str(model_copy(output)), reward_funcs=[reward], args=args,
                            train_dataset=data["train"], processing_class=tokenizer)  # fmt: skip
    scorer = EngineScorer(trainer.model, tokenizer, config.k, config.max_completion_length, config.engine_max_rows,
                          ENGINE_PART * share, config.device)  # fmt: skip
    curve = HeldOutCurve(config, scorer, data["test"], task["temperature"], seed, reward, record, deadline)
    trainer.add_callback(curve)
    trainer.train()
    last, engine = result["curve"][-1], getattr(trainer, "paged_engine", None)
    result |= {
        "status": "ok" if trainer.state.global_step >= config.max_steps else "stopped",
        "trainer": type(trainer).__name__,
        "steps": trainer.state.global_step,
        "train_s": last["wall_clock_s"],
        "total_s": time.perf_counter() - began,
        "generated_completions": reward.completions,
        "generated_tokens": reward.tokens,
        "padding_free": getattr(trainer, "padding_free", False),  # DAPOTrainer's resolved choice; TRL's: padded
        "rollout_engine": "transformers generate" if engine is None else type(engine).__name__,
        "train": {name: [[e["step"], e[name]] for e in trainer.state.log_history if name in e] for name in TRAIN_METRICS},
    }  # fmt: skip
    if torch.cuda.is_available():
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    write_json(path, result)
    return result


def is_done(config: RealModelConfig, output: Path, kind: str, seed: int) -> bool:
    previous = read_json(run_file(output, kind, seed))
    return bool(previous and previous["status"] == "ok" and previous["settings"] == config.fingerprint())


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="real_model.runs")
    parser.add_argument("output", type=Path)
    parser.add_argument("kind", choices=(DAPO, GRPO, TRL_GRPO))
    parser.add_argument("seed", type=int)
    parser.add_argument("--memory-share", type=float, required=True)
    parser.add_argument("--deadline", type=float)
    args = parser.parse_args(argv)
    config = RealModelConfig.load(args.output / "study_config.json")
    task = read_json(args.output / "pick.json")
    torch.set_num_threads(config.torch_threads)
    if config.device == "cuda":  # a run that outgrows its share fails alone, not the others
        torch.cuda.set_per_process_memory_fraction(args.memory_share)
    try:
        result = run(config, args.output, task, args.kind, args.seed, args.memory_share, args.deadline)
    except Exception:
        failed = read_json(run_file(args.output, args.kind, args.seed)) or {"curve": []}
        result = {**failed, "kind": args.kind, "seed": args.seed, "status": "failed", "error": traceback.format_exc(),
                  "settings": config.fingerprint()}  # fmt: skip
        write_json(run_file(args.output, args.kind, args.seed), result)
    gc.collect()
    print(f"[run] {args.kind} seed {args.seed}: {result['status']}", flush=True)
    return 0 if result["status"] != "failed" else 1


if __name__ == "__main__":
    raise SystemExit(_main())
