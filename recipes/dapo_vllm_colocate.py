"""DAPO with vLLM colocated in the trainer's process: `DAPOTrainer(use_vllm=True, vllm_mode="colocate")` on one GPU.

    pip install -e ".[vllm]"    # vLLM 0.26.0 and what it pins (torch 2.11.0): docs/vllm.md
    python recipes/dapo_vllm_colocate.py --model "$(python -m trl_dapo.smollm2)" --output_dir outputs/vllm-colocate

`--model` is a model folder or hub id vLLM reads, or a `.gguf` file: vLLM 0.26 reads no GGUF without a plugin, so the
file is loaded dense (`trl_dapo.gguf`) and saved as a bf16 folder under `output_dir` first. The model trains in
float32 under bf16 autocast; vLLM serves the bf16 folder and takes the trained weights before each generation. The
problems are one-digit additions with a one-shot prompt (`add1`, `trl_dapo.data.tasks`), which SmolLM2-135M-Instruct
gets right some of the time, scored by the DAPO math reward with the whole recipe (dynamic sampling, Clip-Higher, the
soft overlong penalty). Without vLLM or a CUDA GPU it stops before loading anything, saying which is missing.
`recipes/dapo_math.py` takes the same two fields (`--use_vllm true --vllm_mode colocate`) for a model folder in bf16.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from trl_dapo.trainer.collection.vllm_path import VLLM_INSTALL


def missing_for_colocate() -> list[str]:
    """What this machine lacks for vLLM's colocate mode: vLLM itself, a CUDA GPU."""
    import torch

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append(f"vLLM is not installed: `{VLLM_INSTALL}` installs the tested version (docs/vllm.md)")
    if not torch.cuda.is_available():
        missing.append(f"no CUDA GPU is visible to torch {torch.__version__}: vLLM runs in this process on one")
    return missing


def model_folder(model: str, output_dir: Path) -> str:
    """A folder or hub id vLLM reads: `model` itself, or a `.gguf` file saved dense in bf16 under `output_dir`."""
    if not model.endswith(".gguf"):
        return model
    import torch

    from trl_dapo.gguf import load_gguf_causal_lm, load_gguf_tokenizer

    path, folder = Path(model), output_dir / "model-bf16"
    load_gguf_causal_lm(str(path.parent), path.name, dtype=torch.bfloat16).save_pretrained(folder)
    load_gguf_tokenizer(str(path.parent), path.name).save_pretrained(folder)
    return str(folder)


def main(args: argparse.Namespace) -> None:
    missing = missing_for_colocate()
    if missing:
        raise SystemExit("dapo_vllm_colocate: cannot run here: " + "; ".join(missing) + ".")
    from trl_dapo import DAPOConfig, DAPOTrainer
    from trl_dapo.data.tasks import task_splits
    from trl_dapo.rewards.math import dapo_math_reward

    output_dir = Path(args.output_dir)
    config = DAPOConfig(
        output_dir=str(output_dir / "run"), use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization, model_init_kwargs={"dtype": "float32"},
        num_generations=8, per_device_train_batch_size=32, max_completion_length=64, overlong_buffer_len=16,
        max_num_gen_batches=4, learning_rate=5e-6, max_steps=args.max_steps, seed=0, logging_steps=1,
        report_to=[], save_strategy="no",
    )  # fmt: skip
    train = task_splits("add1", "oneshot", num_train=64, num_test=16)["train"]
    trainer = DAPOTrainer(
        model=model_folder(args.model, output_dir), reward_funcs=dapo_math_reward, args=config, train_dataset=train
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            reward, accuracy = entry.get("reward", float("nan")), entry.get("math/accuracy", float("nan"))
            print(f"step {entry['step']}: loss {entry['loss']:.4f}, reward {reward:.3f}, accuracy {accuracy:.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder or hub id vLLM reads, or a .gguf file")
    parser.add_argument("--output_dir", default="outputs/vllm-colocate")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
