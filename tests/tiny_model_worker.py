"""Run by `accelerate launch` on 2 CPU processes: each rank builds the tiny model once `DAPOConfig` has set up the
process group, into a folder of its own and into one folder every rank shares, and loads both.

Writes, per rank, the sum of the loaded parameters of each folder and whether the process group was up.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trl_dapo import DAPOConfig
from trl_dapo.tiny_model import build_tiny_model


def parameter_sum(path: str) -> float:
    model = AutoModelForCausalLM.from_pretrained(path)
    return sum(parameter.double().sum().item() for parameter in model.parameters())


def main(output: Path) -> None:
    args = DAPOConfig(output_dir=str(output / "run"), use_cpu=True, bf16=False, report_to=[])
    rank = args.process_index
    sums = {
        "own": parameter_sum(build_tiny_model(output / f"rank-{rank}")),
        "shared": parameter_sum(build_tiny_model(output / "shared")),
    }
    result = {"process_group": torch.distributed.is_initialized(), **sums}
    (output / f"rank-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[2]))
