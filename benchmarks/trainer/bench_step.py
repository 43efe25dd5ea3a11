"""DAPOTrainer against TRL's GRPOTrainer, step for step, on one device; DAPO with gradient checkpointing, with LoRA and
with the old policy recomputed; training MFU and decode bandwidth use against the measured hardware ceilings.

    # CUDA: Qwen2.5-0.5B and 1.5B architectures, random init
    python3 -m benchmarks.trainer.bench_step
    # CUDA: 0.5B, 2,048-token vocabulary, up to 4,096 tokens
    python3 -m benchmarks.trainer.bench_step --variable-lengths
    # CPU smoke run on the tiny local model
    python3 -m benchmarks.trainer.bench_step --tiny
    # partial rollouts
    python3 -m benchmarks.trainer.bench_step --variable-lengths --kinds dapo dapo_partial dapo_stream_carry
    # partial rollouts re-prefilling their carried rows and keeping their KV, in a slot pool twice the batch's
    python3 -m benchmarks.trainer.bench_step --variable-lengths --kinds dapo dapo_partial dapo_partial_kept \\
        --carry-max-rows 256
    # FP8 rollouts
    python3 -m benchmarks.trainer.bench_step --variable-lengths --kinds dapo dapo_fp8 dapo_fp8_partial
    # equal work against TRL with vLLM and continuous batching
    python3 -m benchmarks.trainer.bench_step --variable-lengths --fair --new-tokens 2048 --micro-batches 16 \\
        --kinds dapo trl_vllm dapo_vllm trl_cb

Both trainers get the same random-init model, prompts, batch geometry and seed. By default generation lengths are
pinned (`--pin-lengths`: `min_new_tokens = max_completion_length`, vLLM's `min_tokens`, no end token for continuous
batching), so every kind decodes the same number of tokens. With `--variable-lengths` nothing is pinned (unless
`--pin-lengths` or `--fair`) and the vocabulary has 2,048 tokens, so lengths are geometric with mean about 2,000 up to
the maximum (4,096): TRL's `generate` decodes every row until the longest ends, DAPO's engine what it decodes; each
kind samples its own lengths, so compare steps per generated token (`step us / gen tok`). Tokens/s is the tokens
generated over generation time (the completions' lengths, or where trl-dapo's engine generated, its own count).
Where the engine generated, a second table gives its calls per step: decode steps, the tail's share of them (steps
with under a quarter of the engine's `--max-rows` slots busy), and the rows carried across steps by partial rollouts
(left in flight at the end of a step, resumed with their prompt and tokens prefilled again, or from their kept KV),
with the share of trained tokens an earlier step's weights sampled and the trained groups' age. Prints the tables
last and writes everything to `benchmarks/results/<name>.json` after every trainer.

TRL's other generation paths (`trl_vllm`, `trl_cb`) and DAPOTrainer on TRL's vLLM path (`dapo_vllm`) are kinds too,
TRL's set as a competent user would for DAPO's algorithm (below: no importance-sampling pass, vLLM asleep only where
memory needs it, Liger with `--liger`, the attention of `--attention`; each kind's record says which it ran). vLLM
loads its model from a folder, so with a vLLM kind every kind loads the same weights saved once to `--checkpoints`,
and each kind runs in a process of its own (`--isolate`, `step_isolation.py`), where one that runs out of memory runs
again at the next of `--micro-batches`. Each DAPO step is set against each of them, and `dapo_vllm` against
`trl_vllm` (the same vLLM, seed and weights: the same completions). `--fair` holds the work and the settings equal:
lengths pinned, every kind one warm-up step (at least) and two measured steps (at least), one micro-batch.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.core.isolated import OK, OUT_OF_MEMORY
from benchmarks.core.result_file import ResultFile, default_output
from benchmarks.core.timing import hardware_ceilings
from benchmarks.core.workload import (
    CPU_CB_CONFIG,
    config_path,
    decode_weight_bytes,
    kv_bytes_per_token,
    prompts,
    random_model,
    word_tokenizer,
)
from benchmarks.trainer.step_isolation import isolated_comparison, previous_models, save_checkpoint
from benchmarks.trainer.trainer_run import add_batch_arguments, batch_setup, run_trainer
from trl_dapo.trainer.configuration.choices import DEFAULT_MAX_IN_FLIGHT

# The trainers a comparison runs, with their DAPOConfig overrides. On CUDA, DAPO generates with its engine; the same
# DAPO trainer on TRL's generation path does exactly TRL's generation work, so its rest of the step against TRL's is
# the cost of DAPO's loss and bookkeeping alone (on CPU DAPO already takes TRL's path).
# `dapo` trains padding-free (on CUDA its default; on the CPU the per-row reference attention), `dapo_padded` with
# padded passes (`padding_free=False`), rows split evenly by count.
# Partial rollouts (rows unfinished at the end of a step carried into the next, continued under the new weights):
# `dapo_partial` in the default rounds mode (one round per step, stopped once the batch's groups have ended);
# `dapo_stream_carry` in stream mode (every group qualifies under the parity reward, so it trains what `dapo` trains).
# Both on the paged engine (the CPU included), with `--max-in-flight`, `--max-age` and `--carry-max-rows`.
# `dapo_partial_kept` is `dapo_partial` whose carried rows keep their KV across the step (`--keep-cache`, the
# `partial_rollout_keep_cache` share of the device's memory) and continue from it instead of a prefill.
# FP8 rollouts (GPUs of compute capability 8.9 or more): `dapo_fp8` generates with an FP8 KV cache and FP8 weights,
# the old policy recomputed under a token-mask correction (what the config requires with FP8; the recompute pass is
# in its step), `dapo_fp8_partial` the same with partial rollouts.
FP8_ROLLOUTS = {
    "rollout_engine": "paged",
    "rollout_kv_cache_dtype": "fp8",
    "rollout_weights_dtype": "fp8",
    "old_logprobs": "recompute",
    "rollout_correction": "token_mask",
}
# TRL's own generation paths, each as a TRL user turns it on (GRPOConfig fields): its `generate` (`trl`), vLLM in the
# trainer's process (`trl_vllm`), transformers' continuous batching (`trl_cb`). `trl_vllm` is set as a user wanting
# DAPO's algorithm would: without TRL's importance-sampling correction (DAPO has none; with it TRL runs a logprob pass
# of the training model every step), sleeping between rollouts (level 2: its weights and KV cache leave the device for
# the training passes, each rollout pushes the weights again) only where the awake engine leaves too little memory
# (`--vllm-sleep`). `dapo_vllm` is DAPOTrainer on TRL's vLLM path (no correction either), training as `dapo`.
# vLLM loads the model from a folder: every kind of such a comparison loads the same saved weights (`--checkpoints`).
# `--liger` gives TRL's kinds Liger's kernels, `--attention` every kind's model its attention implementation.
VLLM_COLOCATE = {"use_vllm": True, "vllm_mode": "colocate"}
TRL_KINDS = {
    "trl": {},
    "trl_vllm": {**VLLM_COLOCATE, "vllm_importance_sampling_correction": False},
    "trl_cb": {"use_transformers_continuous_batching": True},
}
COMPARISON_KINDS = {
    **TRL_KINDS,
    "dapo_vllm": {"padding_free": True, **VLLM_COLOCATE},
    "dapo": {"padding_free": True},
    "dapo_padded": {"padding_free": False},
    "dapo_trl_generation": {"rollout_engine": "trl"},
    "dapo_partial": {"padding_free": True, "rollout_engine": "paged", "partial_rollouts": True},
    "dapo_stream_carry": {
        "padding_free": True,
        "rollout_engine": "paged",
        "partial_rollouts": True,
        "dynamic_sampling": True,
        "dynamic_sampling_mode": "stream",
        "max_num_gen_batches": 0,
    },
    "dapo_partial_kept": {"padding_free": True, "rollout_engine": "paged", "partial_rollouts": True},
    "dapo_fp8": {"padding_free": True, **FP8_ROLLOUTS},
    "dapo_fp8_partial": {"padding_free": True, **FP8_ROLLOUTS, "partial_rollouts": True},
}
CARRYING_KINDS = ("dapo_partial", "dapo_partial_kept", "dapo_stream_carry", "dapo_fp8_partial")
KEPT_CACHE_KINDS = ("dapo_partial_kept",)
FP8_KINDS = ("dapo_fp8", "dapo_fp8_partial")
VLLM_KINDS = ("trl_vllm", "dapo_vllm")  # CUDA and vLLM only; each in a process of its own
PEER_KINDS = ("trl_vllm", "trl_cb")  # what TRL users run: DAPO's steps against each
# DAPO's step against each of TRL's; DAPOTrainer on TRL's vLLM path against GRPOTrainer on it (the same completions)
PEER_PAIRS = (
    *((ours, peer) for ours in ("dapo", "dapo_partial_kept") for peer in PEER_KINDS),
    ("dapo_vllm", "trl_vllm"),
)
# against `dapo`, same batch
RATIO_KINDS = ("dapo_partial", "dapo_partial_kept", "dapo_stream_carry", *FP8_KINDS, "dapo_vllm")


def per_kind(values: list[str], default: int) -> dict[str, int]:
    """`["3"]` -> 3 for every trainer; `["2", "trl=1"]` -> 1 for TRL, 2 for the others."""
    counts = dict.fromkeys(COMPARISON_KINDS, default)
    for value in values:
        kind, _, count = value.rpartition("=")
        if (kind and kind not in COMPARISON_KINDS) or not count.isdigit():
            raise SystemExit(f"--steps/--warmup: {value!r} is not N or KIND=N with KIND in {list(COMPARISON_KINDS)}.")
        counts.update({kind: int(count)} if kind else dict.fromkeys(COMPARISON_KINDS, int(count)))
    return counts


def step_comparison(
    config,
    tokenizer,
    setup,
    kinds,
    warmup,
    steps,
    out: dict,
    save,
    profile_prefix: str | None = None,
    lora: int = 0,
    dapo_settings: dict | None = None,
    carry_settings: dict | None = None,
    keep_cache: float = 0.0,
) -> None:
    """Run the trainers `kinds` names, in that order, on the same model, prompts and batch (a LoRA adapter of rank
    `lora` on every linear layer when set; `dapo_settings`: DAPOConfig fields every DAPO trainer gets, and
    `carry_settings` those carrying rows across steps, `keep_cache` the share of memory the kept-cache kinds keep
    their carried rows' KV in); each one's result goes into `out`, saved at once (a run cut short in a slow trainer
    keeps the ones before)."""
    from peft import LoraConfig

    dataset = prompts(4 * setup["rows_per_step"], vocab_size=len(tokenizer), words=setup["prompt_words"])
    peft_config = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear") if lora else None
    for kind in kinds:
        model = comparison_model(config, setup)
        profile = Path(f"{profile_prefix}_{kind}.txt") if profile_prefix else None
        trainer = "trl" if kind in TRL_KINDS else "dapo"
        settings = dict(COMPARISON_KINDS[kind])
        if trainer == "dapo" and kind not in VLLM_KINDS:
            settings = {**(dapo_settings or {}), **settings}
        if kind in VLLM_KINDS:
            settings["vllm_gpu_memory_utilization"] = setup["vllm_memory"]
            settings["vllm_enable_sleep_mode"] = setup["vllm_sleep"] == "on"  # the isolated parent chose on or off
        if kind in TRL_KINDS and setup["liger"]:
            settings["use_liger_kernel"] = True
        if kind == "trl_cb" and setup["device"] == "cpu":
            settings["transformers_continuous_batching_config"] = CPU_CB_CONFIG
        if kind in CARRYING_KINDS:
            settings.update(carry_settings or {})
        if kind in KEPT_CACHE_KINDS:
            settings["partial_rollout_keep_cache"] = keep_cache
        out[kind] = run_trainer(
            trainer, model, tokenizer, dataset, setup, warmup[kind], steps[kind], profile=profile,
            peft_config=peft_config, **settings,
        )  # fmt: skip
        del model
        save()
    add_ratios(out)


def comparison_model(config, setup: dict):
    """The comparison's model, with the attention `--attention` chose: random init on the device, or where a kind
    loads its model from a folder (vLLM) the weights saved in `setup["checkpoint"]` for every kind."""
    if setup.get("checkpoint") is None:
        model = random_model(config, setup["device"], setup["dtype"])
    else:
        model = AutoModelForCausalLM.from_pretrained(setup["checkpoint"], dtype=setup["dtype"]).to(setup["device"])
    model.set_attn_implementation(setup["attention"])
    return model


def attention_implementation(asked: str, device: str) -> str:
    """`--attention`: "auto" is FlashAttention 2 on CUDA where its package is installed, else PyTorch's SDPA."""
    if asked != "auto":
        return asked
    return "flash_attention_2" if device == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def fair_counts(args, variable: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Warm-up and measured steps per kind. `--fair`: the same for every kind, at least 1 warm-up step (compilation,
    caches, the allocator's first growth out of the measured steps) and 2 measured ones, one micro-batch for every kind
    and lengths pinned, else a clear error before anything runs."""
    if args.fair:
        per_kind_values = [value for value in (args.warmup or []) + (args.steps or []) if "=" in value]
        problems = [
            (per_kind_values, f"every kind gets the same warm-up and measured steps: drop {per_kind_values}"),
            (args.pin_lengths is False, "lengths are pinned (every row --new-tokens): drop --no-pin-lengths"),
            (len(args.micro_batches or []) > 1, "one micro-batch for every kind: give --micro-batches one size"),
        ]
        wrong = [text for failed, text in problems if failed]
        if wrong:
            raise SystemExit("--fair: " + "; ".join(wrong) + ".")
    warmup = per_kind(args.warmup or [], default=1)
    steps = per_kind(args.steps or [], default=2 if args.fair else 1 if variable else 3)
    if args.fair and (min(warmup.values()) < 1 or min(steps.values()) < 2):
        raise SystemExit("--fair: at least 1 warm-up step (--warmup) and 2 measured steps (--steps) for every kind.")
    return warmup, steps


def measured(out: dict) -> set[str]:
    """The kinds of a comparison that were measured (not timed out, out of memory or failed in their process)."""
    return {kind for kind in COMPARISON_KINDS if kind in out and out[kind].get("status", OK) == OK}


def add_ratios(out: dict) -> None:
    """Each pair's ratios, where both were measured: DAPO against TRL, and against each of TRL's other generation
    paths; DAPO's loss against TRL's on the same generation; padding-free against padded; variants against `dapo`."""
    done = measured(out)
    keys = ("step_s", "step_us_per_token", "generation_s", "train_s", "train_median_s", "generation_tokens_per_s")
    if {"trl", "dapo"} <= done:
        out["ratio"] = {key: out["dapo"][key] / out["trl"][key] for key in keys if out["trl"].get(key)}
        out["dapo_logprob_gap_max"] = out["dapo"]["logprob_gap_max"]
    for ours, peer in [(ours, peer) for ours, peer in PEER_PAIRS if {ours, peer} <= done]:
        out[f"ratio_{ours}_over_{peer}"] = {
            key: out[ours][key] / out[peer][key] for key in keys if out[ours].get(key) and out[peer].get(key)
        }
    if {"trl", "dapo_trl_generation"} <= done:  # DAPO's loss and bookkeeping against TRL's, same generation
        same = out["dapo_trl_generation"]
        out["ratio_same_generation"] = {key: same[key] / out["trl"][key] for key in ("train_s", "train_median_s")}
    if {"dapo", "dapo_padded"} <= done:  # padding-free against padded training passes, same everything else
        keys = ("step_s", "train_s", "train_median_s", "peak_memory_gib")
        out["ratio_padding_free"] = {
            key: out["dapo"][key] / out["dapo_padded"][key] for key in keys if out["dapo_padded"][key]
        }
    for kind in [kind for kind in RATIO_KINDS if {kind, "dapo"} <= done]:  # against plain DAPO
        keys = ("step_s", "generation_s", "train_s", "train_median_s")
        out[f"ratio_{kind}"] = {key: out[kind][key] / out["dapo"][key] for key in keys if out["dapo"][key]}
    add_flash_attention_bounds(out, done)


def add_flash_attention_bounds(out: dict, done: set[str]) -> None:
    """Where TRL's kinds ran without FlashAttention, the most it could save them, from DAPO's own training passes on
    this run's rows: packing drops the padding from every layer and runs a variable-length flash kernel, while
    FlashAttention over TRL's padded rows drops it from attention alone, so TRL's forward passes (training and
    logprob) would take at least `packed / padded` of their time. Each DAPO step against that floor is the ratio
    FlashAttention for TRL could not push above."""
    if not {"dapo", "dapo_padded"} <= done or not out["dapo_padded"]["train_s"]:
        return
    share = out["dapo"]["train_s"] / out["dapo_padded"]["train_s"]
    for ours, peer in [(ours, peer) for ours, peer in (("dapo", "trl"), *PEER_PAIRS) if {ours, peer} <= done]:
        trl = out[peer]
        if trl.get("attention") == "flash_attention_2" or not trl.get("completion_tokens_per_step"):
            continue
        passes = trl["train_s"] + trl["logprob_pass_s"]
        step_floor = trl["step_s"] - passes * max(0.0, 1 - share)  # packing slower than padding here: no saving
        floor_us = step_floor / trl["completion_tokens_per_step"] * 1e6
        out[f"flash_bound_{ours}_over_{peer}"] = {
            "packed_over_padded": share,
            "trl_step_s_at_least": step_floor,
            "trl_step_us_per_token_at_least": floor_us,
            "step_us_per_token": out[ours]["step_us_per_token"] / floor_us,
        }


def engine_variants(config, tokenizer, setup, warmup: int, steps: int) -> dict:
    """The DAPO step with gradient checkpointing on, with a LoRA adapter (merged into the engine's snapshot), and with
    the old policy recomputed by the training model (its pass is `logprob_pass_s`) under a TIS correction."""
    from peft import LoraConfig

    dataset = prompts(4 * setup["rows_per_step"], vocab_size=len(tokenizer))
    variants = {
        "gradient_checkpointing": ({"gradient_checkpointing": True}, None),
        "lora_r16_all_linear": ({"learning_rate": 1e-5}, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")),
        "recompute_old_logprobs": ({"old_logprobs": "recompute", "rollout_correction": "token_truncate"}, None),
    }
    out = {}
    for name, (extra, peft_config) in variants.items():
        model = random_model(config, setup["device"], setup["dtype"])
        result = run_trainer("dapo", model, tokenizer, dataset, setup, warmup, steps, peft_config=peft_config, **extra)
        keys = ("step_s", "generation_s", "logprob_pass_s", "train_s", "generation_tokens_per_s", "peak_memory_gib")
        out[name] = {key: result[key] for key in (*keys, "rollout_engine", "logprob_gap_max")}
        del model
    return out


def limits(config, setup, comparison, ceilings) -> dict:
    """Training MFU and decode bandwidth use of the DAPO step, against the measured ceilings (pinned lengths: every
    row decodes `new_tokens`)."""
    if not ceilings or "dapo" not in comparison or not setup["pin_lengths"]:
        return {}
    model = random_model(config, "meta", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    dapo = comparison["dapo"]
    prompt_tokens = 24 + 8  # words + chat template tokens, per row
    tokens = setup["rows_per_step"] * (setup["new_tokens"] + prompt_tokens)
    mfu = 6 * params * tokens / dapo["train_s"] / (ceilings["bf16_tflops"] * 1e12)
    mean_context = prompt_tokens + setup["new_tokens"] / 2
    kv_bytes = kv_bytes_per_token(AutoConfig.from_pretrained(config))
    bytes_per_step = decode_weight_bytes(model) + setup["rows_per_step"] * mean_context * kv_bytes
    step_s = dapo["generation_s"] / setup["new_tokens"]
    return {
        "params": params,
        "train_mfu": mfu,
        "decode_step_ms": step_s * 1e3,
        "decode_bytes_per_step_gb": bytes_per_step / 1e9,
        "decode_bandwidth_use": bytes_per_step / step_s / (ceilings["copy_tb_per_s"] * 1e12),
    }


def tail_table(results: dict) -> str:
    """Where trl-dapo's engine generated: its calls per measured step, what partial rollouts carried and how old the
    trained tokens' policies were (means of the measured steps' logged metrics), and partial rollouts against none."""
    lines = [
        "| model | trainer | step s | generation s | train s | decode steps | tail share | slots busy | "
        "generated tok | left in flight: rows / tok | resumed: rows / prefill tok | kept cache: rows / MiB | "
        "older-policy tokens | group age mean / max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, comparison in results["models"].items():
        for kind in [kind for kind in COMPARISON_KINDS if comparison.get(kind, {}).get("engine")]:
            r, e = comparison[kind], comparison[kind]["engine"]
            lines.append(
                f"| {name} | {kind} | {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['train_s']:.3f} | "
                f"{e['decode_steps_per_step']:.0f} | {e['tail_share']:.1%} | {e['slot_occupancy']:.1%} | "
                f"{e['generated_tokens_per_step']:.0f} | {e['unfinished_rows_per_step']:.1f} / "
                f"{e['unfinished_tokens_per_step']:.0f} | {e['resumed_rows_per_step']:.1f} / "
                f"{e['resumed_prefill_tokens_per_step']:.0f} | {e['kept_cache_rows_per_step']:.1f} / "
                f"{e['kept_cache_bytes_per_step'] / 2**20:.1f} | "
                f"{mean_metric(r, 'dapo/old_policy_token_share'):.1%} | "
                f"{mean_metric(r, 'dapo/trained_group_age_mean'):.1f} / "
                f"{max((m.get('dapo/trained_group_age_max', 0) for m in r['metrics']), default=0):.0f} |"
            )
        for kind in RATIO_KINDS:
            ratio = comparison.get(f"ratio_{kind}")
            if ratio:
                lines.append(
                    f"| {name} | {kind}/dapo | {ratio['step_s']:.3f} | {ratio.get('generation_s', float('nan')):.3f} "
                    f"| {ratio['train_s']:.3f} | | | | | | | | | |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""


def mean_metric(run: dict, name: str) -> float:
    """A logged metric's mean over the measured steps (0 where it was not logged)."""
    values = [entry.get(name, 0.0) for entry in run["metrics"]]
    return sum(values) / len(values) if values else 0.0


def outcome_text(record: dict, ladder_only: bool = False) -> str:
    """How an isolated kind's process ended (unless `ladder_only`), and the micro-batches it ran out of memory at."""
    ladder = [str(rung["micro_batch"]) for rung in record.get("ladder", []) if rung["status"] == OUT_OF_MEMORY]
    out_of_memory = f"; out of memory at {', '.join(ladder)}" if ladder else ""
    if ladder_only:
        return out_of_memory
    text = record["status"] + (f" after {record['timeout_s']:.0f} s" if "timeout_s" in record else "")
    return text + (f": {record['error'][:160]}" if record.get("error") else "") + out_of_memory


def settings_text(r: dict) -> str:
    """A measured kind's settings that may differ between kinds: micro-batch (and the ones it ran out of memory at),
    warm-up steps, attention, Liger, vLLM asleep between rollouts."""
    parts = [f"micro-batch {r['micro_batch']}{outcome_text(r, ladder_only=True)}"] if "micro_batch" in r else []
    parts += [f"warm-up {r['warmup_steps']}"] if "warmup_steps" in r else []
    parts += [r["attention"]] if r.get("attention") else []
    parts += ["Liger"] if r.get("liger") else []
    parts += [{True: "vLLM asleep", False: "vLLM awake"}[r["vllm_sleep"]]] if r.get("vllm_sleep") is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def table(results: dict) -> str:
    lines = [
        "| model | trainer | step s | step us / gen tok | generation s | logprob pass s | train s | "
        "completion tok/step | gen tok/s | trained real / forward tok/step | train real tok/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for name, comparison in results["models"].items():
        done = measured(comparison)
        for kind in [kind for kind in COMPARISON_KINDS if kind in comparison]:
            r = comparison[kind]
            if kind not in done:
                lines.append(f"| {name} | {kind} | {outcome_text(r)} | | | | | | | | | |")
                continue
            memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            lines.append(
                f"| {name} | {kind}{settings_text(r)} | {r['step_s']:.3f} | {r.get('step_us_per_token', nan):.1f} | "
                f"{r['generation_s']:.3f} | {r['logprob_pass_s']:.3f} | {r['train_s']:.3f} | "
                f"{r['completion_tokens_per_step']:.0f} | {r['generation_tokens_per_s']:.0f} | "
                f"{r['trained_real_tokens_per_step']:.0f} / {r['trained_forward_tokens_per_step']:.0f} | "
                f"{r['training_real_tokens_per_s']:.0f} | {memory} |"
            )
        ratio = comparison.get("ratio")
        if ratio:
            lines.append(
                f"| {name} | DAPO/TRL | {ratio.get('step_s', nan):.3f} | {ratio.get('step_us_per_token', nan):.3f} | "
                f"{ratio.get('generation_s', nan):.3f} | | {ratio.get('train_s', nan):.3f} | | "
                f"{ratio.get('generation_tokens_per_s', nan):.1f}x | | | |"
            )
        ratio = comparison.get("ratio_padding_free")
        if ratio:
            lines.append(
                f"| {name} | padding-free/padded | {ratio['step_s']:.3f} | | | | {ratio['train_s']:.3f} | | | | | "
                f"{ratio.get('peak_memory_gib', nan):.3f} |"
            )
        for key in [key for key in comparison if key.startswith("ratio_") and "_over_" in key]:
            ratio, pair = comparison[key], key.removeprefix("ratio_").replace("_over_", "/")
            lines.append(
                f"| {name} | {pair} | {ratio['step_s']:.3f} | {ratio.get('step_us_per_token', nan):.3f} | "
                f"{ratio.get('generation_s', nan):.3f} | | {ratio['train_s']:.3f} | | | | | |"
            )
    for name, comparison in results["models"].items():
        for kind in [kind for kind in COMPARISON_KINDS if kind in measured(comparison)]:
            split = comparison[kind]["rest_split_s"]
            lines.append(
                f"- {name} {kind} rest of step (s): median {comparison[kind]['train_median_s']:.4f}; mean split "
                + ", ".join(f"{k} {v:.4f}" for k, v in split.items())
            )
        for key in [key for key in comparison if key.startswith("flash_bound_")]:
            bound, pair = comparison[key], key.removeprefix("flash_bound_").replace("_over_", "/")
            lines.append(
                f"- {name} {pair} were TRL on FlashAttention: its forward passes at best x "
                f"{bound['packed_over_padded']:.3f} (DAPO's packed/padded training here), its step at least "
                f"{bound['trl_step_s_at_least']:.3f} s, {bound['trl_step_us_per_token_at_least']:.1f} us per generated "
                f"token; {pair} per generated token at most {bound['step_us_per_token']:.3f}"
            )
        for label, ratio in (
            ("DAPO/TRL", comparison.get("ratio")),
            ("same generation", comparison.get("ratio_same_generation")),
        ):
            if ratio:
                lines.append(
                    f"- {name} rest of step {label}: mean {ratio['train_s']:.3f}, median {ratio['train_median_s']:.3f}"
                )
    for name, r in results.get("variants", {}).items():
        lines.append(
            f"- DAPO with {name}: step {r['step_s']:.3f} s, generation {r['generation_tokens_per_s']:.0f} tok/s, "
            f"logprob pass {r['logprob_pass_s']:.3f} s, "
            f"peak {r['peak_memory_gib'] or 0:.1f} GiB, engine {r['rollout_engine']}, "
            f"logprob gap max {r['logprob_gap_max']}"
        )
    for name, value in results.get("limits", {}).items():
        if value:
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in value.items()))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(parser, new_tokens=None)
    parser.add_argument(
        "--variable-lengths", action="store_true",
        help="no min_new_tokens pin, 2,048-token vocabulary (default model qwen2.5-0.5b-v2048), --new-tokens 4096, "
        "gradient checkpointing, 1 warm-up + 1 measured step, trainers dapo, dapo_padded then trl, comparison "
        "section only",
    )  # fmt: skip
    parser.add_argument(
        "--steps", nargs="*", default=None,
        help="measured steps after the warm-up: N for every trainer and/or KIND=N (e.g. 3 trl=1); default 3 (1 with "
        "--variable-lengths, 2 with --fair)",
    )  # fmt: skip
    parser.add_argument(
        "--pin-lengths", action=argparse.BooleanOptionalAction, default=None,
        help="every row exactly --new-tokens tokens on every kind's generation path, so all kinds sample the same "
        "tokens (default: on, off with --variable-lengths, on with --fair)",
    )  # fmt: skip
    parser.add_argument(
        "--fair", action="store_true",
        help="equal work and settings for every kind: lengths pinned, the same warm-up (default 1) and measured steps "
        "(default 2, at least 2) for every kind, one micro-batch; refuses per-kind step counts",
    )  # fmt: skip
    parser.add_argument("--warmup", nargs="*", default=None, help="warm-up steps, as --steps; default 1")
    parser.add_argument("--lora", type=int, default=0, help="comparison: a LoRA adapter of this rank (all linear)")
    parser.add_argument(
        "--sections", nargs="*", default=None, choices=["comparison", "variants"],
        help="comparison: TRL vs DAPO step; variants: DAPO with gradient checkpointing / LoRA / the old policy "
        "recomputed (default: both; comparison with --variable-lengths)",
    )  # fmt: skip
    parser.add_argument(
        "--kinds", nargs="*", choices=list(COMPARISON_KINDS), default=None,
        help="comparison: the trainers to run, in this order (default: all; dapo, dapo_padded, trl with "
        "--variable-lengths; "
        "on CPU, DAPO already uses TRL's path)",
    )  # fmt: skip
    parser.add_argument(
        "--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
        help="for every trainer (default: on with --variable-lengths, else off)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="comparison section: profile the first measured step of each trainer (text reports beside the JSON)",
    )  # fmt: skip
    parser.add_argument(
        "--max-rows", type=int, default=None,
        help="the paged engine's decode slots (rollout_max_rows) for every DAPO trainer, and the slots the tail share "
        "counts against (default: the completions per step, so a round fills them; partial rollouts keep them full)",
    )  # fmt: skip
    parser.add_argument(
        "--max-in-flight", type=float, default=DEFAULT_MAX_IN_FLIGHT,
        help="the kinds carrying rows across steps: partial_rollout_max_in_flight, the most groups in flight in "
        "generation batches (more keeps the slots busier and the trained groups older)",
    )  # fmt: skip
    parser.add_argument(
        "--carry-max-rows", type=int, default=None,
        help="the kinds carrying rows across steps: their decode slots (rollout_max_rows), e.g. twice the completions "
        "per step so a round fills them from the prompts beyond its batch (default: --max-rows)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-cache", type=float, default=0.1,
        help="dapo_partial_kept: partial_rollout_keep_cache, the share of the device's memory its carried rows' KV "
        "keeps through the training step",
    )  # fmt: skip
    parser.add_argument(
        "--max-age", type=int, default=None,
        help="the kinds carrying rows across steps: partial_rollout_max_age, optimizer steps a carried group may age "
        "before it is dropped (default: never; the in-flight cap bounds the age)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-memory", type=float, default=0.3,
        help="the vLLM kinds: vllm_gpu_memory_utilization, vLLM's share of the device (default TRL's, 0.3)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-sleep", choices=["auto", "on", "off"], default="auto",
        help="the vLLM kinds: vllm_enable_sleep_mode; auto: awake, asleep where the awake run runs out of memory (at "
        "the same micro-batch, before a smaller one)",
    )  # fmt: skip
    parser.add_argument(
        "--liger", action="store_true",
        help="TRL's kinds with use_liger_kernel=True (the liger_kernel package must be installed: refused otherwise)",
    )  # fmt: skip
    parser.add_argument(
        "--attention", default="auto",
        help="every kind's model's attn_implementation (default auto: flash_attention_2 on CUDA where flash_attn is "
        "installed, else sdpa); each kind records the one it ran",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoints", default=None,
        help="a folder of saved models (one per config, saved there when missing): every kind loads its model from "
        "it (default when a vLLM kind runs, which loads by path: a temporary folder; otherwise random init)",
    )  # fmt: skip
    parser.add_argument(
        "--isolate", action="store_true",
        help="each kind in a process of its own under --timeout, down the --micro-batches ladder (always on with a "
        "vLLM kind)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=540, help="isolated: seconds each kind's process may take")
    parser.add_argument(
        "--micro-batches", type=int, nargs="*", default=None,
        help="isolated: micro-batch sizes to try in order, the next after one runs out of memory (gradient "
        "accumulation set to keep the batch), e.g. 32 16 8 (default: the one --ga gives)",
    )  # fmt: skip
    parser.add_argument("--skip-done", action="store_true", help="isolated: keep --output's kinds, run the others")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a kind run by an isolated parent
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    variable = args.variable_lengths
    sections = args.sections or (["comparison"] if variable else ["comparison", "variants"])
    args.new_tokens = args.new_tokens or (4096 if variable else 256)
    checkpointing = variable if args.gradient_checkpointing is None else args.gradient_checkpointing
    warmup, steps = fair_counts(args, variable)
    pin = args.pin_lengths if args.pin_lengths is not None else args.fair or not variable
    if args.liger and importlib.util.find_spec("liger_kernel") is None:
        raise SystemExit(
            "--liger: the liger_kernel package is not installed (pip install liger-kernel); without --liger TRL's "
            "kinds run without it, and each kind's record says so."
        )

    default_kinds = ["trl", "dapo", "dapo_padded", "dapo_trl_generation"]
    kinds = args.kinds or (["dapo", "dapo_padded", "trl"] if variable else default_kinds)

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device != "cuda" and not args.kinds:
        kinds = [kind for kind in kinds if kind != "dapo_trl_generation"]  # on the CPU DAPO takes TRL's path anyway
    on_cpu = [kind for kind in kinds if kind in VLLM_KINDS and device != "cuda"]
    if on_cpu:
        raise SystemExit(f"--kinds {' '.join(on_cpu)}: vLLM runs on CUDA only; on the CPU run trl_cb, trl or DAPO's.")
    if args.checkpoints is None and set(kinds) & set(VLLM_KINDS):
        args.checkpoints = str(Path(tempfile.gettempdir()) / "trl-dapo-checkpoints")  # vLLM loads a folder
    isolate = (args.isolate or bool(set(kinds) & set(VLLM_KINDS))) and not args.child
    setup = batch_setup(args, device, pin_lengths=pin, gradient_checkpointing=checkpointing)
    setup.update(
        vllm_memory=args.vllm_memory, vllm_sleep=args.vllm_sleep, liger=args.liger, fair=args.fair,
        attention=attention_implementation(args.attention, device),
    )  # fmt: skip
    dapo_settings = {"rollout_max_rows": args.max_rows or setup["rows_per_step"]}
    carry_settings = {"partial_rollout_max_in_flight": args.max_in_flight, "partial_rollout_max_age": args.max_age}
    if args.carry_max_rows:
        carry_settings["rollout_max_rows"] = args.carry_max_rows
    default_models = ["qwen2.5-0.5b-v2048"] if variable else ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    configs = {name: config_path(name) for name in (["tiny"] if args.tiny else args.models or default_models)}
    output = ResultFile(args.output or default_output("bench_step", args.tiny, device), device, setup)
    output.data["setup"].update(
        warmup=str(warmup),
        steps=str(steps),
        keep_cache=str(args.keep_cache),
        carry_max_rows=str(carry_settings.get("rollout_max_rows", dapo_settings["rollout_max_rows"])),
        **{k: str(v) for k, v in {**carry_settings, **dapo_settings}.items()},
    )
    results = output.data
    results["ceilings"] = ceilings = {} if isolate else hardware_ceilings(device)  # the parent leaves the device be
    results["models"] = previous_models(output.path) if args.skip_done else {}
    results["limits"] = {}

    def save() -> None:  # after every trainer and section, so a run stopped early keeps what it measured
        output.save()
        print("\n\n".join(filter(None, (table(results), tail_table(results)))), flush=True)

    if "comparison" in sections:
        for name, config in configs.items():
            if args.checkpoints:
                setup["checkpoint"] = str(Path(args.checkpoints) / name)
                save_checkpoint(name, Path(setup["checkpoint"]), device, args.timeout)
            comparison = results["models"].setdefault(name, {})
            if isolate:
                isolated_comparison(
                    name, kinds, args, setup["rows_per_step"], comparison, save, output.path, VLLM_KINDS
                )
                add_ratios(comparison)
                save()
                continue
            tokenizer = word_tokenizer(AutoConfig.from_pretrained(config).vocab_size)
            prefix = str(output.path.parent / f"profile_{name}") if args.profile else None
            step_comparison(
                config, tokenizer, setup, kinds, warmup, steps, comparison, save, prefix, args.lora,
                dapo_settings, carry_settings, args.keep_cache,
            )  # fmt: skip
            results["limits"][name] = limits(config, setup, comparison, ceilings)
            save()
    if "variants" in sections:
        first = next(iter(configs.values()))
        tokenizer = word_tokenizer(AutoConfig.from_pretrained(first).vocab_size)
        results["variants"] = engine_variants(first, tokenizer, setup, warmup["dapo"], steps["dapo"])
        save()
    print(f"wrote {output.path}")


if __name__ == "__main__":
    main()
