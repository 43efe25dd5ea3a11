"""Run by `accelerate launch` on 2 CPU processes: streaming dynamic sampling whose reward function fails on rank 1's
first group. Every rank must stop at the next agreement of the ranks (rank 0 would otherwise wait there for rank 1):
rank 1 with its error, which names the group, rank 0 with one that names rank 1.

Writes, per rank, the error it stopped with (its type, message and notes).
"""

import json
import sys
from pathlib import Path

import torch

from helpers import arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer


def fails_on_rank_one(completion_ids, index, **kwargs) -> list[float]:
    if torch.distributed.get_rank() == 1:
        raise ValueError(f"no reward for prompt {index[0]}")
    return [float(j % 2) if i % 3 == 1 else 0.0 for j, i in enumerate(index)]


def main(model_path: str, output: Path) -> None:
    args = dapo_args(
        output / "run", per_device_train_batch_size=8, max_steps=1, rollout_engine="paged",
        dynamic_sampling_mode="stream", rollout_max_rows=16, generation_kwargs={"min_new_tokens": 8},
    )  # fmt: skip
    trainer = DAPOTrainer(
        model=model_path, reward_funcs=fails_on_rank_one, args=args, train_dataset=arithmetic_prompts(40)
    )
    try:
        trainer.train()
        stopped = None
    except Exception as error:
        stopped = {"type": type(error).__name__, "message": str(error), "notes": getattr(error, "__notes__", [])}
    accelerator = trainer.accelerator
    (output / f"rank-{accelerator.process_index}.json").write_text(json.dumps(stopped))
    accelerator.wait_for_everyone()
    # The DDP reducer holds the process group: release it before the group is destroyed.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
