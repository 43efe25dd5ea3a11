"""The device plan: time per phase and memory per worker, printed before the study runs and stored with what was
measured, so each GPU run can correct the constants.

Time: at these sizes (tens of millions of parameters, a 23-token vocabulary) every kernel is tiny: time is kernel
launches and host work, proportional to the number of layers and of decode steps, nearly independent of rows and
width.

Memory: workers share one device, so each gets a share (`memory_plan`) that its caching allocator is capped to and the
paged engine sizes its cache under; the plan refuses a worker count whose estimated need does not fit its share.
"""

from __future__ import annotations

import math

from trl_dapo.evaluation import ENTROPY_ROWS

from .config import StudyConfig
from .model import VOCAB_SIZE
from .variants import variants_of

# transformers `generate` (TRL's path): TRL generated at 25-26 ms per decode step for the 24- and 28-layer Qwen2.5
# 0.5B/1.5B on an H200 (docs/history.md, 2026-12-02), about 0.9 ms per layer beside a fixed part.
HF_STEP_FIXED_S = 3e-3
HF_STEP_PER_LAYER_S = 0.9e-3
EVAL_ROWS_SLOWDOWN = 1.5  # evaluation calls carry up to `eval_max_rows` rows, more than a training round
PAGED_STEP_S = 2e-3  # the paged engine's decode step as a replayed graph (1.9 ms at 0.5B, same document)
ENGINE_FIRST_CALL_S = 15.0  # compile and graph capture at the first generation (8-14 s measured)
FORWARD_PER_LAYER_S = 0.25e-3  # an eager training forward; backward counted as twice the forward
STEP_OVERHEAD_S = 0.04  # optimizer step and the trainers' per-step metrics (host synchronisations)
TRAINER_BUILD_S = 3.0
WARM_START_STEP_S = 0.1  # per supervised step, host-bound (first study: 150-250 steps, checks included, in 37-55 s
# with 3 workers sharing the device)
WARM_START_EXPECTED_STEPS = 250  # the first study's longest warm start: the time plan's expectation, not its bound
# Dynamic sampling's generation per batch over one round. "auto" oversampling makes one larger round mostly: on TRL's
# path it costs far more than its launches, on the paged engine about the same (first H200 study, 2026-12-03: training
# 2.9x and 1.0x GRPO's, where 1.5 for both had planned 1.4x and 0.6x)
DYNAMIC_SAMPLING_GENERATION = {"trl": 3.2, "paged": 1.2}
# each further worker on the GPU slows every worker by this fraction: 0.25 in the miniature (2026-12-03), 0.5 in the
# paper regime (2026-12-04: a GRPO run took 137 s with 6 workers against 39 s planned alone, a check job 14.5 s with 5
# against 5 s)
SHARED_DEVICE_SLOWDOWN = 0.5

GIB = 2**30
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # per process, outside the caching allocator's cap
DEVICE_USABLE = 0.92  # of the device's memory, for the workers together (the rest: driver, other contexts)
ALLOCATOR_SLACK = 1.25  # what the caching allocator reserves over the largest live set (expandable segments)
ENGINE_WORKSPACE_BYTES = int(1.5 * GIB)  # compiled decode step, CUDA graph pools, prefill workspace
KV_BYTES = 4  # the key-value cache counted in float32 (bf16 under autocast: the plan leaves the other half spare)


def generation_rows_factor(rows: int) -> float:
    """A `generate` call of `rows` rows against one of 512 (the first study's rounds): launch-bound, so slower only
    slowly with the rows; 1.5x at 2,048 rows as evaluation's calls measured."""
    return 1.0 + 0.25 * max(0.0, math.log2(rows / 512))


def estimate(config: StudyConfig) -> dict:
    """Seconds per phase for one seed, the whole study run sequentially, and with `workers` processes."""
    layers = config.num_layers
    hf_step = HF_STEP_FIXED_S + HF_STEP_PER_LAYER_S * layers
    forward = FORWARD_PER_LAYER_S * layers
    train_step = 3 * forward + STEP_OVERHEAD_S
    batches = config.max_steps // config.steps_per_generation
    # TRL recomputes the old logprobs in one forward per micro-batch when a batch feeds several optimizer steps
    per_batch_rest = config.steps_per_generation * (forward + train_step)
    generation = config.max_completion_length * hf_step * generation_rows_factor(config.generation_rows)
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

    def warm_start(steps: int) -> float:
        checks = steps // config.sft_check_every
        return steps * WARM_START_STEP_S + checks * config.max_completion_length * hf_step

    start_point = warm_start(min(config.sft_max_steps, WARM_START_EXPECTED_STEPS)) + evaluation
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
        "warm_start_at_most_s": warm_start(config.sft_max_steps),
        "start_point_s": start_point,
        "check_s": TRAINER_BUILD_S + generation + per_batch_rest,  # one generation batch of GRPO, no evaluation
        "runs": runs,
        "per_seed_s": start_point + run_s,
        "sequential_s": (start_point + run_s) * seeds,
        "workers": config.workers,
        "with_workers_s": start_point * math.ceil(seeds / preparing) * shared(preparing) + run_phase,
    }


def shared(processes: int) -> float:
    """How much slower each process runs with `processes` of them on the device."""
    return 1 + SHARED_DEVICE_SLOWDOWN * (processes - 1)


