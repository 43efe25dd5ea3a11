"""The ablation ladder: naive GRPO, then DAPO's pieces added one at a time in the paper's order (Table 1), each
variant keeping every piece of the one before.

| variant | trainer | adds |
|---|---|---|
| `grpo` | TRL `GRPOTrainer` | symmetric clip 0.2, `loss_type="grpo"` (per-sequence mean) |
| `overlong_filter` | TRL | truncated completions get no loss (`mask_truncated_completions`) |
| `clip_higher` | TRL | `epsilon_high=0.28` |
| `soft_overlong` | TRL | the soft overlong punishment as a second reward (the one DAPOTrainer adds itself) |
| `token_level` | `DAPOTrainer` | the exact token-mean over each optimizer step; dynamic sampling off |
| `dynamic_sampling` | `DAPOTrainer` | dynamic sampling on accuracy: full DAPO |
| `dapo_paged_engine` | `DAPOTrainer` | the same, generating with the package's paged engine |
| `dapo_partial` | `DAPOTrainer` | partial rollouts: rounds stop once their groups ended, the rest carried |

Every variant up to `dynamic_sampling` generates with TRL's path (transformers `generate`), so wall-clock compares
the algorithms; `dapo_paged_engine` differs from `dynamic_sampling` in the generation engine alone, `dapo_partial`
from `dapo_paged_engine` in partial rollouts alone (`partial_rollouts=True`: whether they cost learning, and what they
save in wall-clock). The dual clip of
the reference recipe (`clip_ratio_c`) is in neither the paper's objective nor its table and is off everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trl import GRPOConfig, GRPOTrainer

from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.rewards import OverlongPenalty

from .config import StudyConfig
from .task import excess_columns, verify

ACCURACY = "accuracy"


class AdditionReward:
    """+1 when the final answer is exactly the sum, -1 otherwise (the reference recipe's scale), and a count of what
    was generated: every call scores one generation round (one per generation batch, more with dynamic sampling).

    Logs per round, over every candidate (TRL's completion metrics describe only the trained groups under dynamic
    sampling, so these are the ones comparable across the ladder): the share of informative groups (some but not all
    samples right: the groups with a learning signal), the solve rate, the truncated share (no end token), the
    longest over the shortest completion and the share with rechecks (more column lines than the problem has)."""

    def __init__(self, num_generations: int, end_token_ids: frozenset[int]) -> None:
        self.__name__ = ACCURACY  # TRL names a reward function by `__name__`; dynamic sampling filters on it
        self.num_generations = num_generations
        self.end_token_ids = end_token_ids  # end and pad, as the trainers tell a truncated completion
        self.completions = self.tokens = 0

    def totals(self) -> dict[str, int]:
        return {"generated_completions": self.completions, "generated_tokens": self.tokens}

    def __call__(self, completions, answer, digits, completion_ids, log_metric=None, **kwargs: Any) -> list[float]:
        size = self.num_generations
        if len(completions) % size or any(len(set(answer[i : i + size])) != 1 for i in range(0, len(answer), size)):
            raise ValueError(
                f"AdditionReward: expected consecutive groups of num_generations={size} samples of one prompt, got "
                f"{len(completions)} rows; the study runs in one process per trainer."
            )
        correct = [verify(text, truth) for text, truth in zip(completions, answer, strict=True)]
        solved = [sum(correct[i : i + size]) for i in range(0, len(correct), size)]
        lengths = [len(ids) for ids in completion_ids]
        if log_metric is not None:
            log_metric("study/informative_groups", sum(0 < s < size for s in solved) / len(solved))
            log_metric("study/solve_rate", sum(correct) / len(correct))
            truncated = sum(not ids or ids[-1] not in self.end_token_ids for ids in completion_ids)
            log_metric("study/truncated", truncated / len(completion_ids))
            log_metric("study/length_spread", max(lengths) / max(1, min(lengths)))
            verbose = sum(excess_columns(text, d) > 0 for text, d in zip(completions, digits, strict=True))
            log_metric("study/rechecked", verbose / len(completions))
        self.completions += len(completions)
        self.tokens += sum(lengths)
        return [1.0 if c else -1.0 for c in correct]


@dataclass(frozen=True)
class Variant:
    """One row of the ladder: which DAPO pieces are on."""

    name: str
    adds: str
    overlong_filter: bool = False
    clip_higher: bool = False
    soft_overlong: bool = False
    token_level: bool = False  # DAPOTrainer and its token-mean; TRL's GRPOTrainer with loss_type="grpo" otherwise
    dynamic_sampling: bool = False
    rollout_engine: str = "trl"
    partial_rollouts: bool = False

    def __post_init__(self) -> None:
        if (self.dynamic_sampling or self.rollout_engine != "trl") and not self.token_level:
            raise ValueError(f"variant {self.name}: dynamic sampling and the rollout engine need DAPOTrainer.")
        if self.partial_rollouts and self.rollout_engine != "paged":
            raise ValueError(f"variant {self.name}: partial rollouts need the paged rollout engine.")


def _ladder() -> tuple[Variant, ...]:
    rungs = [Variant("grpo", "naive GRPO: symmetric clip, per-sequence loss")]
    for name, adds, piece in (
        ("overlong_filter", "+ overlong filtering", {"overlong_filter": True}),
        ("clip_higher", "+ Clip-Higher", {"clip_higher": True}),
        ("soft_overlong", "+ soft overlong punishment", {"soft_overlong": True}),
        ("token_level", "+ token-level loss", {"token_level": True}),
        ("dynamic_sampling", "+ dynamic sampling (DAPO)", {"dynamic_sampling": True}),
        ("dapo_paged_engine", "DAPO, paged rollout engine", {"rollout_engine": "paged"}),
        ("dapo_partial", "+ partial rollouts (paged engine)", {"partial_rollouts": True}),
    ):
        rungs.append(replace(rungs[-1], name=name, adds=adds, **piece))
    return tuple(rungs)


VARIANTS = _ladder()
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def variants_of(config: StudyConfig) -> tuple[Variant, ...]:
    """The study's variants in ladder order (the order of every report)."""
    if not config.variants:
        return VARIANTS
    unknown = set(config.variants) - set(VARIANT_NAMES)
    if unknown:
        raise ValueError(f"variants: {sorted(unknown)} unknown; choose from {list(VARIANT_NAMES)}.")
    return tuple(v for v in VARIANTS if v.name in config.variants)


def variant_named(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"variant {name!r} unknown; choose from {list(VARIANT_NAMES)}.")


def run_order(config: StudyConfig) -> tuple[Variant, ...]:
    """The order a worker runs them: both ends of the ladder first, so a study cut short still compares naive GRPO
    with full DAPO; the paged engine last, so no run on TRL's path follows a compiling engine in the same process."""
    ladder = variants_of(config)
    first = [v for v in ladder if v.name in (VARIANTS[0].name, "dynamic_sampling")]
    last = [v for v in ladder if v.rollout_engine != "trl"]
    return (*first, *(v for v in ladder if v not in first and v not in last), *last)


def machinery_fields(bf16: bool, device: str) -> dict[str, Any]:
    """A study run's precision and device, logged every step to its record alone: no checkpoints, no trackers, no bar."""
    return dict(
        bf16=bf16, use_cpu=device == "cpu", logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True
    )


def grpo_fields(config: StudyConfig, variant: Variant, seed: int, output_dir: str) -> dict[str, Any]:
    """Every `GRPOConfig` field the study depends on, for both trainers."""
    return dict(
        output_dir=output_dir,
        seed=seed,
        data_seed=seed,
        # batch geometry: one optimizer step = prompts_per_step prompts x num_generations samples, on one device
        per_device_train_batch_size=config.rows_per_step,
        gradient_accumulation_steps=1,
        steps_per_generation=config.steps_per_generation,
        num_iterations=1,
        num_generations=config.num_generations,
        max_steps=config.max_steps,
        shuffle_dataset=True,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,
        # optimizer
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        # sampling
        max_completion_length=config.max_completion_length,
        temperature=config.temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=None,
        use_vllm=False,
        use_transformers_paged=False,
        cache_implementation=None,
        # objective
        beta=0.0,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high if variant.clip_higher else config.epsilon,
        importance_sampling_level="token",
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
        mask_truncated_completions=variant.overlong_filter,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        off_policy_mask_threshold=None,
        vllm_importance_sampling_correction=False,
        disable_dropout=True,
        **machinery_fields(config.bf16, config.device),
        log_completions=False,
        remove_unused_columns=False,
    )


def trainer_setup(
    variant: Variant, config: StudyConfig, seed: int, output_dir, tokenizer, memory_share: float
) -> tuple[type, GRPOConfig, list]:
    """The variant's trainer class, its config and its reward functions (the first one the counting accuracy).
    `memory_share`: the share of the device this worker may hold (`plan.memory_plan`); the paged engine sizes its
    cache under it, so engines of workers sharing the device cannot together exceed it."""
    ends = frozenset({tokenizer.eos_token_id, tokenizer.pad_token_id})
    rewards: list = [AdditionReward(config.num_generations, ends)]
    values = grpo_fields(config, variant, seed, str(output_dir))
    if not variant.token_level:
        if variant.soft_overlong:
            rewards.append(
                OverlongPenalty(
                    config.max_completion_length, config.overlong_buffer_len, config.overlong_penalty_factor
                )
            )
        return GRPOTrainer, GRPOConfig(loss_type="grpo", reward_weights=[1.0] * len(rewards), **values), rewards
    # DAPOTrainer adds the same overlong penalty itself, from the fields below
    args = DAPOConfig(
        loss_type="dapo",
        reward_weights=[1.0],
        clip_ratio_c=None,
        overlong_buffer_len=config.overlong_buffer_len if variant.soft_overlong else 0,
        overlong_penalty_factor=config.overlong_penalty_factor,
        dynamic_sampling=variant.dynamic_sampling,
        dynamic_sampling_mode="rounds",  # the reward then scores whole rounds, so its per-round metrics are the batch's
        dynamic_sampling_metric=ACCURACY,
        max_num_gen_batches=config.max_num_gen_batches,
        dynamic_sampling_on_limit="train_on_partial",
        dynamic_sampling_keep_surplus=True,
        max_surplus_age=config.steps_per_generation,
        dynamic_sampling_oversample=config.dynamic_sampling_oversample,
        dynamic_sampling_max_oversample=config.dynamic_sampling_max_oversample,
        rollout_engine=variant.rollout_engine,
        partial_rollouts=variant.partial_rollouts,
        rollout_memory_fraction=memory_share,
        **values,
    )
    return DAPOTrainer, args, rewards


def build_trainer(
    variant: Variant,
    config: StudyConfig,
    seed: int,
    model_path,
    tokenizer,
    train_dataset,
    output_dir,
    memory_share: float,
):
    """The variant's trainer over the warm-started model, and its reward (which counts what was generated)."""
    trainer_class, args, rewards = trainer_setup(variant, config, seed, output_dir, tokenizer, memory_share)
    trainer = trainer_class(
        model=str(model_path), reward_funcs=rewards, args=args, train_dataset=train_dataset, processing_class=tokenizer
    )
    return trainer, rewards[0]
