"""Why a launch config's first rollout differs from single_gpu's: what the paged engine read at its first generation.

    # CUDA: single_gpu, zero3, single_gpu again
    python3 -m benchmarks.multi_gpu.check_launch_config_rollout
    # the same with the LoRA arguments
    python3 -m benchmarks.multi_gpu.check_launch_config_rollout --lora
    # CPU: the engine in bf16 as on CUDA
    python3 -m benchmarks.multi_gpu.check_launch_config_rollout --engine-dtype bfloat16

`tests/test_launch_configs_cuda.py` trains the math recipe from one warm-started tiny model under each accelerate
config; before any update every config's engine should sample the same completions. This runs the recipe with the
test's arguments under each `--configs` entry (one process each, all at once, as the test does) until the engine's
first generation (`launch_config_rollout_worker.py`), then compares bitwise with the first run: the engine's bf16
weight snapshot, the rotary buffers and the cos / sin tables it decoded with, the state of the generator the sampling
noise is drawn from, the prompts, the sampled tokens and their logprobs. A repeated config measures run-to-run
determinism: equal inputs with unequal outputs in it mean the engine's kernels are not deterministic.

Reading the table (each run against the first): a snapshot tensor that differs names the weight the training set-up
loaded or gathered differently; a rotary difference is the RoPE buffers' computation (zero.Init builds them on the
accelerator); an RNG difference means something drew from the generator before the first generation; equal inputs
with unequal logprobs, the engine's kernels (compiled code, CUDA graphs, the Triton attention kernel) computing
differently for the same inputs. Writes `benchmarks/results/check_launch_config_rollout_<device>.json` (or
`--output`); prints a table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.core.result_file import ResultFile, default_output, finish
from benchmarks.multi_gpu.bench_multi_gpu import free_port

ROOT = Path(__file__).parents[2]
WORKER = Path(__file__).with_name("launch_config_rollout_worker.py")
LORA = ("--use_peft", "--lora_r", "8", "--lora_alpha", "16")


def build_warm_model(path: Path, steps: int) -> str:
    """The test's warm start: the tiny model after `steps` supervised steps on the recipe's 25 problems."""
    from trl_dapo.data import arithmetic_dataset
    from trl_dapo.tiny_model import build_tiny_model, supervised_warm_start

    build_tiny_model(path)
    train = arithmetic_dataset(25, 0, 4)["train"]
    supervised_warm_start(path, train["prompt"], train["answer"], steps=steps)
    return str(path)


def launch(config: str, port: int, model: str, folder: Path, name: str, args) -> subprocess.Popen:
    """The test's command for `config` (one step's arguments), through the worker, which stops at the first
    generation and saves it to `<folder>/<name>.pt`."""
    cuda = torch.cuda.is_available()
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"), "--num_processes", "1",
        "--main_process_port", str(port), str(WORKER), str(folder / f"{name}.pt"), args.engine_dtype,
        str(ROOT / "recipes/dapo_math.py"),
        "--config", str(ROOT / "recipes/configs/tiny_cpu.yaml"), "--model_name_or_path", model,
        "--output_dir", str(folder / name), "--use_cpu", str(not cuda).lower(), "--bf16", "true", "--max_steps", "1",
        "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
        "--rollout_engine", "paged", "--padding_free", "true", "--rollout_memory_fraction", "0.1",
        "--generation_batch_size", "64", "--summary_window", "1", *(LORA if args.lora else ()),
    ]  # fmt: skip
    log = (folder / f"{name}.log").open("w")
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def tensor_difference(value: torch.Tensor, reference: torch.Tensor) -> str | None:
    """None when bitwise equal (dtype and shape included), else how they differ."""
    if value.dtype != reference.dtype or value.shape != reference.shape:
        return f"{value.dtype}{tuple(value.shape)} vs {reference.dtype}{tuple(reference.shape)}"
    if torch.equal(value, reference):
        return None
    differ = value != reference
    gap = (value.double() - reference.double()).abs().max().item()
    return f"{int(differ.sum())}/{value.numel()} elements differ, max |diff| {gap:.3g}"


def common_prefix(tokens: list[int], expected: list[int]) -> int:
    """How many leading tokens two completions share."""
    shorter = min(len(tokens), len(expected))
    return next((i for i in range(shorter) if tokens[i] != expected[i]), shorter)


def first_divergence(run: dict, reference: dict) -> str | None:
    """Where the sampled tokens first differ (row, position, the two tokens or lengths), or None."""
    for row, (tokens, expected) in enumerate(zip(run["completions"], reference["completions"], strict=True)):
        same = common_prefix(tokens, expected)
        if same < min(len(tokens), len(expected)):
            return f"row {row} position {same}: {tokens[same]} vs {expected[same]}"
        if len(tokens) != len(expected):
            return f"row {row}: {len(tokens)} vs {len(expected)} tokens"
    return None


def logprob_difference(run: dict, reference: dict) -> str | None:
    """How the logprobs of the tokens both runs sampled alike (each row's common prefix) differ, or None."""
    first, gap, count = None, 0.0, 0
    for row, (tokens, expected) in enumerate(zip(run["completions"], reference["completions"], strict=True)):
        for position in range(common_prefix(tokens, expected)):
            value, wanted = run["logprobs"][row, position], reference["logprobs"][row, position]
            if not torch.equal(value, wanted):
                count += 1
                gap = max(gap, (value - wanted).abs().item())
                first = first or f"row {row} position {position}"
    return None if count == 0 else f"{count} tokens differ (first: {first}), max |diff| {gap:.3g}"


def compare(run: dict, reference: dict) -> dict[str, object]:
    snapshot = {
        name: difference
        for name, tensor in run["snapshot"].items()
        if (difference := tensor_difference(tensor, reference["snapshot"][name])) is not None
    }
    rotary = {
        name: difference
        for name, tensor in run["rotary_buffers"].items()
        if (difference := tensor_difference(tensor, reference["rotary_buffers"][name])) is not None
    }
    for table in ("cos", "sin"):
        if (difference := tensor_difference(run[table], reference[table])) is not None:
            rotary[table] = difference
    tokens = sum(map(len, run["completions"]))
    return {
        "snapshot": snapshot or None,
        "rotary": rotary or None,
        "rng_state": tensor_difference(run["rng_state"], reference["rng_state"]),
        "prompts": None if run["prompt_ids"] == reference["prompt_ids"] else "the prompts differ",
        "tokens": first_divergence(run, reference),
        "logprobs": logprob_difference(run, reference),
        "generated_tokens": tokens,
        "logprob_mean": sum(run["logprobs"][row, : len(c)].sum().item() for row, c in enumerate(run["completions"]))
        / tokens,
    }


def table(results: dict[str, dict]) -> str:
    columns = ("snapshot", "rotary", "rng_state", "prompts", "tokens", "logprobs")
    lines = [
        "| run | " + " | ".join(columns) + " | generated tokens | logprob mean |",
        "|---|" + "---|" * (len(columns) + 2),
    ]
    details = []
    for name, result in results.items():
        cells = ["equal" if result[c] is None else "DIFFERS" for c in columns]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {result['generated_tokens']} | {result['logprob_mean']:.6f} |"
        )
        details += [f"{name} {c}: {result[c]}" for c in columns if result[c] is not None]
    return "\n".join([*lines, "", *details])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["single_gpu", "zero3", "single_gpu"])
    parser.add_argument("--engine-dtype", choices=["default", "bfloat16"], default="default")
    parser.add_argument("--lora", action="store_true", help="the test's LoRA arguments")
    parser.add_argument("--warm-start-steps", type=int, default=170)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    output = args.output or default_output("check_launch_config_rollout", False, device)
    results = ResultFile(output, device, vars(args))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model = build_warm_model(folder / "warm-model", args.warm_start_steps)
        names = [f"{config}#{index}" for index, config in enumerate(args.configs)]
        processes = {
            name: launch(config, free_port(), model, folder, name, args)
            for name, config in zip(names, args.configs, strict=True)
        }
        failures = 0
        for name, process in processes.items():
            if process.wait(timeout=600) != 0 or not (folder / f"{name}.pt").exists():
                print(f"{name} failed:\n" + (folder / f"{name}.log").read_text()[-4000:])
                failures += 1
        if failures:
            raise SystemExit(f"{failures} runs failed")
        dumps = {name: torch.load(folder / f"{name}.pt", weights_only=False) for name in names}
    reference = dumps[names[0]]
    compared = {name: compare(dump, reference) for name, dump in dumps.items()}
    results.data["runs"] = compared
    results.data["engine_dtype"] = reference["engine_dtype"]
    results.save()
    finish(table(compared), output, 0, "runs")


if __name__ == "__main__":
    main()
