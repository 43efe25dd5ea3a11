"""One trainer's measured optimizer steps, shared by the step comparison and the dynamic-sampling benchmark: the
settings TRL's GRPOTrainer and DAPOTrainer share, the batch geometry on the command line, per-step section times."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from trl import GRPOConfig, GRPOTrainer

from benchmarks.core.timing import StepProfiler, StepTimer, time_methods
from benchmarks.core.workload import parity_reward
from trl_dapo import DAPOConfig, DAPOTrainer


def add_batch_arguments(parser: argparse.ArgumentParser, new_tokens: int | None = 256) -> None:
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument("--models", nargs="*", default=None, help="config names in benchmarks/configs")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=new_tokens, help="max_completion_length")
    parser.add_argument("--ga", type=int, default=4, help="gradient accumulation steps")
    parser.add_argument("--prompt-words", type=int, default=24, help="words per prompt (one token each)")
    parser.add_argument("--output", default=None)


def batch_setup(args, device: str, pin_lengths: bool = True, gradient_checkpointing: bool = False) -> dict:
    """The batch geometry and precision every trainer of a run gets. `pin_lengths`: `min_new_tokens =
    max_completion_length`, so every row decodes the same number of tokens on both sides."""
    return {
        "device": device,
        "dtype": torch.bfloat16 if device == "cuda" else torch.float32,
        "bf16": device == "cuda",
        "rows_per_step": args.prompts * args.generations,
        "generations": args.generations,
        "new_tokens": args.new_tokens,
        "ga": args.ga,
        "prompt_words": args.prompt_words,
        "pin_lengths": pin_lengths,
        "gradient_checkpointing": gradient_checkpointing,
    }


def pinned_lengths(new_tokens: int, settings: dict) -> dict:
    """`generation_kwargs` that make every completion `new_tokens` long on the generation path `settings` choose:
    vLLM's `SamplingParams` name it `min_tokens`; transformers' continuous batching drops `min_new_tokens`, so no
    token ends a row there; `generate` and trl-dapo's engine take `min_new_tokens`."""
    if settings.get("use_vllm"):
        return {"min_tokens": new_tokens}
    if settings.get("use_transformers_continuous_batching"):
        return {"eos_token_id": -1}
    return {"min_new_tokens": new_tokens}


