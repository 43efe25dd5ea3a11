"""Save a random-init model of one of `benchmarks/configs` with its word tokenizer, for runs that load a model by
path (the math recipe's `--model_name_or_path`, vLLM) on a machine without the hub.

    python3 -m benchmarks.core.save_random_model --model qwen2.5-7b-v2048 --output /tmp/qwen2.5-7b-v2048
    python3 -m benchmarks.core.save_random_model --model qwen2.5-7b --output /tmp/qwen2.5-7b --dtype bfloat16 \\
        --device cuda

`--dtype bfloat16` halves the folder (Qwen2.5-7B: about 15 GB instead of 30); `--device cuda` draws the weights on
the GPU, seconds where a 7B model takes minutes on the host (another generator: other weights than the host's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.core.workload import config_path, word_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_random_model(name: str, output: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      seed: int = 0) -> None:  # fmt: skip
    """Random-init `name` (a config of `benchmarks/configs`, or "tiny") and its word tokenizer, saved to `output`."""
    config = AutoConfig.from_pretrained(config_path(name))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(output)
    word_tokenizer(config.vocab_size).save_pretrained(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a config name in benchmarks/configs")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the saved weights' precision")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: fast for large models)")
    args = parser.parse_args()
    save_random_model(args.model, args.output, DTYPES[args.dtype], args.device, args.seed)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
