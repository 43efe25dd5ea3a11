"""One process of `bench_multi_gpu.py`: DAPO optimizer steps on a fixed, rank-independent generation batch, or on
completions the model generates.

Launched by `accelerate launch` with 1 or N processes. With `--generation scripted` the scripted rollout makes the
global generation batch the same whatever the number of ranks, so the parameter update of N ranks can be compared with
1 rank's, and rank 0 writes the update (fp32). With `engine` or `trl` the model generates `--new-tokens` tokens per
completion (with `--variable-lengths`: up to that many, as it samples them) through the rollout engine or TRL's path, and each rank records its generation time per step. Every rank
writes its step times and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.core.timing import StepTimer, time_methods
from benchmarks.core.workload import config_path, prompts, word_tokenizer
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.testing import ScriptedRollout
from trl_dapo.tiny_model import build_tiny_model


def varied_reward(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids) % 2) for ids in completion_ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a config name in benchmarks/configs, or 'tiny'")
    parser.add_argument("--output", required=True)
    parser.add_argument("--rows-per-step", type=int, default=64)
    parser.add_argument("--ga", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--generation", choices=["scripted", "engine", "trl"], default="scripted")
    parser.add_argument("--new-tokens", type=int, default=8, help="completion length when the model generates")
    parser.add_argument(
        "--variable-lengths", action="store_true", help="lengths as the model samples them, up to --new-tokens"
    )
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()

    if args.model == "tiny":
        path = Path(tempfile.gettempdir()) / "dapo-multi-gpu-tiny"
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (path / "config.json").exists():
            build_tiny_model(path)
        while not (path / "tokenizer_config.json").exists():
            time.sleep(0.5)
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    else:
        config = AutoConfig.from_pretrained(config_path(args.model))
        tokenizer = word_tokenizer(config.vocab_size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # fp32 master weights, bf16 autocast
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    if args.generation == "scripted":
        rollout = dict(rollout_func=ScriptedRollout(tokenizer, vocab_low=3, vocab_high=min(config.vocab_size, 5000)))
        generation = {}
    else:  # pinned: every completion exactly --new-tokens long (a constant-length reward would filter every group)
        rollout = {}
        generation = dict(
            rollout_engine="paged" if args.generation == "engine" else "trl",
            generation_kwargs={} if args.variable_lengths else {"min_new_tokens": args.new_tokens},
            dynamic_sampling=False,
            overlong_buffer_len=0,
        )
    timer = StepTimer()
    trainer = DAPOTrainer(
        model=model,
        reward_funcs=varied_reward,
        args=DAPOConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=args.rows_per_step // world // args.ga,
            gradient_accumulation_steps=args.ga,
            num_generations=8,
            max_completion_length=args.new_tokens,
            max_steps=args.steps,
            learning_rate=1e-2,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            bf16=cuda,
            use_cpu=not cuda,
            gradient_checkpointing=args.gradient_checkpointing,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            **generation,
        ),
        train_dataset=prompts(4 * args.rows_per_step),
        processing_class=tokenizer,
        callbacks=[timer],
        **rollout,
    )
    sections: dict[str, list[tuple[int, float]]] = {}
    generated: list[tuple[int, int]] = []  # (step, completion tokens) of each generation call
    time_methods(trainer, sections, generated)
    trainer.train()
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "world": world,
        "step_times_s": timer.times,
        "generation_s": [sum(t for s, t in sections.get("generation", []) if s == step) for step in range(args.steps)],
        # generation, scoring and bookkeeping of each step's batch; the rest of the step is training
        "generate_and_score_s": [
            sum(t for s, t in sections.get("generate_and_score", []) if s == step) for step in range(args.steps)
        ],
        "generated_tokens_per_step": sum(tokens for _, tokens in generated) / max(args.steps, 1),
        "rollout_engine": trainer.paged_engine is not None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "metrics": [h for h in trainer.state.log_history if "loss" in h],
    }
    Path(f"{args.output}.rank{rank}.json").write_text(json.dumps(report))
    if args.generation == "scripted":  # the update the 1-vs-N comparison reads
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathers ZeRO-3 shards on rank 0
        if trainer.accelerator.is_main_process:
            update = {name: state[name].float().cpu() - before[name] for name in before if name in state}
            torch.save(update, f"{args.output}.update.pt")
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    # The DDP reducer holds the process group: destroying the group first left gloo joining stuck threads at exit.
    del trainer
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
