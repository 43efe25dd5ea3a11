"""One rank of a DeepSpeed run, launched under one of the recipes' ZeRO accelerate configs, on the CPU or on a GPU:
three optimizer steps, the second with no informative group (its rounds find a constant reward), so dynamic sampling
skips it, the third with a NaN in one parameter's gradient, so DeepSpeed's overflow check skips it.

Before the first step and after each it records, on its rank, DeepSpeed's float32 weights (the flat partitions its torch optimizer steps), AdamW's
state of each and the model's own parameters (under ZeRO-3, this rank's partition of each), the logged learning rate
and `dapo/skipped_steps` / `dapo/nonfinite_steps`. Writes them to `<output>.rank<r>.pt`.
"""

import os
import sys

import torch
from transformers import TrainerCallback

from helpers import arithmetic_prompts, dapo_args, first_token_parity
from trl_dapo import DAPOTrainer


def varied_then_constant(completion_ids, trainer_state, **kwargs) -> list[float]:
    """Informative groups at the first and third steps, none at the second."""
    if trainer_state.global_step != 1:
        return first_token_parity(completion_ids)
    return [1.0] * len(completion_ids)


class DeepSpeedSnapshots(TrainerCallback):
    def __init__(self, trainer: DAPOTrainer) -> None:
        self.trainer = trainer
        self.steps: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.on_step_end(args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.accelerator.deepspeed_engine_wrapped.engine
        zero = engine.optimizer  # float32 weights: ZeRO-3's flat sub-groups, ZeRO-2's partitions
        weights = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        weights = [w.detach().clone() for w in weights]
        moments = [{name: value.clone() for name, value in state.items()} for state in zero.optimizer.state.values()]
        parameters = {
            name: getattr(p, "ds_tensor", p).detach().float().clone() for name, p in engine.module.named_parameters()
        }
        self.steps.append({"fp32_weights": weights, "adam_state": moments, "parameters": parameters})


def main(model_path: str, output: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    args = dapo_args(
        output + ".run",
        per_device_train_batch_size=8 // world,
        optim="adamw_torch",
        weight_decay=0.1,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        max_num_gen_batches=2,
        max_steps=3,
        **({"use_cpu": False, "bf16": True, "rollout_memory_fraction": 0.2} if cuda else {}),
    )
    trainer = DAPOTrainer(
        model=model_path, reward_funcs=varied_then_constant, args=args, train_dataset=arithmetic_prompts(40)
    )
    poisoned = next(p for p in trainer.model.parameters() if p.requires_grad)
    nan_at_the_third_step = poisoned.register_hook(
        lambda grad, trainer=trainer: grad * float("nan") if trainer.state.global_step == 2 else grad
    )
    snapshots = DeepSpeedSnapshots(trainer)
    trainer.add_callback(snapshots)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "steps": snapshots.steps,
        "learning_rate": [h["learning_rate"] for h in logs],
        "skipped_steps": [h["dapo/skipped_steps"] for h in logs],
        "nonfinite_steps": [h["dapo/nonfinite_steps"] for h in logs],
        "global_step": trainer.state.global_step,
    }
    torch.save(result, f"{output}.rank{trainer.accelerator.process_index}.pt")
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    nan_at_the_third_step.remove()  # it holds the trainer, released next
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:3])
