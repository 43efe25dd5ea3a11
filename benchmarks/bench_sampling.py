"""What dynamic sampling costs: DAPO steps with a chosen share of uninformative prompt groups, fixed vs adaptive
(`dynamic_sampling_oversample="auto"`) candidate sizing, surplus reuse on and off.

    python benchmarks/bench_sampling.py --models qwen2.5-0.5b     # CUDA: random-init Qwen2.5-0.5B architecture
    python benchmarks/bench_sampling.py --tiny                    # CPU smoke run on the tiny local model

Rounds per step, generated groups, sampling efficiency and time per trained group for every (share, mode) pair, at
the step benchmark's batch geometry with pinned lengths. Prints a table last and writes
`benchmarks/results/bench_sampling_<device>.json` after every run.
"""

from __future__ import annotations

import argparse

import torch
from result_file import ResultFile, default_output
from trainer_run import add_batch_arguments, batch_setup, run_trainer
from transformers import AutoConfig
from workload import config_path, prompts, random_model, uninformative_reward, word_tokenizer


def sampling_cost(config, setup, fraction: float, oversample: str, surplus: bool, warmup: int, steps: int) -> dict:
    """One DAPO run with `fraction` of the groups uninformative (constant reward, filtered), unbounded rounds."""
    tokenizer = word_tokenizer(AutoConfig.from_pretrained(config).vocab_size)
    dataset = prompts(64 * setup["rows_per_step"], vocab_size=len(tokenizer))
    model = random_model(config, setup["device"], setup["dtype"])
    result = run_trainer(
        "dapo", model, tokenizer, dataset, setup, warmup, steps, reward=uninformative_reward(fraction),
        dynamic_sampling=True, max_num_gen_batches=0, dynamic_sampling_oversample=oversample,
        dynamic_sampling_keep_surplus=surplus,
    )  # fmt: skip
    metrics = result["metrics"]

    def mean(name):
        values = [m[name] for m in metrics if name in m]
        return sum(values) / len(values) if values else float("nan")

    trained = setup["rows_per_step"] // setup["generations"]  # qualified groups each step trains on
    return {
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


def table(rows: list[dict]) -> str:
    lines = [
        "| model | uninformative | oversample | surplus | rounds/step | groups/step | efficiency | step s | s/trained group |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['uninformative']:.0%} | {r['oversample']} | {r['keep_surplus']} | {r['rounds_per_step']:.2f} | "
            f"{r['generated_groups_per_step']:.1f} | {r['sampling_efficiency']:.2f} | {r['step_s']:.3f} | "
            f"{r['time_per_trained_group_s']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--sampling-modes", nargs="*", default=["1.0:False", "1.0:True", "auto:True", "auto:False"],
        help="dynamic_sampling_oversample:dynamic_sampling_keep_surplus pairs",
    )  # fmt: skip
    parser.add_argument("--sampling-fractions", nargs="*", type=float, default=[0.5, 0.8])
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    setup = batch_setup(args, device)
    output = ResultFile(args.output or default_output("bench_sampling", args.tiny, device), device, setup)
    rows = output.data["sampling"] = []
    for name in ["tiny"] if args.tiny else args.models or ["qwen2.5-0.5b"]:
        config = config_path(name)
        for fraction in args.sampling_fractions:
            for mode in args.sampling_modes:
                oversample, surplus = mode.split(":")
                run = sampling_cost(config, setup, fraction, oversample, surplus == "True", args.warmup, args.steps)
                rows.append({"model": name, **run})
                output.save()
                print(table(rows), flush=True)
    print(f"wrote {output.path}")


if __name__ == "__main__":
    main()
