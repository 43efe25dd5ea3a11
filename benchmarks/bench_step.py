"""DAPOTrainer against TRL's GRPOTrainer, step for step, on one device; DAPO with gradient checkpointing, with LoRA and
with the old policy recomputed; training MFU and decode bandwidth use against the measured hardware ceilings.

    python3 -m benchmarks.bench_step                       # CUDA: Qwen2.5-0.5B and 1.5B architectures, random init
    python3 -m benchmarks.bench_step --variable-lengths    # CUDA: 0.5B, 2,048-token vocabulary, up to 4,096 tokens
    python3 -m benchmarks.bench_step --tiny                # CPU smoke run on the tiny local model
    python3 -m benchmarks.bench_step --variable-lengths --kinds dapo dapo_partial dapo_stream_carry  # partial rollouts
    python3 -m benchmarks.bench_step --variable-lengths --kinds dapo dapo_partial dapo_partial_kept --carry-max-rows 256
        # partial rollouts re-prefilling their carried rows and keeping their KV, in a slot pool twice the batch's
    python3 -m benchmarks.bench_step --variable-lengths --kinds dapo dapo_fp8 dapo_fp8_partial  # FP8 rollouts

Both trainers get the same random-init model, prompts, batch geometry and seed. By default generation lengths are
pinned with `min_new_tokens = max_completion_length`, so both sides decode the same number of tokens. With
`--variable-lengths` nothing is pinned and the vocabulary has 2,048 tokens, so lengths are geometric with mean about
2,000 up to the maximum (4,096): TRL's `generate` decodes every row until the longest ends, DAPO's engine what it
decodes. Tokens/s is the tokens generated over generation time (the completions' lengths, or where trl-dapo's engine
generated, its own count). Where the engine generated, a second table gives its calls per step: decode steps, the
tail's share of them (steps with under a quarter of the engine's `--max-rows` slots busy), and the rows carried
across steps by partial rollouts (left in flight at the end of a step, resumed with their prompt and tokens prefilled
again, or from their kept KV), with the share of trained tokens an earlier step's weights sampled and the trained
groups' age. Prints the tables last and writes everything to `benchmarks/results/<name>.json` after every trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig

from benchmarks.result_file import ResultFile, default_output
from benchmarks.timing import hardware_ceilings
from benchmarks.trainer_run import add_batch_arguments, batch_setup, run_trainer
from benchmarks.workload import (
    config_path,
    decode_weight_bytes,
    kv_bytes_per_token,
    prompts,
    random_model,
    word_tokenizer,
)
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
COMPARISON_KINDS = {
    "trl": {},
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
RATIO_KINDS = ("dapo_partial", "dapo_partial_kept", "dapo_stream_carry", *FP8_KINDS)  # against `dapo`, same batch


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
        model = random_model(config, setup["device"], setup["dtype"])
        profile = Path(f"{profile_prefix}_{kind}.txt") if profile_prefix else None
        trainer = "trl" if kind == "trl" else "dapo"
        settings = {} if kind == "trl" else {**(dapo_settings or {}), **COMPARISON_KINDS[kind]}
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
    keys = ("step_s", "generation_s", "train_s", "train_median_s", "generation_tokens_per_s")
    if {"trl", "dapo"} <= set(out):
        out["ratio"] = {key: out["dapo"][key] / out["trl"][key] for key in keys if out["trl"][key]}
        out["dapo_logprob_gap_max"] = out["dapo"]["logprob_gap_max"]
    if {"trl", "dapo_trl_generation"} <= set(out):  # DAPO's loss and bookkeeping against TRL's, same generation
        same = out["dapo_trl_generation"]
        out["ratio_same_generation"] = {key: same[key] / out["trl"][key] for key in ("train_s", "train_median_s")}
    if {"dapo", "dapo_padded"} <= set(out):  # padding-free against padded training passes, same everything else
        keys = ("step_s", "train_s", "train_median_s", "peak_memory_gib")
        out["ratio_padding_free"] = {
            key: out["dapo"][key] / out["dapo_padded"][key] for key in keys if out["dapo_padded"][key]
        }
    for kind in [kind for kind in RATIO_KINDS if {kind, "dapo"} <= set(out)]:  # against plain DAPO
        keys = ("step_s", "generation_s", "train_s", "train_median_s")
        out[f"ratio_{kind}"] = {key: out[kind][key] / out["dapo"][key] for key in keys if out["dapo"][key]}


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


def table(results: dict) -> str:
    lines = [
        "| model | trainer | step s | generation s | logprob pass s | train s | completion tok/step | gen tok/s | "
        "trained real / forward tok/step | train real tok/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, comparison in results["models"].items():
        for kind in [kind for kind in COMPARISON_KINDS if kind in comparison]:
            r = comparison[kind]
            memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
            lines.append(
                f"| {name} | {kind} | {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['logprob_pass_s']:.3f} | "
                f"{r['train_s']:.3f} | {r['completion_tokens_per_step']:.0f} | {r['generation_tokens_per_s']:.0f} | "
                f"{r['trained_real_tokens_per_step']:.0f} / {r['trained_forward_tokens_per_step']:.0f} | "
                f"{r['training_real_tokens_per_s']:.0f} | {memory} |"
            )
        ratio = comparison.get("ratio")
        if ratio:
            lines.append(
                f"| {name} | DAPO/TRL | {ratio.get('step_s', float('nan')):.3f} | {ratio.get('generation_s', float('nan')):.3f} "
                f"| | {ratio.get('train_s', float('nan')):.3f} | | {ratio.get('generation_tokens_per_s', float('nan')):.1f}x "
                "| | | |"
            )
        ratio = comparison.get("ratio_padding_free")
        if ratio:
            lines.append(
                f"| {name} | padding-free/padded | {ratio['step_s']:.3f} | | | {ratio['train_s']:.3f} | | | | | "
                f"{ratio.get('peak_memory_gib', float('nan')):.3f} |"
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


def main() -> None:
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
        "--variable-lengths)",
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
    args = parser.parse_args()
    variable = args.variable_lengths
    sections = args.sections or (["comparison"] if variable else ["comparison", "variants"])
    args.new_tokens = args.new_tokens or (4096 if variable else 256)
    checkpointing = variable if args.gradient_checkpointing is None else args.gradient_checkpointing
    warmup = per_kind(args.warmup or [], default=1)
    steps = per_kind(args.steps or [], default=1 if variable else 3)

    default_kinds = [k for k in COMPARISON_KINDS if k not in CARRYING_KINDS + FP8_KINDS]
    kinds = args.kinds or (["dapo", "dapo_padded", "trl"] if variable else default_kinds)

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device != "cuda" and not args.kinds:
        kinds = [kind for kind in kinds if kind != "dapo_trl_generation"]  # on the CPU DAPO takes TRL's path anyway
    setup = batch_setup(args, device, pin_lengths=not variable, gradient_checkpointing=checkpointing)
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
    results["ceilings"] = ceilings = hardware_ceilings(device)
    results["models"], results["limits"] = {}, {}

    def save() -> None:  # after every trainer and section, so a run stopped early keeps what it measured
        output.save()
        print("\n\n".join(filter(None, (table(results), tail_table(results)))), flush=True)

    if "comparison" in sections:
        for name, config in configs.items():
            tokenizer = word_tokenizer(AutoConfig.from_pretrained(config).vocab_size)
            prefix = str(output.path.parent / f"profile_{name}") if args.profile else None
            comparison = results["models"][name] = {}
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
