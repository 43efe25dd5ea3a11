"""DAPOTrainer against TRL's GRPOTrainer, step for step, on one device; dynamic-sampling cost; the hardware limits.

    python benchmarks/bench_step.py                       # CUDA: Qwen2.5-0.5B and 1.5B architectures, random init
    python benchmarks/bench_step.py --tiny                # CPU smoke run on the tiny local model

Both trainers get the same random-init model, prompts, batch geometry and seed; generation lengths are pinned with
`min_new_tokens = max_completion_length` so both sides decode the same number of tokens. Prints a table last and
writes everything to `benchmarks/results/<name>.json`.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.testing import CHAT_TEMPLATE, build_tiny_model

HERE = Path(__file__).parent


# ----------------------------------------------------------------------------------------------------- set-up


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One token per word `t<i>` for every id of the model's vocabulary, so any sampled id decodes."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompts(count: int, words: int = 24) -> Dataset:
    rows = [" ".join(f"t{100 + (7 * i + 13 * j) % 5000}" for j in range(words)) for i in range(count)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": r}] for r in rows], "index": list(range(count))})


def random_model(config_path: Path, device: str, dtype: torch.dtype, seed: int = 0):
    """Random init directly on the device (initialising a 1.5B model on the host takes longer than a step)."""
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_path)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def parity_reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(ids) % 2) for ids in completion_ids]


def uninformative_reward(fraction: float):
    """Groups of prompts with index % 100 < fraction*100 get a constant reward (filtered); others vary."""

    def reward(completion_ids, index, **kwargs) -> list[float]:
        return [
            0.0 if i % 100 < fraction * 100 else float(sum(ids) % 2)
            for ids, i in zip(completion_ids, index, strict=True)
        ]

    return reward


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, device-synchronised at both ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.times.append(time.perf_counter() - self._start)


class StepProfiler(TrainerCallback):
    """Profile one optimizer step, written to `path` as a text report: the Python functions that take the most time
    (cumulative, host clock: where a step's extra milliseconds go), the ops that take the most time and, on CUDA, how
    many calls made the host wait for the device (each one stalls kernel launches)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.set_sync_debug_mode("warn")
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.__enter__()
        self._python = cProfile.Profile()
        self._python.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if not hasattr(self, "_profile") or state.global_step != self.step + 1:
            return
        synchronize()
        self._python.disable()
        self._profile.__exit__(None, None, None)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        syncs = [w for w in self._caught if "synchroniz" in str(w.message)]
        sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
        functions = io.StringIO()
        pstats.Stats(self._python, stream=functions).strip_dirs().sort_stats("cumulative").print_stats(80)
        averages = self._profile.key_averages()
        device_sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.path.write_text(
            f"host synchronisations in the step: {len(syncs)}\n"
            + "".join(f"  {count:4d}  {site}\n" for site, count in sites.most_common(30))
            + "\n" + functions.getvalue()
            + "\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30)
            + "\n" + averages.table(sort_by=device_sort, row_limit=30)
        )  # fmt: skip
        del self._profile, self._python


def time_methods(trainer, sections: dict[str, list[tuple[int, float]]]) -> None:
    """Time the trainer's own methods by wrapping them (device-synchronised): generation, the no-grad logprob pass,
    generation + scoring + bookkeeping, and whole micro-batch training steps (which contain the former). Each call is
    recorded with the optimizer step it ran in."""

    def timed(name, function):
        def wrapper(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            result = function(*args, **kwargs)
            synchronize()
            key = name if name != "logps" else ("train_forward" if torch.is_grad_enabled() else "logprob_pass")
            sections.setdefault(key, []).append((trainer.state.global_step, time.perf_counter() - start))
            return result

        return wrapper

    for name, method in [
        ("generation", "_generate_single_turn"),
        ("logps", "_get_per_token_logps_and_entropies"),
        ("generate_and_score", "_generate_and_score_completions"),
        ("training_step", "training_step"),
    ]:
        setattr(trainer, method, timed(name, getattr(trainer, method)))


# ------------------------------------------------------------------------------------------------ measurement


def run_trainer(
    kind: str, model, tokenizer, dataset, setup: dict, reward=parity_reward, peft_config=None, profile=None, **extra
) -> dict:
    """Train warm-up + measured steps (+ one profiled step, left out of the numbers); return per-step medians and
    means of the measured steps and their logged metrics."""
    measured = range(setup["warmup"], setup["warmup"] + setup["steps"])
    steps = measured.stop + (profile is not None)
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=setup["rows_per_step"] // setup["ga"],
        gradient_accumulation_steps=setup["ga"],
        num_generations=setup["generations"],
        max_completion_length=setup["new_tokens"],
        generation_kwargs={"min_new_tokens": setup["new_tokens"]},
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=setup["bf16"],
        use_cpu=setup["device"] == "cpu",
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
        epsilon_high=0.28,
        loss_type="dapo",
        beta=0.0,
    )
    if kind == "trl":
        trainer_class, config = GRPOTrainer, GRPOConfig(**common)
    else:
        dapo = dict(dynamic_sampling=False, overlong_buffer_len=0)
        trainer_class, config = DAPOTrainer, DAPOConfig(**{**common, **dapo, **extra})
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
    sections: dict[str, list[float]] = {}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    time_methods(trainer, sections)
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
    generated_tokens = setup["rows_per_step"] * setup["new_tokens"]
    generation, logprob_pass = mean.get("generation", 0.0), mean.get("logprob_pass", 0.0)
    result = {
        "step_s": step,
        "step_times_s": step_times,
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
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "metrics": metrics,
        "logprob_gap_max": max(gaps) if gaps else None,  # train vs rollout logprobs (DAPO logs it)
        "static_engine": getattr(trainer, "rollout_engine", None) is not None,
    }
    generation_time = result["generation_s"] or float("nan")
    result["generation_tokens_per_s"] = generated_tokens / generation_time
    result["training_tokens_per_s"] = generated_tokens / result["train_s"]
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# The trainers a comparison runs, with their DAPOConfig overrides. On CUDA, DAPO generates with the static engine; the same
# DAPO trainer on TRL's generation path does exactly TRL's generation work, so its rest of the step against TRL's is
# the cost of DAPO's loss and bookkeeping alone (on CPU DAPO already takes TRL's path).
COMPARISON_KINDS = {"trl": {}, "dapo": {}, "dapo_trl_generation": {"rollout_engine": "trl"}}


def step_comparison(config_path, tokenizer, setup, kinds: list[str], profile_prefix: str | None = None) -> dict:
    """Run the trainers `kinds` names, in that order, on the same model, prompts and batch."""
    dataset = prompts(4 * setup["rows_per_step"])
    out = {}
    for kind in kinds:
        model = random_model(config_path, setup["device"], setup["dtype"])
        profile = Path(f"{profile_prefix}_{kind}.txt") if profile_prefix else None
        trainer = "trl" if kind == "trl" else "dapo"
        out[kind] = run_trainer(trainer, model, tokenizer, dataset, setup, profile=profile, **COMPARISON_KINDS[kind])
        del model
    keys = ("step_s", "generation_s", "train_s", "train_median_s", "generation_tokens_per_s")
    if {"trl", "dapo"} <= set(out):
        out["ratio"] = {key: out["dapo"][key] / out["trl"][key] for key in keys if out["trl"][key]}
        out["dapo_logprob_gap_max"] = out["dapo"]["logprob_gap_max"]
    if {"trl", "dapo_trl_generation"} <= set(out):  # DAPO's loss and bookkeeping against TRL's, same generation
        same = out["dapo_trl_generation"]
        out["ratio_same_generation"] = {key: same[key] / out["trl"][key] for key in ("train_s", "train_median_s")}
    return out


def sampling_cost(config_path, tokenizer, setup, fractions, oversample_modes, rows: list[dict], save) -> None:
    """Dynamic sampling with a chosen share of uninformative groups: rounds, efficiency, time per trained group
    (appended to `rows`, saved after each run)."""
    dataset = prompts(64 * setup["rows_per_step"])
    for fraction in fractions:
        for oversample, surplus in oversample_modes:
            model = random_model(config_path, setup["device"], setup["dtype"])
            result = run_trainer(
                "dapo",
                model,
                tokenizer,
                dataset,
                setup,
                reward=uninformative_reward(fraction),
                dynamic_sampling=True,
                max_num_gen_batches=0,
                dynamic_sampling_oversample=oversample,
                dynamic_sampling_keep_surplus=surplus,
            )
            del model
            metrics = result["metrics"]

            def mean(name, rows=metrics):
                values = [m[name] for m in rows if name in m]
                return sum(values) / len(values) if values else float("nan")

            trained = setup["rows_per_step"] // setup["generations"]  # qualified groups each step trains on
            rows.append(
                {
                    "uninformative": fraction,
                    "oversample": oversample,
                    "keep_surplus": surplus,
                    "rounds_per_step": mean("dapo/gen_batches"),
                    "generated_groups_per_step": mean("dapo/generated_groups"),
                    "sampling_efficiency": mean("dapo/sampling_efficiency"),
                    "step_s": result["step_s"],
                    "qualified_groups_per_step": mean("dapo/qualified_groups"),
                    "time_per_trained_group_s": result["step_s"] / trained,
                }
            )
            save()


def engine_variants(config_path, tokenizer, setup) -> dict:
    """The DAPO step with gradient checkpointing on, and with a LoRA adapter (merged into the engine's snapshot)."""
    from peft import LoraConfig

    dataset = prompts(4 * setup["rows_per_step"])
    variants = {
        "gradient_checkpointing": ({"gradient_checkpointing": True}, None),
        "lora_r16_all_linear": ({"learning_rate": 1e-5}, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")),
    }
    out = {}
    for name, (extra, peft_config) in variants.items():
        model = random_model(config_path, setup["device"], setup["dtype"])
        result = run_trainer("dapo", model, tokenizer, dataset, setup, peft_config=peft_config, **extra)
        keys = ("step_s", "generation_s", "train_s", "generation_tokens_per_s", "peak_memory_gib")
        out[name] = {key: result[key] for key in (*keys, "static_engine", "logprob_gap_max")}
        del model
    return out


def hardware_ceilings(device: str) -> dict:
    """Measured bf16 matrix rate and device copy bandwidth (the limits MFU and decode bandwidth are read against)."""
    if device != "cuda":
        return {}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)

    def median_ms(function, repeats=20):
        for _ in range(3):
            function()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    matmul_ms = median_ms(lambda: a @ b)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return {"bf16_tflops": 2 * 8192**3 / matmul_ms / 1e9, "copy_tb_per_s": 2 * src.numel() * 2 / copy_ms / 1e9}


def limits(config_path, setup, comparison, ceilings) -> dict:
    """Training MFU and decode bandwidth use of the DAPO step, against the measured ceilings."""
    if not ceilings or "dapo" not in comparison:
        return {}
    config = AutoConfig.from_pretrained(config_path)
    model = random_model(config_path, "meta", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    dapo = comparison["dapo"]
    prompt_tokens = 24 + 8  # words + chat template tokens, per row
    tokens = setup["rows_per_step"] * (setup["new_tokens"] + prompt_tokens)
    mfu = 6 * params * tokens / dapo["train_s"] / (ceilings["bf16_tflops"] * 1e12)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    mean_context = prompt_tokens + setup["new_tokens"] / 2
    bytes_per_step = params * 2 + setup["rows_per_step"] * mean_context * kv_bytes_per_token
    step_s = dapo["generation_s"] / setup["new_tokens"]
    return {
        "params": params,
        "train_mfu": mfu,
        "decode_step_ms": step_s * 1e3,
        "decode_bytes_per_step_gb": bytes_per_step / 1e9,
        "decode_bandwidth_use": bytes_per_step / step_s / (ceilings["copy_tb_per_s"] * 1e12),
    }


# ---------------------------------------------------------------------------------------------------- report


def table(results: dict) -> str:
    lines = [
        "| model | trainer | step s | generation s | logprob pass s | train s | gen tok/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, comparison in results["models"].items():
        for kind in [kind for kind in COMPARISON_KINDS if kind in comparison]:
            r = comparison[kind]
            memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            lines.append(
                f"| {name} | {kind} | {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['logprob_pass_s']:.3f} | "
                f"{r['train_s']:.3f} | {r['generation_tokens_per_s']:.0f} | {memory} |"
            )
        ratio = comparison.get("ratio")
        if ratio:
            lines.append(
                f"| {name} | DAPO/TRL | {ratio.get('step_s', float('nan')):.3f} | {ratio.get('generation_s', float('nan')):.3f} "
                f"| | {ratio.get('train_s', float('nan')):.3f} | {ratio.get('generation_tokens_per_s', float('nan')):.1f}x | |"
            )
    for name, comparison in results["models"].items():
        for kind in [kind for kind in COMPARISON_KINDS if kind in comparison]:
            split = comparison[kind]["rest_split_s"]
            lines.append(
                f"- {name} {kind} rest of step (s): median {comparison[kind]['train_median_s']:.4f}; mean split "
                + ", ".join(f"{k} {v:.4f}" for k, v in split.items())
            )
        for label, ratio in (
            ("DAPO/TRL", comparison.get("ratio")),
            ("same generation", comparison.get("ratio_same_generation")),
        ):
            if ratio:
                lines.append(
                    f"- {name} rest of step {label}: mean {ratio['train_s']:.3f}, median {ratio['train_median_s']:.3f}"
                )
    if results.get("sampling"):
        lines += [
            "",
            "| uninformative | oversample | surplus | rounds/step | groups/step | efficiency | step s | s/trained group |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results["sampling"]:
            lines.append(
                f"| {r['uninformative']:.0%} | {r['oversample']} | {r['keep_surplus']} | {r['rounds_per_step']:.2f} | "
                f"{r['generated_groups_per_step']:.1f} | {r['sampling_efficiency']:.2f} | {r['step_s']:.3f} | "
                f"{r['time_per_trained_group_s']:.3f} |"
            )
    for name, r in results.get("variants", {}).items():
        lines.append(
            f"- DAPO with {name}: step {r['step_s']:.3f} s, generation {r['generation_tokens_per_s']:.0f} tok/s, "
            f"peak {r['peak_memory_gib'] or 0:.1f} GiB, static engine {r['static_engine']}, "
            f"logprob gap max {r['logprob_gap_max']}"
        )
    for name, value in results.get("limits", {}).items():
        if value:
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in value.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on the tiny local model")
    parser.add_argument("--models", nargs="*", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ga", type=int, default=4, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--sections", nargs="*", default=["comparison", "variants", "sampling"],
        choices=["comparison", "variants", "sampling"],
        help="comparison: TRL vs DAPO step; variants: DAPO with gradient checkpointing / LoRA; sampling: "
        "dynamic-sampling cost and adaptive candidate sizing",
    )  # fmt: skip
    parser.add_argument(
        "--sampling-modes", nargs="*", default=["1.0:False", "1.0:True", "auto:True", "auto:False"],
        help="dynamic_sampling_oversample:dynamic_sampling_keep_surplus pairs of the sampling section",
    )  # fmt: skip
    parser.add_argument("--sampling-fractions", nargs="*", type=float, default=[0.5, 0.8])
    parser.add_argument(
        "--kinds", nargs="*", choices=list(COMPARISON_KINDS), default=None,
        help="comparison: the trainers to run, in this order (default: all; on CPU, DAPO already uses TRL's path)",
    )  # fmt: skip
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--profile", action="store_true",
        help="comparison section: profile the first measured step of each trainer (text reports beside the JSON)",
    )  # fmt: skip
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    setup = {
        "device": device,
        "dtype": torch.bfloat16 if device == "cuda" else torch.float32,
        "bf16": device == "cuda",
        "rows_per_step": args.prompts * args.generations,
        "generations": args.generations,
        "new_tokens": args.new_tokens,
        "ga": args.ga,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if args.tiny:
        tiny_dir = Path(tempfile.mkdtemp())
        build_tiny_model(tiny_dir)
        configs = {"tiny": tiny_dir / "config.json"}
    else:
        configs = {name: HERE / "configs" / f"{name}.json" for name in args.models}
    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": {
            m.__name__: m.__version__ for m in map(__import__, ["torch", "transformers", "trl", "accelerate"])
        },
        "setup": {k: str(v) for k, v in setup.items()},
        "models": {},
    }
    ceilings = hardware_ceilings(device)
    results["ceilings"] = ceilings
    results["limits"] = {}
    output = Path(args.output or HERE / "results" / f"bench_step_{'tiny' if args.tiny else device}.json")
    output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section, so a run stopped early keeps what it measured
        output.write_text(json.dumps(results, indent=2, default=str))
        print(table(results), flush=True)

    if "comparison" in args.sections:
        for name, config_path in configs.items():
            tokenizer = word_tokenizer(AutoConfig.from_pretrained(config_path).vocab_size)
            prefix = str(output.parent / f"profile_{name}") if args.profile else None
            kinds = args.kinds or [k for k in COMPARISON_KINDS if device == "cuda" or k != "dapo_trl_generation"]
            results["models"][name] = step_comparison(config_path, tokenizer, setup, kinds, prefix)
            results["limits"][name] = limits(config_path, setup, results["models"][name], ceilings)
            save()
    first = next(iter(configs.values()))
    tokenizer = word_tokenizer(AutoConfig.from_pretrained(first).vocab_size)
    if "variants" in args.sections:
        results["variants"] = engine_variants(first, tokenizer, setup)
        save()
    if "sampling" in args.sections:
        modes = [(mode.split(":")[0], mode.split(":")[1] == "True") for mode in args.sampling_modes]
        results["sampling"] = []
        sampling_cost(first, tokenizer, setup, args.sampling_fractions, modes, results["sampling"], save)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
