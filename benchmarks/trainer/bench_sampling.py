"""What dynamic sampling costs: DAPO steps with a chosen share of uninformative prompt groups, candidate rounds with
fixed vs adaptive (`dynamic_sampling_oversample="auto"`) sizing and surplus reuse on and off, and streaming
(`dynamic_sampling_mode="stream"`) with rows in flight carried, finished or dropped when the batch is full.

    python3 -m benchmarks.trainer.bench_sampling --models qwen2.5-0.5b  # CUDA: random-init Qwen2.5-0.5B architecture
    python3 -m benchmarks.trainer.bench_sampling --variable-lengths --max-surplus-age 2 \\
        --sampling-modes auto:True stream:carry stream:finish     # CUDA: lengths up to 4,096, stream vs rounds
    python3 -m benchmarks.trainer.bench_sampling --tiny                 # CPU smoke run on the tiny local model

A mode is `OVERSAMPLE:SURPLUS` (rounds: `dynamic_sampling_oversample`, `dynamic_sampling_keep_surplus`) or
`stream:IN_FLIGHT` (`dynamic_sampling_in_flight`: finish, drop or carry; surplus kept). Every run generates with the
paged engine. For every (share, mode) pair: rounds per step, generated groups, sampling efficiency, time per trained
group, the share of the generated tokens (filtered groups excluded) never trained and kept as surplus (carried rows
included), and the share of decode slot-steps busy. Prints a table last and writes
`benchmarks/results/bench_sampling_<device>.json` after every run.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from benchmarks.core.result_file import ResultFile, default_output
from benchmarks.core.workload import config_path, prompts, random_model, uninformative_reward, word_tokenizer
from benchmarks.trainer.trainer_run import add_batch_arguments, batch_setup, run_trainer


def mode_settings(mode: str) -> dict:
    """DAPOConfig fields of a mode string (see the module docstring)."""
    first, second = mode.split(":")
    if first == "stream":
        return dict(dynamic_sampling_mode="stream", dynamic_sampling_in_flight=second)
    return dict(dynamic_sampling_oversample=first, dynamic_sampling_keep_surplus=second == "True")


def sampling_cost(
    config, setup, fraction: float, mode: str, max_rows: int, warmup: int, steps: int, surplus_age: int | None
) -> dict:
    """One DAPO run with `fraction` of the groups uninformative (constant reward, filtered), unbounded rounds;
    `surplus_age`: `max_surplus_age` (None: DAPOConfig's default, one generation batch)."""
    tokenizer = word_tokenizer(AutoConfig.from_pretrained(config).vocab_size)
    dataset = prompts(64 * setup["rows_per_step"], vocab_size=len(tokenizer))
    model = random_model(config, setup["device"], setup["dtype"])
    result = run_trainer(
        "dapo", model, tokenizer, dataset, setup, warmup, steps, reward=uninformative_reward(fraction),
        dynamic_sampling=True, max_num_gen_batches=0, rollout_engine="paged", rollout_max_rows=max_rows,
        max_surplus_age=surplus_age, **mode_settings(mode),
    )  # fmt: skip
    metrics = result["metrics"]

    def mean(name):
        values = [m[name] for m in metrics if name in m]
        return sum(values) / len(values) if values else float("nan")

    def share(name):  # of the tokens of the measured steps' groups that were not filtered
        kept = sum(m["dapo/generated_tokens"] - m["dapo/filtered_tokens"] for m in metrics)
        return sum(m[name] for m in metrics) / max(kept, 1)

    trained = setup["rows_per_step"] // setup["generations"]  # qualified groups each step trains on
    return {
        "uninformative": fraction,
        "mode": mode,
        "rounds_per_step": mean("dapo/gen_batches"),
        "generated_groups_per_step": mean("dapo/generated_groups"),
        "sampling_efficiency": mean("dapo/sampling_efficiency"),
        "step_s": result["step_s"],
        # generation, scoring and bookkeeping of the generation batch (in stream mode they overlap inside one call)
        "generate_and_score_s": result["generation_s"]
        + result["logprob_pass_s"]
        + result["rest_split_s"]["score_and_bookkeeping"],
        "qualified_groups_per_step": mean("dapo/qualified_groups"),
        "time_per_trained_group_s": result["step_s"] / trained,
        "generated_tokens_per_step": mean("dapo/generated_tokens"),
        "prefill_tokens_per_step": mean("dapo/prefill_tokens"),
        "untrained_token_share": share("dapo/untrained_tokens"),
        "surplus_token_share": share("dapo/surplus_tokens"),
        # busy over all decode slot-steps of the measured steps (each step's share weighted by its slot-steps is the
        # mean of the per-step shares only when the steps are alike; the JSON keeps the per-step values)
        "slot_occupancy": mean("dapo/slot_occupancy"),
        "slot_occupancy_per_step": [m.get("dapo/slot_occupancy") for m in metrics],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| model | uninformative | mode | rounds/step | groups/step | efficiency | step s | s/trained group | "
        "untrained tokens | surplus tokens | slots busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['uninformative']:.0%} | {r['mode']} | {r['rounds_per_step']:.2f} | "
            f"{r['generated_groups_per_step']:.1f} | {r['sampling_efficiency']:.2f} | {r['step_s']:.3f} | "
            f"{r['time_per_trained_group_s']:.3f} | {r['untrained_token_share']:.1%} | "
            f"{r['surplus_token_share']:.1%} | {r['slot_occupancy']:.1%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(parser, new_tokens=None)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--sampling-modes", nargs="*", default=["1.0:False", "1.0:True", "auto:True", "auto:False"],
        help="OVERSAMPLE:SURPLUS (rounds) or stream:IN_FLIGHT (finish, drop or carry)",
    )  # fmt: skip
    parser.add_argument("--sampling-fractions", nargs="*", type=float, default=[0.5, 0.8])
    parser.add_argument(
        "--variable-lengths", action="store_true",
        help="no min_new_tokens pin, 2,048-token vocabulary (default model qwen2.5-0.5b-v2048), --new-tokens 4096, "
        "gradient checkpointing",
    )  # fmt: skip
    parser.add_argument("--max-rows", type=int, default=1024, help="the paged engine's decode slots")
    parser.add_argument(
        "--max-surplus-age",
        type=int,
        help="optimizer steps surplus groups live (default: one batch's; carried groups are never aged out)",
    )
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (4096 if args.variable_lengths else 256)

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    setup = batch_setup(
        args, device, pin_lengths=not args.variable_lengths, gradient_checkpointing=args.variable_lengths
    )
    output = ResultFile(args.output or default_output("bench_sampling", args.tiny, device), device, setup)
    output.data["setup"].update(max_rows=str(args.max_rows), max_surplus_age=str(args.max_surplus_age))
    rows = output.data["sampling"] = []
    default_model = "qwen2.5-0.5b-v2048" if args.variable_lengths else "qwen2.5-0.5b"
    for name in ["tiny"] if args.tiny else args.models or [default_model]:
        config = config_path(name)
        for fraction in args.sampling_fractions:
            for mode in args.sampling_modes:
                run = sampling_cost(
                    config, setup, fraction, mode, args.max_rows, args.warmup, args.steps, args.max_surplus_age
                )
                rows.append({"model": name, **run})
                output.save()
                print(table(rows), flush=True)
    print(f"wrote {output.path}")


if __name__ == "__main__":
    main()
