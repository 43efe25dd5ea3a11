"""Every setting of the real-model study in one place, and its CPU smoke preset.

Sized for about 13 minutes of one GPU (H100 or H200): the grid (16 cells x 64 problems x 16 samples on the paged
engine), then 7 runs at once on the device: DAPO and DAPOTrainer with GRPO's settings, 3 seeds each, and TRL's
`GRPOTrainer` with its defaults for 1 seed. Every run shares the model, the data, the learning rate, the batch (16
prompts x 8 samples per optimizer step, two optimizer steps per generation batch), the temperature and the length limit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from trl_dapo.data.tasks import FAMILIES, PROMPT_STYLES

DAPO, GRPO, TRL_GRPO = "dapo", "grpo_settings", "trl_grpo"
RUN_KINDS = (DAPO, GRPO, TRL_GRPO)


@dataclass(frozen=True)
class RealModelConfig:
    # ---- the grid: base-model accuracy per (family, prompt style, temperature)
    families: tuple[str, ...] = tuple(FAMILIES)
    styles: tuple[str, ...] = tuple(PROMPT_STYLES)
    temperatures: tuple[float, ...] = (0.7, 1.0)
    grid_problems: int = 64
    k: int = 16  # samples per problem: avg@k and pass@k, in the grid and in the study's evaluations
    band_low: float = 0.2  # the rule: base pass@k in [band_low, band_high] and avg@k below max_mean
    band_high: float = 0.8
    max_mean: float = 0.4
    data_seed: int = 1234
    # ---- the study's data: held-out problems first, training problems disjoint from them
    num_train: int = 4000
    num_test: int = 64
    # ---- RL, the same for every run
    num_generations: int = 8
    prompts_per_step: int = 16
    micro_batch_rows: int = 16  # completions per pass; with gradient checkpointing its logits (2.8 GB) dominate
    optimizer_steps_per_generation: int = 2
    max_steps: int = 48
    eval_every: int = 8
    # AdamW moves each weight by about the learning rate per step: at 1e-5, 48 steps move a weight by at most 5e-4, a
    # percent or two of SmolLM2's typical weight; a third of the ablation's 3.33e-5 at a similar width (576 against
    # 512), with 2 updates per generation batch instead of 16 (docs/real-model.md, "Learning rate")
    learning_rate: float = 1e-5
    max_completion_length: int = 256
    overlong_buffer_len: int = 64  # DAPO's soft overlong punishment from 192 tokens on (a quarter of the limit)
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    max_num_gen_batches: int = 4
    seeds: tuple[int, ...] = (0, 1, 2)
    trl_seeds: tuple[int, ...] = (0,)
    # ---- machinery
    device: str = "cuda"
    bf16: bool = True
    engine_max_rows: int = 512  # decode slots of the evaluation engine
    torch_threads: int = 2  # per worker process

    def __post_init__(self) -> None:
        unknown = set(self.families) - set(FAMILIES) | set(self.styles) - set(PROMPT_STYLES)
        if unknown:
            raise ValueError(f"families/styles: {sorted(unknown)} unknown; choose from {sorted(FAMILIES)} and "
                             f"{sorted(PROMPT_STYLES)}.")  # fmt: skip
        if self.max_steps % self.optimizer_steps_per_generation:
            raise ValueError(
                f"max_steps={self.max_steps} must be a multiple of optimizer_steps_per_generation="
                f"{self.optimizer_steps_per_generation}, so no run ends inside a generation batch."
            )
        if not 0 < self.eval_every <= self.max_steps:
            raise ValueError(f"eval_every={self.eval_every} must be in 1..max_steps ({self.max_steps}).")
        if self.rows_per_step % self.micro_batch_rows or self.micro_batch_rows % self.num_generations:
            raise ValueError(
                f"micro_batch_rows={self.micro_batch_rows} must divide prompts_per_step x num_generations "
                f"({self.rows_per_step}) and be a multiple of num_generations ({self.num_generations})."
            )
        if not 0 < self.overlong_buffer_len < self.max_completion_length:
            raise ValueError("overlong_buffer_len must be in 1..max_completion_length - 1.")

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def accumulation_steps(self) -> int:
        return self.rows_per_step // self.micro_batch_rows

    def eval_steps(self) -> list[int]:
        """Optimizer steps with a held-out evaluation: 0, every `eval_every`, and the last."""
        return sorted({0, *range(self.eval_every, self.max_steps + 1, self.eval_every), self.max_steps})

    def grid_fingerprint(self) -> str:
        """What a grid cell depends on: a cell recorded under other values is measured again."""
        keys = ("grid_problems", "k", "data_seed", "max_completion_length", "bf16")
        return _digest({key: getattr(self, key) for key in keys})

    def fingerprint(self) -> str:
        """What a run depends on (not which seeds run nor the host threads)."""
        return _digest({k: v for k, v in asdict(self).items() if k not in ("seeds", "trl_seeds", "torch_threads")})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> RealModelConfig:
        values = json.loads(Path(path).read_text())
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def with_overrides(self, **overrides) -> RealModelConfig:
        known = {f.name for f in fields(self)}
        if set(overrides) - known:
            raise ValueError(f"unknown study settings {sorted(set(overrides) - known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


STUDY = RealModelConfig()


def smoke(config: RealModelConfig) -> RealModelConfig:
    """The pipeline end to end on the CPU in seconds with a tiny model: one grid cell, one step per run, one
    evaluation after it, one seed each."""
    return config.with_overrides(
        families=("add1",),
        styles=("dapo",),
        temperatures=(1.0,),
        grid_problems=4,
        k=2,
        band_low=0.0,
        band_high=1.0,
        max_mean=1.0,
        num_train=16,
        num_test=4,
        num_generations=2,
        prompts_per_step=2,
        micro_batch_rows=4,
        optimizer_steps_per_generation=1,
        max_steps=1,
        eval_every=1,
        learning_rate=1e-4,
        max_completion_length=8,
        overlong_buffer_len=2,
        max_num_gen_batches=2,
        seeds=(0,),
        trl_seeds=(0,),
        device="cpu",
        bf16=False,
        engine_max_rows=16,
        torch_threads=1,
    )
