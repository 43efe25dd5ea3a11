"""Save a random-init model of one of `benchmarks/configs` with its word tokenizer, for runs that load a model by
path (the math recipe's `--model_name_or_path`) on a machine without the hub.

    python3 -m benchmarks.save_random_model --model qwen2.5-7b-v2048 --output /tmp/qwen2.5-7b-v2048
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.workload import config_path, word_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a config name in benchmarks/configs")
    parser.add_argument("--output", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(config_path(args.model))
    torch.manual_seed(args.seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(args.output)
    word_tokenizer(config.vocab_size).save_pretrained(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
