"""Every setting of the ablation study in one place: the named regimes (`REGIMES`) and their CPU smoke presets.

- `miniature`: the first study's settings (2026-12-03), where DAPO's pieces had little to act on: nothing was ever
  truncated, the ratio almost never left the clip range and the warm start was near-deterministic.
- `paper`: the paper's regime in small: a warm start with a verbose habit whose rechecks sometimes run past the length
  limit, stopped earlier so its sampling is not collapsed, and 16 optimizer updates per generation batch (the paper's
  512 prompts per generation batch in mini-batches of 32) at a learning rate where the ratio leaves the clip range.
  `python recipes/dapo_ablation.py --check` measures these preconditions at GRPO's start before any comparison.

The trainers' configs are built from these fields alone (see `variants.py`), every field the study depends on set
explicitly, so a changed default in `DAPOConfig` or `GRPOConfig` does not change the study.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from .task import Bucket, check_buckets


@dataclass(frozen=True)
class StudyConfig:
    name: str = "miniature"  # the regime these settings came from (overrides may have changed some)
    # ---- task: scratchpad addition, difficulty = digits of the longer operand
    buckets: tuple[Bucket, ...] = ((1, 2), (3, 4), (5, 6), (7, 8))
    num_train: int = 20_000
    test_per_bucket: int = 64
    data_seed: int = 1234  # one problem set for every seed, so seeds vary the model and sampling, not the data
    # ---- model built from scratch (Qwen2 architecture, character tokenizer): 17.7M parameters by default
    hidden_size: int = 512
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 1408
    # ---- supervised warm start: stops at the first check whose greedy probe accuracy reaches the target
    sft_batch_size: int = 256
    sft_learning_rate: float = 1e-3
    sft_warmup_steps: int = 50
    sft_max_steps: int = 3000
    sft_check_every: int = 50
    sft_probe_problems: int = 256
    sft_target_accuracy: float = 0.5
    sft_recheck_probability: float = 0.0  # each worked solution rechecks again with this probability (geometric)
    # ---- RL, the same for every variant
    num_generations: int = 8
    prompts_per_step: int = 16
    steps_per_generation: int = 4  # optimizer steps per generation batch: later ones are off-policy, so clipping acts
    max_steps: int = 80  # 7.6 min for the study on one H200 (2026-12-03)
    learning_rate: float = 1e-5
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    max_completion_length: int = 128  # the longest worked solution (8 digits) is 90 tokens with its end token
    overlong_buffer_len: int = 32  # soft punishment from 96 tokens on: never on a correct solution
    overlong_penalty_factor: float = 1.0
    temperature: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float = 0.28
    max_num_gen_batches: int = 4
    dynamic_sampling_oversample: str = "auto"
    dynamic_sampling_max_oversample: float = 4.0
    # ---- held-out evaluation (also at step 0, once per seed: the warm-started model)
    eval_every: int = 20
    eval_k: int = 8
    eval_temperature: float = 1.0
    eval_top_p: float = 0.7  # the reference recipe's validation sampling
    eval_max_rows: int = 2048
    # ---- the study
    seeds: tuple[int, ...] = (0, 1, 2)
    variants: tuple[str, ...] = field(default=())  # empty: every variant of `variants.VARIANTS`, in ladder order
    workers: int = 6  # processes sharing the device: one per seed for the start points, then (seed, variant) runs
    device: str = "cuda"
    bf16: bool = True
    torch_threads: int = 2  # per worker: CPU-side work is light, and workers must not oversubscribe the host

    def __post_init__(self) -> None:
        check_buckets(self.buckets, self.buckets[0][0], self.buckets[-1][1])
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds}: give one or more distinct seeds.")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: at least one worker process runs the seeds.")
        if self.max_steps % self.steps_per_generation:
            raise ValueError(
                f"max_steps={self.max_steps} must be a multiple of steps_per_generation={self.steps_per_generation}, "
                "so no variant ends inside a generation batch."
            )
        if not 0 < self.eval_every <= self.max_steps:
            raise ValueError(f"eval_every={self.eval_every} must be in 1..max_steps ({self.max_steps}).")
        if self.overlong_buffer_len >= self.max_completion_length:
            raise ValueError("overlong_buffer_len must be below max_completion_length.")
        if self.eval_k < 1:
            raise ValueError(f"eval_k={self.eval_k}: avg@k needs at least one sample per problem.")

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def eval_steps(self) -> list[int]:
        """Optimizer steps with a held-out evaluation: 0, every `eval_every`, and the last."""
        return sorted({0, *range(self.eval_every, self.max_steps + 1, self.eval_every), self.max_steps})

    @property
    def generation_rows(self) -> int:
        """Completions of one generation batch (before dynamic sampling's extra rounds)."""
        return self.rows_per_step * self.steps_per_generation

    def fingerprint(self) -> str:
        """SHA-256 of the settings that change what a run learns or reports (not which seeds or variants run, nor
        how many processes run them): a result recorded under other settings is not reused."""
        return _digest({k: v for k, v in asdict(self).items() if k not in PROCESS_FIELDS})

    def start_fingerprint(self) -> str:
        """SHA-256 of the settings a start point depends on (task, model, warm start, evaluation): the regime check
        and the study share start points, and a changed RL setting does not redo the warm starts."""
        return _digest({k: v for k, v in asdict(self).items() if k not in PROCESS_FIELDS | RL_FIELDS})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> StudyConfig:
        """The settings `save` wrote; a field added since takes its default (the miniature's, the earlier study's)."""
        values = json.loads(Path(path).read_text())
        values["buckets"] = tuple(tuple(b) for b in values["buckets"])
        values["seeds"], values["variants"] = tuple(values["seeds"]), tuple(values["variants"])
        return cls(**values)

    def with_overrides(self, **overrides) -> StudyConfig:
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown study settings {sorted(unknown)}.")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def _digest(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


# Which runs are made and by how many processes: no part of what a run learns.
PROCESS_FIELDS = frozenset({"name", "seeds", "variants", "workers", "torch_threads"})
# What RL does after the start point: a start point recorded under other values of these is still this one's.
RL_FIELDS = frozenset(
    {
        "num_generations",
        "prompts_per_step",
        "steps_per_generation",
        "max_steps",
        "learning_rate",
        "max_grad_norm",
        "weight_decay",
        "overlong_buffer_len",
        "overlong_penalty_factor",
        "temperature",
        "epsilon",
        "epsilon_high",
        "max_num_gen_batches",
        "dynamic_sampling_oversample",
        "dynamic_sampling_max_oversample",
        "eval_every",
    }
)

MINIATURE = StudyConfig()

# Each change from the miniature, and the precondition it is for (docs/ablation.md; `--check` measures them).
PAPER = MINIATURE.with_overrides(
    name="paper",
    # truncation: a third of the warm start's solutions recheck (a ninth at least twice, ...); with the limit at 112
    # tokens every minimal solution fits (8 digits: at most 90 with the end token) but one recheck of 6-8 digits or
    # two of 4-5 do not: about 16% of completions truncated if the warm start keeps the habit, lengths 18 to 112 (6x)
    sft_recheck_probability=1 / 3,
    max_completion_length=112,
    overlong_buffer_len=22,  # the paper's fifth of the limit: punished from 91 tokens on, never a minimal solution
    # entropy: checked every 25 steps, a seed stops near its target (the miniature's seed 0 overshot to 0.87 greedy
    # between two checks 50 steps apart, entropy 0.018). A lower target leaves more entropy but more wrong samples:
    # on a small CPU model at 0.3 the first batch's updates were dominated by wrong samples and entropy did not fall
    # (the paper's collapse needs right samples to reinforce); at 0.5 it fell. 0.4 is between.
    sft_target_accuracy=0.4,
    sft_check_every=25,
    # clipping: the paper's 16 optimizer updates per generation batch (256 prompts x 8 samples, mini-batches of
    # 16 prompts), at a learning rate where the later updates' ratios leave the clip range. One H200, 2026-12-04: at
    # 1e-4 (first choice) GRPO lost most of its held-out accuracy (0.51 -> 0.08 avg@8 over 5 seeds) with no entropy
    # collapse; at a third of it 1.05% of tokens still clip per update and GRPO learns (0.51 -> 0.60, 3 seeds) while
    # its entropy falls to 0.38 of its start, the paper's collapse. Chosen on GRPO alone, for every variant.
    steps_per_generation=16,
    learning_rate=3.33e-5,
    max_steps=160,  # 10 generation batches
    eval_every=32,
    dynamic_sampling_max_oversample=2.0,  # a generation round of at most 4,096 rows: the memory plan's bound
    seeds=(0, 1, 2, 3, 4),
)

REGIMES = {config.name: config for config in (MINIATURE, PAPER)}


def smoke(config: StudyConfig) -> StudyConfig:
    """The regime's pipeline on 2 CPU cores in well under a minute: a 2-layer, 64-wide model warm-started on one- and
    two-digit problems until it is right on some (dynamic sampling needs groups with some right samples), 2 RL steps
    per variant, 2 seeds in 2 workers, a handful of held-out problems. The regime's verbose habit stays, with a limit
    a two-digit recheck passes, so the smoke run truncates too."""
    return config.with_overrides(
        buckets=((1, 1), (2, 2)),
        num_train=64,
        test_per_bucket=2,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        sft_batch_size=32,
        sft_learning_rate=3e-3,
        sft_max_steps=200,
        sft_check_every=50,
        sft_probe_problems=8,
        sft_target_accuracy=0.4,
        num_generations=4,
        prompts_per_step=2,
        steps_per_generation=2,
        max_steps=2,
        learning_rate=1e-3,
        max_completion_length=40,  # the two-digit solution is 30 tokens with its end token, 48 with a recheck
        overlong_buffer_len=8,
        max_num_gen_batches=4,
        eval_every=2,
        eval_k=2,
        seeds=(0, 1),
        workers=2,
        device="cpu",
        bf16=False,
        torch_threads=1,
    )
