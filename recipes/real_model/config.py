"""Every setting of the real-model study in one place, its run kinds in the order they run, and its CPU smoke preset.

The study looks for a regime where DAPO's pieces act on a small pretrained model (SmolLM2-135M-Instruct): most
groups all-wrong at the start, completions long enough that some are cut. It runs in three phases, each kept on disk
and resumed by the same command:

1. the grid: the base model's avg@16, pass@16 and truncated share per task family x prompt style x length cap
   (sampled once at the largest cap; each smaller cap is the same samples cut there);
2. the pilot: GRPO's settings for `pilot_steps` on the grid's best candidates at each pilot learning rate; a fixed
   rule (`pilot.py`) picks two cells, each with its learning rate and step count, before any arm runs;
3. the arms, in the order of `run_order` (the most decisive first): on the first cell DAPO, GRPO's settings and TRL's
   `GRPOTrainer` seed by seed; the same three on the second cell; TRL with vLLM colocated; then the single-piece
   ablations, partial rollouts and TRL's continuous batching.

Sized from the first H100 study (2026-12-06: 7 processes, 48 steps of 16 prompts x 8 samples at a 256-token cap in
about 5 minutes each): 8 prompts x 8 samples per step, at most 32 steps, a cap of at most 192, 9 runs at once (three
seeds of the three compared arms).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from trl_dapo.data.tasks import FAMILIES, PROMPT_STYLES

DAPO, GRPO = "dapo", "grpo_settings"
PARTIAL = "dapo_partial_kept"
NO_DYNAMIC_SAMPLING, SYMMETRIC_CLIP, NO_OVERLONG = (
    "dapo_no_dynamic_sampling",
    "dapo_symmetric_clip",
    "dapo_no_overlong",
)
TRL_GRPO, TRL_VLLM, TRL_CONTINUOUS = "trl_grpo", "trl_grpo_vllm", "trl_grpo_continuous_batching"
PILOT = "pilot"  # GRPO's settings on a pilot cell at a pilot learning rate
ABLATIONS = (NO_DYNAMIC_SAMPLING, SYMMETRIC_CLIP, NO_OVERLONG)
TRL_KINDS = (TRL_GRPO, TRL_VLLM, TRL_CONTINUOUS)
COMPARED = (DAPO, GRPO, TRL_GRPO)  # the arms run on both cells, seed by seed
RUN_KINDS = (DAPO, GRPO, PARTIAL, *ABLATIONS, *TRL_KINDS)
CELLS = ("first", "second")  # the pick's cell, and the second cell picked with it by the same rule


@dataclass(frozen=True)
class RealModelConfig:
    # ---- the grid: the base model per (family, prompt style, length cap), at the rollout temperature
    # `add1` is left out: on it both DAPO and GRPO's settings reach the task's ceiling (0.90-0.95) by step 32
    families: tuple[str, ...] = ("add12", "add2", "word2")
    styles: tuple[str, ...] = tuple(PROMPT_STYLES)
    temperature: float = 1.0  # DAPO's rollout temperature; the entropy the study reads is the policy's own at 1.0
    caps: tuple[int, ...] = (96, 128, 192)  # candidate max_completion_length values
    grid_problems: int = 64
    k: int = 16  # samples per problem: avg@k and pass@k, in the grid and in every evaluation
    max_base_avg: float = 0.05  # the regime: most groups all-wrong at the start ...
    min_base_pass: float = 0.1  # ... but some problem sometimes right
    min_truncated: float = 0.05  # ... and enough completions at the cap for the overlong shaping to act on
    data_seed: int = 1234
    # ---- the pilot: GRPO's settings on the best candidates; the pick's rule is in pilot.py
    pilot_cells: int = 2
    pilot_learning_rates: tuple[float, ...] = (1e-5, 3e-5, 1e-4)  # the first study's rate, 3x and 10x it
    pilot_steps: int = 16
    pilot_seed: int = 1000  # apart from the study's seeds
    learned_level: float = 0.1  # held-out avg@k a pilot run must pass ...
    line_accuracy_gain: float = 0.05  # ... while the accuracy of completions with an `Answer:` line rises this much
    min_steps: int = 16  # the study's step count: twice the pilot's step to `learned_level`, within these bounds
    max_steps: int = 32
    # ---- the study's data: held-out problems first (the grid's), training problems disjoint from them
    num_train: int = 4000
    num_test: int = 64
    # ---- RL, the same for every arm
    num_generations: int = 8
    prompts_per_step: int = 8
    micro_batch_rows: int = 16  # completions per pass: the first study's, whose peak (7.5 GiB) fit its 9.4 GiB share
    optimizer_steps_per_generation: int = 2
    eval_every: int = 4
    overlong_fraction: float = 0.25  # DAPO's soft overlong buffer: the last quarter of the cap
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    max_num_gen_batches: int = 4
    dynamic_sampling_max_oversample: float = 2.0
    # ---- seeds per kind. DAPO, GRPO's settings and TRL's GRPOTrainer on `generate` (`COMPARED`): 12 on each cell, enough
    # to decide the paired area over wall-clock that 6 seeds left open. The rest on the first cell only.
    seeds: tuple[int, ...] = tuple(range(12))
    second_cell_seeds: tuple[int, ...] = tuple(range(12))
    vllm_seeds: tuple[int, ...] = tuple(range(6))
    partial_seeds: tuple[int, ...] = tuple(range(6))
    ablation_seeds: tuple[int, ...] = tuple(range(6))
    # TRL's continuous batching trains the model in bf16 (its generation casts the weights in place and never back):
    # one run records it (`trained_dtypes`), last
    continuous_batching_seeds: tuple[int, ...] = (0,)
    # ---- machinery
    device: str = "cuda"
    bf16: bool = True
    engine_max_rows: int = 512  # decode slots of the evaluation engine
    # Run processes sharing the device at once, kept at this number while any timed run is on the device (so every
    # arm's wall-clock is measured under the same sharing): 7.2 GiB each on an H100, 16 CPU cores for 9 processes
    slots: int = 9
    jobs_per_process: int = 1  # runs one process takes in turn (1: each run in a fresh process)
    torch_threads: int = 1  # per run process

    def __post_init__(self) -> None:
        unknown = set(self.families) - set(FAMILIES) | set(self.styles) - set(PROMPT_STYLES)
        if unknown:
            raise ValueError(f"families/styles: {sorted(unknown)} unknown; choose from {sorted(FAMILIES)} and "
                             f"{sorted(PROMPT_STYLES)}.")  # fmt: skip
        for name in ("pilot_steps", "min_steps", "max_steps"):
            if getattr(self, name) % self.optimizer_steps_per_generation:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of optimizer_steps_per_generation="
                                 f"{self.optimizer_steps_per_generation}, so no run ends inside a generation batch.")  # fmt: skip
        if not 0 < self.min_steps <= self.max_steps:
            raise ValueError(f"min_steps={self.min_steps} must be in 1..max_steps ({self.max_steps}).")
        if self.rows_per_step % self.micro_batch_rows or self.micro_batch_rows % self.num_generations:
            raise ValueError(
                f"micro_batch_rows={self.micro_batch_rows} must divide prompts_per_step x num_generations "
                f"({self.rows_per_step}) and be a multiple of num_generations ({self.num_generations})."
            )
        if not self.caps or min(self.caps) < 4:
            raise ValueError(f"caps={self.caps}: give one or more length caps of at least 4 tokens.")
        if not 0 < self.overlong_fraction < 1:
            raise ValueError(f"overlong_fraction={self.overlong_fraction} must be in (0, 1).")
        if self.slots < 1 or self.jobs_per_process < 1:
            raise ValueError("slots and jobs_per_process must be at least 1.")

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def accumulation_steps(self) -> int:
        return self.rows_per_step // self.micro_batch_rows

    def overlong_buffer(self, cap: int) -> int:
        return max(1, round(cap * self.overlong_fraction))

    def eval_steps(self, max_steps: int) -> list[int]:
        """Optimizer steps with a held-out evaluation: 0, every `eval_every`, and the last."""
        return sorted({0, *range(self.eval_every, max_steps + 1, self.eval_every), max_steps})

    def seeds_of(self, kind: str, cell: str = CELLS[0]) -> tuple[int, ...]:
        if cell != CELLS[0]:
            return self.second_cell_seeds if kind in COMPARED else ()
        by_kind = {DAPO: self.seeds, GRPO: self.seeds, TRL_GRPO: self.seeds, TRL_VLLM: self.vllm_seeds,
                   TRL_CONTINUOUS: self.continuous_batching_seeds, PARTIAL: self.partial_seeds}  # fmt: skip
        return by_kind.get(kind, self.ablation_seeds)

    def run_order(self) -> list[tuple[str, str, int]]:
        """Every (cell, kind, seed) in the order they start: the compared arms seed by seed on the first cell, then on
        the second (a call cut short still pairs them), TRL with vLLM colocated, the ablations seed by seed, partial
        rollouts, and TRL's continuous batching."""
        first, second = CELLS
        order = [(first, kind, seed) for seed in self.seeds for kind in COMPARED]
        order += [(second, kind, seed) for seed in self.second_cell_seeds for kind in COMPARED]
        order += [(first, TRL_VLLM, seed) for seed in self.vllm_seeds]
        order += [(first, kind, seed) for seed in self.ablation_seeds for kind in ABLATIONS]
        order += [(first, PARTIAL, seed) for seed in self.partial_seeds]
        return order + [(first, TRL_CONTINUOUS, seed) for seed in self.continuous_batching_seeds]

    def grid_fingerprint(self) -> str:
        """What a grid cell depends on: a cell recorded under other values is measured again."""
        keys = ("grid_problems", "k", "data_seed", "caps", "temperature", "bf16")
        return digest({key: getattr(self, key) for key in keys})

    def fingerprint(self) -> str:
        """What a run depends on (not which seeds run, nor how many processes run them)."""
        return digest({k: v for k, v in asdict(self).items() if k not in PROCESS_FIELDS})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> RealModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, values: dict) -> RealModelConfig:
        """The settings a study folder or bundle recorded; fields this version does not have are left out (the first
        study's bundle has some), missing ones take their defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known})

    def with_overrides(self, **overrides) -> RealModelConfig:
        known = {f.name for f in fields(self)}
        if set(overrides) - known:
            raise ValueError(f"unknown study settings {sorted(set(overrides) - known)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


SEED_FIELDS = (
    "seeds",
    "second_cell_seeds",
    "vllm_seeds",
    "partial_seeds",
    "ablation_seeds",
    "continuous_batching_seeds",
)
PROCESS_FIELDS = frozenset({*SEED_FIELDS, "slots", "jobs_per_process", "torch_threads"})


def digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


STUDY = RealModelConfig()


def smoke(config: RealModelConfig) -> RealModelConfig:
    """The pipeline end to end on the CPU with a tiny model: one family in two prompt styles (two cells), two caps, one
    pilot run per cell, two steps per run with an evaluation after each, one seed per kind, every run in one
    process."""
    return config.with_overrides(
        families=("add1",),
        styles=("dapo", "oneshot"),
        caps=(6, 8),
        grid_problems=4,
        k=2,
        max_base_avg=1.0,
        min_base_pass=0.0,
        min_truncated=0.0,
        pilot_cells=2,
        pilot_learning_rates=(1e-4,),
        pilot_steps=2,
        min_steps=2,
        max_steps=2,
        num_train=16,
        num_test=4,
        num_generations=2,
        prompts_per_step=2,
        micro_batch_rows=4,
        optimizer_steps_per_generation=1,
        eval_every=1,
        max_num_gen_batches=2,
        **dict.fromkeys(SEED_FIELDS, (0,)),
        device="cpu",
        bf16=False,
        engine_max_rows=16,
        slots=1,
        jobs_per_process=len(RUN_KINDS),
        torch_threads=1,
    )
