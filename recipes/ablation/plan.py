"""The device-time plan: each phase estimated from the model's depth, the batch and the lengths, printed before the
study runs and stored with what was measured, so the first GPU run can correct the constants.

At these sizes (tens of millions of parameters, a 20-token vocabulary) every kernel is tiny: time is kernel launches
and host work, proportional to the number of layers and of decode steps, nearly independent of rows and width.
"""

from __future__ import annotations

import math

from .config import StudyConfig
from .variants import variants_of

# transformers `generate` (TRL's path): TRL generated at 25-26 ms per decode step for the 24- and 28-layer Qwen2.5
# 0.5B/1.5B on an H200 (docs/benchmarks.md, 2026-12-02), about 0.9 ms per layer beside a fixed part.
HF_STEP_FIXED_S = 3e-3
HF_STEP_PER_LAYER_S = 0.9e-3
EVAL_ROWS_SLOWDOWN = 1.5  # evaluation calls carry up to `eval_max_rows` rows, more than a training round
PAGED_STEP_S = 2e-3  # the paged engine's decode step as a replayed graph (1.9 ms at 0.5B, same document)
ENGINE_FIRST_CALL_S = 15.0  # compile and graph capture at the first generation (8-14 s measured)
FORWARD_PER_LAYER_S = 0.25e-3  # an eager training forward; backward counted as twice the forward
STEP_OVERHEAD_S = 0.04  # optimizer step and the trainers' per-step metrics (host synchronisations)
TRAINER_BUILD_S = 3.0
# Dynamic sampling's generation per batch over one round. "auto" oversampling makes one larger round mostly: on TRL's
# path it costs far more than its launches, on the paged engine about the same (first H200 study, 2026-12-03: training
# 2.9x and 1.0x GRPO's, where 1.5 for both had planned 1.4x and 0.6x)
DYNAMIC_SAMPLING_GENERATION = {"trl": 3.2, "paged": 1.2}
SHARED_DEVICE_SLOWDOWN = 0.25  # each further worker on the GPU slows every worker by this fraction (2026-12-03: 0.25)


def estimate(config: StudyConfig) -> dict:
    """Seconds per phase for one seed, the whole study run sequentially, and with `workers` processes."""
    layers = config.num_layers
    hf_step = HF_STEP_FIXED_S + HF_STEP_PER_LAYER_S * layers
    forward = FORWARD_PER_LAYER_S * layers
    train_step = 3 * forward + STEP_OVERHEAD_S
    batches = config.max_steps // config.steps_per_generation
    # TRL recomputes the old logprobs in one forward per micro-batch when a batch feeds several optimizer steps
    per_batch_rest = config.steps_per_generation * (forward + train_step)
    generation = config.max_completion_length * hf_step
    test_rows = config.test_per_bucket * len(config.buckets)
    calls = math.ceil(test_rows / config.eval_max_rows) + math.ceil(
        test_rows / max(1, config.eval_max_rows // config.eval_k)
    )
    evaluation = calls * (config.max_completion_length * hf_step * EVAL_ROWS_SLOWDOWN + forward)
    evaluations = len(config.eval_steps()) - 1
    runs = {}
    for variant in variants_of(config):
        if variant.rollout_engine != "trl":
            batch_generation = config.max_completion_length * PAGED_STEP_S
        else:
            batch_generation = generation
        if variant.dynamic_sampling:
            batch_generation *= DYNAMIC_SAMPLING_GENERATION[variant.rollout_engine]
        first_call = ENGINE_FIRST_CALL_S if variant.rollout_engine != "trl" else 0.0
        train = batches * (batch_generation + per_batch_rest) + first_call
        runs[variant.name] = {"train_s": train, "total_s": TRAINER_BUILD_S + train + evaluations * evaluation}
    checks = config.sft_max_steps // config.sft_check_every
    warm_start = config.sft_max_steps * (3 * forward + 0.01) + checks * config.max_completion_length * hf_step
    start_point = warm_start + evaluation
    run_s = sum(r["total_s"] for r in runs.values())
    seeds = len(config.seeds)
    preparing = min(config.workers, seeds)  # one worker per seed in the first phase
    running = min(config.workers, seeds * len(runs))
    # the runs' phase ends with its longest worker: at least one whole run, at least the average share
    longest = max(r["total_s"] for r in runs.values())
    run_phase = max(longest, seeds * run_s / running) * shared(running)
    return {
        "hf_decode_step_s": hf_step,
        "evaluation_s": evaluation,
        "warm_start_at_most_s": warm_start,
        "runs": runs,
        "per_seed_s": start_point + run_s,
        "sequential_s": (start_point + run_s) * seeds,
        "workers": config.workers,
        "with_workers_s": start_point * math.ceil(seeds / preparing) * shared(preparing) + run_phase,
    }


def shared(processes: int) -> float:
    """How much slower each process runs with `processes` of them on the device."""
    return 1 + SHARED_DEVICE_SLOWDOWN * (processes - 1)


def format_plan(plan: dict) -> str:
    lines = [
        f"plan (estimates for one H200): decode step of generate {plan['hf_decode_step_s'] * 1e3:.1f} ms, one evaluation "
        f"{plan['evaluation_s']:.1f} s, warm start at most {plan['warm_start_at_most_s']:.0f} s per seed",
        *(
            f"  {name}: {run['total_s']:.0f} s per seed ({run['train_s']:.0f} s training)"
            for name, run in plan["runs"].items()
        ),
        f"  per seed {plan['per_seed_s'] / 60:.1f} min; all seeds one after another {plan['sequential_s'] / 60:.1f} min; "
        f"with {plan['workers']} workers sharing the device {plan['with_workers_s'] / 60:.1f} min",
    ]
    return "\n".join(lines)


def compare(plan: dict, records: list[dict]) -> str:
    """Planned against measured seconds per seed (mean over seeds; measured with the workers sharing the device)."""

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.1f}" if values else "n/a"

    lines = ["| phase, per seed | planned s | measured s |", "|---|---|---|"]
    lines.append(
        f"| warm start | at most {plan['warm_start_at_most_s']:.0f} | "
        f"{mean([r['warm_start']['seconds'] for r in records])} |"
    )
    for name, planned in plan["runs"].items():
        runs = [r["runs"][name] for r in records if r["runs"].get(name, {}).get("status") == "ok"]
        lines.append(
            f"| {name}: training / all | {planned['train_s']:.0f} / {planned['total_s']:.0f} | "
            f"{mean([run['train_s'] for run in runs])} / {mean([run['total_s'] for run in runs])} |"
        )
    return "\n".join(lines)
