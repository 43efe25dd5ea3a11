"""The math recipe under each of its accelerate configs on one GPU (skipped without CUDA): `single_gpu`, `ddp`,
`zero2`, `zero3` and `fsdp2` (one process each), and LoRA under `single_gpu`, `zero3` and `fsdp2`, with dynamic
sampling, the paged rollout engine and padding-free passes on, from the same warm-started tiny model and seed.

Every run must finish with finite losses, and its first three steps must log the groups, the generated tokens, the
loss and the gradient norm of `single_gpu` (LoRA: of LoRA's under `single_gpu`), the last two within bf16's
tolerance. Before the first update the engine samples from a bf16 copy of the weights, the same copy whether
DeepSpeed keeps bf16 parameters beside float32 masters or DDP / FSDP2 keep float32 ones under bf16 autocast. What
differs is the training forward: DeepSpeed multiplies by bf16 weights, autocast by float32 weights rounded per
product, so each logprob may differ by a few bf16 rounding steps (2^-8 relative each). The loss, a token-mean of
ratio x advantage with ratios within a few percent of 1, then agrees to `LOSS_TOLERANCE` absolute; the gradient
norm, a sum of squares over every weight, to `GRAD_NORM_TOLERANCE` relative (8 rounding steps of 2^-8). AdamW runs
with `ADAM_EPSILON`: with the default 1e-8 its first steps move every weight by about the learning rate along the
sign of its gradient, so an entry near zero that rounds to the other sign moves its weight the other way and the
next steps sample other completions; a larger epsilon scales small gradients down instead.

ZeRO-3 builds the model under DeepSpeed's `zero.Init`, which casts the buffers a module creates to bf16: the rotary
frequencies were bf16 there (cos / sin off by up to 0.36), and before any update ZeRO-3's engine sampled 319 tokens
where `single_gpu`'s sampled 320 (an H100, 2026-12-06, `benchmarks/multi_gpu/check_launch_config_rollout.py`). The
trainer rebuilds them in float32 (`trl_dapo/models.py`), so ZeRO-3 is held to the same comparison as every config.

The runs share the GPU (each process's engine takes a tenth of its memory) and run at once. With
`TRL_DAPO_TEST_REPORT=<folder>` the logged steps of every run are written there (`launch_configs.json`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).parent.parent
STEPS = 3
LOSS_TOLERANCE = 2**-7
GRAD_NORM_TOLERANCE = 2**-5
ADAM_EPSILON = "1e-2"  # early Adam steps scale the gradient instead of following its sign (see the docstring)
LORA = ("--use_peft", "--lora_r", "8", "--lora_alpha", "16")
RUNS = {
    "single_gpu": ("single_gpu", ()),
    "ddp": ("ddp", ()),
    "zero2": ("zero2", ()),
    "zero3": ("zero3", ()),
    "fsdp2": ("fsdp2", ()),
    "single_gpu+lora": ("single_gpu", LORA),
    "zero3+lora": ("zero3", LORA),
    "fsdp2+lora": ("fsdp2", LORA),
}


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory) -> str:
    """The recipe's offline model (the demo's warm start), built once so every config starts from the same weights."""
    from trl_dapo.data import arithmetic_dataset
    from trl_dapo.tiny_model import build_tiny_model, supervised_warm_start

    path = tmp_path_factory.mktemp("warm-tiny-model")
    build_tiny_model(path)
    train = arithmetic_dataset(25, 0, 4)["train"]
    supervised_warm_start(path, train["prompt"], train["answer"], steps=170)
    return str(path)


@pytest.fixture(scope="module")
def runs(warm_model, tmp_path_factory) -> dict[str, dict]:
    """Every run launched at once; each one's log history (its checkpoint after the last step) and stderr."""
    folder = tmp_path_factory.mktemp("launch-configs")
    launched = {}
    for name, (config, extra) in RUNS.items():
        if config.startswith("zero") and not _deepspeed_installed():
            continue
        output = folder / name
        command = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(ROOT / f"recipes/accelerate/{config}.yaml"), "--num_processes", "1",
            "--main_process_port", str(free_port()), str(ROOT / "recipes/dapo_math.py"),
            "--config", str(ROOT / "recipes/configs/tiny_cpu.yaml"), "--model_name_or_path", warm_model,
            "--output_dir", str(output), "--use_cpu", "false", "--bf16", "true", "--max_steps", str(STEPS),
            "--logging_steps", "1", "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(STEPS),
            "--rollout_engine", "paged", "--padding_free", "true", "--rollout_memory_fraction", "0.1",
            "--generation_batch_size", "64", "--summary_window", "1", "--adam_epsilon", ADAM_EPSILON, *extra,
        ]  # fmt: skip
        log = (folder / f"{name}.log").open("w")
        launched[name] = (subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), output, log)
    results = {}
    for name, (process, output, log) in launched.items():
        process.wait(timeout=900)
        log.close()
        text = (folder / f"{name}.log").read_text()
        state = output / f"checkpoint-{STEPS}" / "trainer_state.json"
        history = json.loads(state.read_text())["log_history"] if state.exists() else []
        results[name] = {"returncode": process.returncode, "log": text, "steps": [h for h in history if "loss" in h]}
    if os.environ.get("TRL_DAPO_TEST_REPORT"):  # the logged steps, for the record of a GPU run
        steps = {name: result["steps"] for name, result in results.items()}
        Path(os.environ["TRL_DAPO_TEST_REPORT"], "launch_configs.json").write_text(json.dumps(steps, indent=1))
    return results


def _deepspeed_installed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(RUNS))
def test_each_launch_config_trains_with_dynamic_sampling_the_engine_and_packed_passes(runs, name):
    if name not in runs:
        pytest.skip("DeepSpeed is not installed")
    run = runs[name]
    assert run["returncode"] == 0, run["log"][-4000:]
    assert "Training passes are padded" not in run["log"], "padding-free passes fell back to padded"
    assert len(run["steps"]) == STEPS
    for step in run["steps"]:
        assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
        assert step["dapo/gen_batches"] >= 1 and step["dapo/slot_occupancy"] > 0  # dynamic sampling, the engine


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name in RUNS if not name.startswith("single_gpu")])
def test_each_launch_config_matches_single_gpu_on_the_first_steps(runs, name):
    if name not in runs:
        pytest.skip("DeepSpeed is not installed")
    reference = runs["single_gpu+lora" if name.endswith("+lora") else "single_gpu"]["steps"]
    steps = runs[name]["steps"]
    assert len(steps) == len(reference) == STEPS
    for index, (step, expected) in enumerate(zip(steps, reference, strict=True), start=1):
        for metric in ("dapo/qualified_groups", "dapo/filtered_groups", "dapo/generated_tokens"):
            assert step[metric] == expected[metric], (index, metric)  # the same generations and groups
        assert step["loss"] == pytest.approx(expected["loss"], abs=LOSS_TOLERANCE), index
        assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=GRAD_NORM_TOLERANCE), index
