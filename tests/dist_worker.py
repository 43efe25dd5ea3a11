"""Run by `accelerate launch` (1 or 2 CPU processes): DAPO optimizer steps in three set-ups.

- `scripted`: one step on a scripted rollout where dynamic sampling filters and draws extra rounds;
- `partial`: dynamic sampling finds fewer informative groups than the batch needs (train_on_partial), so each rank
  holds fewer rows than micro-batches and some micro-batches are empty;
- `sparse`: one informative group of 2 rows for 2 optimizer steps with the old policy recomputed: each step has one
  row, so on 2 ranks one rank has none and runs empty passes (a stand-in row), its recompute pass included;
- `defaults`: `DAPOConfig`'s defaults (16 samples per prompt, 16 completions per device) with real generation;
- `recomputed`: `scripted` with the old policy recomputed on each rank's rows and a sequence-level correction;
- `scripted`, `partial` and `recomputed` train padding-free (`padding_free=True`: on the CPU the per-row reference
  attention); `scripted_padded`, `recomputed_padded` the same with padded passes (`padding_free=False`), whose rows
  are dealt to the ranks evenly by count (padding-free: by tokens, so the ranks' tokens are about equal);
- `stream`, `stream_again`: streaming dynamic sampling on the paged engine (CPU), twice with the same seed;
- `recomputed_capped`: `recomputed` with `padding_free_max_tokens`, so each micro-batch runs several passes, all but
  the last with deferred gradient synchronisation (the ranks' passes holding unequal token counts).

Writes, per set-up, the updated parameters, the accepted rollout rows (before the micro-batch shuffle), each rank's
rows and loss tokens per micro-batch (and per pass) and the logged metrics, so the test can compare a 2-process run with a 1-process
run of the same global batch, and padded with padding-free passes.
"""

import os
import sys

import torch
from transformers import AutoTokenizer, set_seed

from helpers import CPU_ARGS, arithmetic_prompts, dapo_args, first_token_parity
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.testing import ScriptedRollout


def reward_by_prompt(completion_ids, index, **kwargs) -> list[float]:
    """All-correct for a third of the prompts, all-wrong for a third, varied for the rest: dynamic sampling filters
    two thirds of the groups and draws extra rounds."""
    return [[1.0, float(len(ids) % 2), 0.0][i % 3] for ids, i in zip(completion_ids, index, strict=True)]


class OnePromptInformative:
    """Varied within the group for one prompt only (set once the sampler's first prompt is known), constant else."""

    def __init__(self) -> None:
        self.prompt = -1
        self.__name__ = "one_prompt_informative"

    def __call__(self, completion_ids, index, **kwargs) -> list[float]:
        return [float(j % 2) if i == self.prompt else 0.0 for j, i in enumerate(index)]


def informative_by_prompt(completion_ids, index, **kwargs) -> list[float]:
    """Varied within the group (0, 1, 0, 1) for prompts with index % 3 == 1, constant for the others."""
    return [float(j % 2) if i % 3 == 1 else float(i % 3 == 0) for j, i in enumerate(index)]


class RecordingDAPOTrainer(DAPOTrainer):
    """Keeps each accepted generation batch (all ranks' rows), as handed to the micro-batch split, and the dataset
    indices of the dataloader's rows."""

    accepted: list
    dataloader: list

    def _collect_generation_batch(self, inputs):
        batch = super()._collect_generation_batch(inputs)
        self.accepted.append({k: v.clone() for k, v in batch.items()})
        self.dataloader.append([row["index"] for row in inputs])
        return batch