def parameter_count(config: StudyConfig) -> int:
    """The Qwen2 of `model.build_model`: attention with biases on q, k and v, a gated MLP, two norms per layer, tied
    embeddings and a final norm."""
    hidden, kv = config.hidden_size, config.num_kv_heads * (config.hidden_size // config.num_heads)
    per_layer = 2 * hidden * hidden + hidden + 2 * (hidden * kv + kv) + 3 * hidden * config.intermediate_size
    return config.num_layers * (per_layer + 2 * hidden) + VOCAB_SIZE * hidden + hidden


class MemoryPlanError(ValueError):
    """The workers' estimated memory does not fit the device."""


def memory_plan(config: StudyConfig, device_bytes: int, workers: int) -> dict:
    """Each worker's estimated peak and its share of the device with `workers` processes on it; raises
    `MemoryPlanError` when the estimate exceeds the share (the message names the most workers that fit).

    The peak is the training state plus the largest of what is live at once: `generate`'s key-value cache of a
    generation round (dynamic sampling's largest: `dynamic_sampling_max_oversample` times the batch), held twice while
    the cache grows by concatenation; evaluation's, the same for its largest call; one training micro-batch's
    activations; the paged engine's cache for the largest round and its workspace."""
    params = parameter_count(config)
    head_dim = config.hidden_size // config.num_heads
    longest_prompt = 2 * config.buckets[-1][1] + 2  # "a+b" and the newline
    sequence = longest_prompt + config.max_completion_length
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * head_dim * KV_BYTES
    variants = variants_of(config)
    oversample = config.dynamic_sampling_max_oversample if any(v.dynamic_sampling for v in variants) else 1.0
    round_rows = math.ceil(config.generation_rows * oversample)
    eval_rows = max(1, config.eval_max_rows // config.eval_k) * config.eval_k
    activation_per_token = config.num_layers * (32 * config.hidden_size + 12 * config.intermediate_size)
    parts = {
        "training_state": params * 16,  # float32 weights, gradients, AdamW's two moments
        "generation": 2 * round_rows * sequence * kv_per_token,
        "evaluation": 2 * eval_rows * sequence * kv_per_token
        + min(eval_rows, ENTROPY_ROWS) * sequence * 4 * (4 * config.hidden_size + 3 * config.intermediate_size),
        "training_activations": config.rows_per_step * sequence * activation_per_token,
        "warm_start_activations": config.sft_batch_size * sequence * activation_per_token,
        "engine": 0,
    }
    if any(v.rollout_engine != "trl" for v in variants):
        page_tokens = round_rows * (config.max_completion_length + 32) + config.generation_rows * longest_prompt
        parts["engine"] = params * 2 + page_tokens * kv_per_token // 2 + ENGINE_WORKSPACE_BYTES
    live = max(size for name, size in parts.items() if name != "training_state")
    need = int(ALLOCATOR_SLACK * (parts["training_state"] + live))
    usable = DEVICE_USABLE * device_bytes
    share_bytes = usable / workers - CUDA_CONTEXT_BYTES
    plan = {
        "device_bytes": device_bytes,
        "workers": workers,
        "parts_bytes": parts,
        "need_bytes": need,
        "share_bytes": int(share_bytes),
        "share": share_bytes / device_bytes,  # the allocator's cap and the paged engine's `rollout_memory_fraction`
        "most_workers": int(usable // (need + CUDA_CONTEXT_BYTES)),
    }
    if need > share_bytes:
        raise MemoryPlanError(
            f"memory: each worker needs about {need / GIB:.1f} GiB, but {workers} workers on a device of "
            f"{device_bytes / GIB:.0f} GiB get {share_bytes / GIB:.1f} GiB each; use --workers "
            f"{plan['most_workers']} or fewer."
        )
    return plan


def format_plan(plan: dict, memory: dict | None = None) -> str:
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
    if memory is not None:
        parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in memory["parts_bytes"].items())
        lines.append(
            f"  memory per worker: need {memory['need_bytes'] / GIB:.1f} GiB of a {memory['share_bytes'] / GIB:.1f} "
            f"GiB share ({memory['workers']} workers; GiB: {parts})"
        )
    return "\n".join(lines)


def compare(plan: dict, records: list[dict]) -> str:
    """Planned against measured seconds per seed (mean over seeds; measured with the workers sharing the device),
    and the largest memory any run of a variant reserved."""

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.1f}" if values else "n/a"

    lines = ["| phase, per seed | planned s | measured s | peak reserved GiB |", "|---|---|---|---|"]
    lines.append(
        f"| warm start | at most {plan['warm_start_at_most_s']:.0f} | "
        f"{mean([r['warm_start']['seconds'] for r in records])} | |"
    )
    for name, planned in plan["runs"].items():
        runs = [r["runs"][name] for r in records if r["runs"].get(name, {}).get("status") == "ok"]
        peaks = [run["peak_reserved_bytes"] / GIB for run in runs if run.get("peak_reserved_bytes")]
        lines.append(
            f"| {name}: training / all | {planned['train_s']:.0f} / {planned['total_s']:.0f} | "
            f"{mean([run['train_s'] for run in runs])} / {mean([run['total_s'] for run in runs])} | "
            f"{f'{max(peaks):.1f}' if peaks else 'n/a'} |"
        )
    return "\n".join(lines)