def run_trainer(
    kind: str,
    model,
    tokenizer,
    dataset,
    setup: dict,
    warmup: int,
    steps: int,
    reward=parity_reward,
    peft_config=None,
    profile: Path | None = None,
    **extra,
) -> dict:
    """Train `warmup` + `steps` measured steps (+ one profiled step, left out of the numbers); return per-step
    medians and means of the measured steps and their logged metrics. `kind`: "trl" or "dapo"; `extra`: the config's
    overrides (GRPOConfig's or DAPOConfig's)."""
    measured = range(warmup, warmup + steps)
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=setup["rows_per_step"] // setup["ga"],
        gradient_accumulation_steps=setup["ga"],
        num_generations=setup["generations"],
        max_completion_length=setup["new_tokens"],
        generation_kwargs=pinned_lengths(setup["new_tokens"], extra) if setup["pin_lengths"] else None,
        max_steps=measured.stop + (profile is not None),
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=setup["bf16"],
        use_cpu=setup["device"] == "cpu",
        gradient_checkpointing=setup["gradient_checkpointing"],
        disable_tqdm=True,
        seed=0,
        epsilon_high=0.28,
        loss_type="dapo",
        beta=0.0,
    )
    if kind == "trl":
        trainer_class, config = GRPOTrainer, GRPOConfig(**{**common, **extra})
    else:
        dapo = dict(dynamic_sampling=False, overlong_buffer_len=0)
        trainer_class, config = DAPOTrainer, DAPOConfig(**{**common, **dapo, **extra})
    attention = model.config._attn_implementation  # the model's own (DAPO's packed passes wrap it while they run)
    timer = StepTimer()
    callbacks = [timer] if profile is None else [timer, StepProfiler(measured.stop, profile)]
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
    )
    sections: dict[str, list[tuple[int, float]]] = {}
    generated: list[tuple[int, int]] = []
    trained: list[tuple[int, int, int]] = []
    engine_calls: list[dict] = []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    time_methods(trainer, sections, generated, trained, engine_calls)
    trainer.train()
    step_times = timer.times[measured.start : measured.stop]
    # each section's time in each measured step (a step may call a section several times, or not at all)
    per_step = {k: [sum(t for s, t in calls if s == step) for step in measured] for k, calls in sections.items()}
    mean = {k: statistics.mean(v) for k, v in per_step.items()}
    zeros = [0.0] * len(step_times)
    rest = [
        total - generation - logprob_pass
        for total, generation, logprob_pass in zip(
            step_times, per_step.get("generation", zeros), per_step.get("logprob_pass", zeros), strict=True
        )
    ]
    step, mean_step = statistics.median(step_times), statistics.mean(step_times)
    metrics = [h for h in trainer.state.log_history if "loss" in h][measured.start : measured.stop]
    gaps = [m["logprob_gap_max"] for m in metrics if "logprob_gap_max" in m]
    # completion tokens generated per measured step: the sum of completion lengths (EOS included)
    completion_tokens = statistics.mean(sum(n for s, n in generated if s == step) for step in measured)
    generation, logprob_pass = mean.get("generation", 0.0), mean.get("logprob_pass", 0.0)
    # training forwards' tokens per measured step: the real ones (prompt + completion), and the ones the forwards ran
    # on (padded passes: rows x width of each micro-batch; padding-free passes: the real ones)
    packed = getattr(trainer, "padding_free", False)
    real_tokens = statistics.mean(sum(r for s, r, _ in trained if s == step) for step in measured)
    padded_tokens = statistics.mean(sum(p for s, _, p in trained if s == step) for step in measured)
    result = {
        "step_s": step,
        "step_times_s": step_times,
        # what the comparison must hold equal between kinds, or says where it does not
        "warmup_steps": warmup,
        "micro_batch": config.per_device_train_batch_size,
        "attention": attention,
        "liger": bool(config.use_liger_kernel),
        "vllm_sleep": config.vllm_enable_sleep_mode if config.use_vllm else None,
        "vllm_importance_sampling_correction": config.vllm_importance_sampling_correction if config.use_vllm else None,
        "generation_s": generation,
        "logprob_pass_s": logprob_pass,
        # the rest is taken from the mean step, as the sections are: per-step medians would not add up
        "train_s": mean_step - generation - logprob_pass,
        # the rest of each step on its own: its median is the figure least moved by one slow step
        "train_times_s": rest,
        "train_median_s": statistics.median(rest),
        # where the rest of the step goes: scoring and bookkeeping around generation, the micro-batches' forward,
        # loss and backward, and what the optimizer step, clipping and logging take outside them
        "rest_split_s": {
            "score_and_bookkeeping": mean.get("generate_and_score", 0.0) - generation - logprob_pass,
            "forward_backward": mean.get("training_step", 0.0) - mean.get("generate_and_score", 0.0),
            "optimizer_and_logging": mean_step - mean.get("training_step", 0.0),
        },
        "completion_tokens_per_step": completion_tokens,
        "padding_free": packed,
        "trained_real_tokens_per_step": real_tokens,
        "trained_forward_tokens_per_step": real_tokens if packed else padded_tokens,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "metrics": metrics,
        "logprob_gap_max": max(gaps) if gaps else None,  # train vs rollout logprobs (DAPO logs it)
        # the engine class DAPO generated with (None: TRL's generation path)
        "rollout_engine": type(trainer.paged_engine).__name__ if getattr(trainer, "paged_engine", None) else None,
    }
    result["engine"] = engine_summary(engine_calls, measured)
    # tokens generated per second of generation: the engine's count where it generated (with partial rollouts a
    # step generates tokens of rows it trains later, and trains rows begun earlier), else the completions'
    generated_tokens = result["engine"]["generated_tokens_per_step"] if result["engine"] else completion_tokens
    result["generation_tokens_per_s"] = generated_tokens / (generation or float("nan"))
    result["step_us_per_token"] = 1e6 * step / generated_tokens if generated_tokens else None
    result["training_tokens_per_s"] = completion_tokens / result["train_s"]
    result["training_real_tokens_per_s"] = real_tokens / result["train_s"]
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def engine_summary(calls: list[dict], measured: range) -> dict | None:
    """The paged engine's calls in the measured steps (`timing.record_engine_calls`), per step: their wall time,
    decode steps and the tail's share of them, the tokens they generated (not those resumed rows brought in), the
    rows they resumed with those rows' prefill, those of them continued from a kept cache with the prefill it saved,
    the KV they kept for the next step, and the rows a stream left in flight (carried to the next step, or
    dropped); None when the engine did not generate."""
    calls = [call for call in calls if call["step"] in measured]
    if not calls:
        return None

    def per_step(key: str) -> float:
        return sum(call[key] for call in calls) / len(measured)

    decode_steps, pool = per_step("decode_steps"), per_step("pool_slot_steps")
    return {
        "calls_per_step": len(calls) / len(measured),
        "seconds_per_step": per_step("seconds"),
        "decode_steps_per_step": decode_steps,
        "tail_share": per_step("tail_decode_steps") / decode_steps if decode_steps else 0.0,
        "slot_occupancy": per_step("busy_slot_steps") / pool if pool else 0.0,
        "generated_tokens_per_step": per_step("generated_tokens") - per_step("resumed_tokens"),
        "prefill_tokens_per_step": per_step("prefill_tokens"),
        "resumed_rows_per_step": per_step("resumed_rows"),
        "resumed_prefill_tokens_per_step": per_step("resumed_prefill_tokens"),
        "kept_cache_rows_per_step": per_step("kept_cache_rows"),
        "kept_cache_tokens_per_step": per_step("kept_cache_tokens"),
        "kept_cache_bytes_per_step": per_step("kept_cache_bytes"),
        "unfinished_rows_per_step": per_step("unfinished_rows"),
        "unfinished_tokens_per_step": per_step("unfinished_tokens"),
        "calls": calls,
    }
