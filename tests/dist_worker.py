"""Run by `accelerate launch` (1 or 2 CPU processes): one DAPO optimizer step on a scripted rollout.

Writes the updated parameters and the accepted rollout rows (before the micro-batch shuffle) so the test can compare
a 2-process run with a 1-process run of the same global batch.
"""

import sys

import torch
from transformers import AutoTokenizer

from helpers import arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.testing import ScriptedRollout


def reward_by_prompt(completion_ids, index, **kwargs) -> list[float]:
    """All-correct for a third of the prompts, all-wrong for a third, varied for the rest: dynamic sampling filters
    two thirds of the groups and draws extra rounds."""
    return [[1.0, float(len(ids) % 2), 0.0][i % 3] for ids, i in zip(completion_ids, index, strict=True)]


class RecordingDAPOTrainer(DAPOTrainer):
    """Keeps the local share of each accepted generation batch, as handed to the micro-batch split."""

    accepted: list

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.accepted.append({k: v.clone() for k, v in batch.items()})
        return batch


def main(model_path: str, output: str) -> None:
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    args = dapo_args(
        output + ".run",
        per_device_train_batch_size=16 // world,
        gradient_accumulation_steps=2,
        learning_rate=0.1,
        max_steps=1,
    )
    trainer = RecordingDAPOTrainer(
        model=model_path,
        reward_funcs=reward_by_prompt,
        args=args,
        train_dataset=arithmetic_prompts(40),
        rollout_func=ScriptedRollout(AutoTokenizer.from_pretrained(model_path)),
    )
    trainer.accepted = []
    trainer.train()
    rows = [
        (p[m.bool()].tolist(), c[cm.bool()].tolist(), float(a))
        for batch in trainer.accepted
        for p, m, c, cm, a in zip(
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            batch["advantages"],
            strict=True,
        )
    ]
    gathered = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(gathered, rows)
    else:
        gathered = [rows]
    if trainer.accelerator.is_main_process:
        parameters = {
            k: v.detach().cpu() for k, v in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
        }
        metrics = [h for h in trainer.state.log_history if "dapo/gen_batches" in h]
        torch.save(
            {"parameters": parameters, "rows": [r for rank in gathered for r in rank], "metrics": metrics}, output
        )
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    # The DDP reducer holds the process group: destroying the group first left gloo joining stuck threads at exit.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