def trainers(model_path: str, output: str, world: int) -> dict[str, RecordingDAPOTrainer]:
    rollout = ScriptedRollout(AutoTokenizer.from_pretrained(model_path))
    common = dict(learning_rate=0.1, max_steps=1)
    scripted_settings = dict(per_device_train_batch_size=16 // world, gradient_accumulation_steps=2, **common)
    packed = dict(padding_free=True)
    scripted = dapo_args(output + ".scripted", **scripted_settings, **packed)
    partial = dapo_args(
        output + ".partial",
        num_generations=2,
        per_device_train_batch_size=4 // world,
        gradient_accumulation_steps=4,
        max_num_gen_batches=1,
        **common,
        **packed,
    )
    defaults = DAPOConfig(output_dir=output + ".defaults", max_completion_length=8, max_steps=1, **CPU_ARGS)
    recomputed_settings = dict(
        scripted_settings,
        old_logprobs="recompute",
        rollout_correction="sequence_truncate",
        rollout_correction_max=1.05,
    )
    recomputed = dapo_args(output + ".recomputed", **recomputed_settings, **packed)
    stream = dict(
        num_generations=4, per_device_train_batch_size=8 // world, gradient_accumulation_steps=2,
        dynamic_sampling_mode="stream", rollout_engine="paged", rollout_max_rows=16, learning_rate=0.01,
        generation_kwargs={"min_new_tokens": 8}, max_steps=1,
    )  # fmt: skip
    stream_run = dict(reward_funcs=informative_by_prompt, train_dataset=arithmetic_prompts(40))
    scripted_run = dict(reward_funcs=reward_by_prompt, train_dataset=arithmetic_prompts(40), rollout_func=rollout)
    sparse_args = dapo_args(
        output + ".sparse", num_generations=2, per_device_train_batch_size=4 // world, gradient_accumulation_steps=4,
        steps_per_generation=8, max_num_gen_batches=1, old_logprobs="recompute", learning_rate=0.1, max_steps=2,
        padding_free=True,
    )  # fmt: skip
    one_prompt = OnePromptInformative()
    sparse = RecordingDAPOTrainer(
        model=model_path, reward_funcs=one_prompt, args=sparse_args, train_dataset=arithmetic_prompts(40),
        rollout_func=rollout,
    )  # fmt: skip
    one_prompt.prompt = next(iter(sparse._get_train_sampler()))  # the same on every rank (seeded)
    return {
        "sparse": sparse,
        "scripted": RecordingDAPOTrainer(model=model_path, args=scripted, **scripted_run),
        "scripted_padded": RecordingDAPOTrainer(
            model=model_path,
            args=dapo_args(output + ".padded", padding_free=False, **scripted_settings),
            **scripted_run,
        ),
        "recomputed_padded": RecordingDAPOTrainer(
            model=model_path,
            args=dapo_args(output + ".recomputed_padded", padding_free=False, **recomputed_settings),
            **scripted_run,
        ),
        "partial": RecordingDAPOTrainer(model=model_path, args=partial, **scripted_run),
        "defaults": RecordingDAPOTrainer(
            model=model_path, reward_funcs=first_token_parity, args=defaults, train_dataset=arithmetic_prompts(40)
        ),
        "recomputed": RecordingDAPOTrainer(model=model_path, args=recomputed, **scripted_run),
        "recomputed_capped": RecordingDAPOTrainer(
            model=model_path,
            args=dapo_args(output + ".capped", padding_free_max_tokens=60, **recomputed_settings, **packed),
            **scripted_run,
        ),
        "stream": RecordingDAPOTrainer(model=model_path, args=dapo_args(output + ".stream", **stream), **stream_run),
        "stream_again": RecordingDAPOTrainer(
            model=model_path, args=dapo_args(output + ".stream_again", **stream), **stream_run
        ),
    }


def accepted_rows(trainer: RecordingDAPOTrainer) -> list:
    return [
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


def count_no_grad_forwards(trainer) -> list:
    """Each no-grad logprob forward the trainer runs (TRL's passes, the old policy's recomputation) is appended."""
    calls, forward = [], trainer.passes.logprobs

    def counted(*args, **kwargs):
        if not torch.is_grad_enabled():
            calls.append(1)
        return forward(*args, **kwargs)

    trainer.passes.logprobs = counted
    return calls


def every_rank(value, world: int) -> list:
    gathered = [value]
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, value)
    return gathered


def main(model_path: str, output: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = {}
    for name, trainer in trainers(model_path, output, world).items():
        trainer.accepted, trainer.dataloader = [], []
        if name.startswith("stream"):  # the trainers were all built first: start each stream run from its seed
            set_seed(trainer.args.seed)
        no_grad_forwards = count_no_grad_forwards(trainer)
        trainer.train()
        dataloader = [index for rank in every_rank(trainer.dataloader[0], world) for index in rank]
        passes = [
            [p for p, empty in zip(mb.passes, mb.empty, strict=True) if not empty] for mb in trainer._buffered_inputs
        ]
        micro_batch_rows = [sum(int(rows["completion_ids"].size(0)) for rows in mb) for mb in passes]
        micro_batch_tokens = [sum(int(rows["completion_mask"].sum()) for rows in mb) for mb in passes]
        pass_tokens = [
            [
                0 if empty else int(rows["completion_mask"].sum())
                for rows, empty in zip(mb.passes, mb.empty, strict=True)
            ]
            for mb in trainer._buffered_inputs
        ]
        results[name] = {
            "parameters": {
                k: v.detach().cpu() for k, v in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
            },
            "rows": accepted_rows(trainer),
            "metrics": [h for h in trainer.state.log_history if "dapo/gen_batches" in h],
            "global_step": trainer.state.global_step,
            "generation_batch_size": trainer.args.generation_batch_size,
            "micro_batch_rows": every_rank(micro_batch_rows, world),
            "no_grad_forwards": every_rank(len(no_grad_forwards), world),
            "micro_batch_tokens": every_rank(micro_batch_tokens, world),
            "pass_tokens": every_rank(pass_tokens, world),
            "dataloader": dataloader,
            "index_of_prompt": {
                tuple(ids): row["index"]
                for ids, row in zip(
                    trainer._tokenize_prompts([row["prompt"] for row in trainer.train_dataset])[0],
                    trainer.train_dataset,
                    strict=True,
                )
            },
        }
    accelerator = trainer.accelerator
    if accelerator.is_main_process:
        torch.save(results, output)
    accelerator.wait_for_everyone()
    # The DDP reducer holds the process group: destroying the group first left gloo joining stuck threads at exit.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
