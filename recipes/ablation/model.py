"""The study's model: a character tokenizer and a Qwen2 built from scratch, then a short supervised warm start.

Qwen2 is one of the architectures the package's rollout engine decodes, so the paged-engine variant serves the same
model as the rest. The warm start trains on worked solutions of fresh problems (never a held-out one) and stops at
the first check whose greedy accuracy on a probe set reaches the target: every seed starts RL from a comparable,
moderately right model, whatever the device's speed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from trl_dapo.evaluation import OVERALL, EvalSettings
from trl_dapo.tiny_model import build_tiny_model

from .config import StudyConfig
from .task import draw_problem, draw_rechecks, evaluate_held_out, to_dataset

ALPHABET = "0123456789+=\n :Answer"  # every character of the prompts and worked solutions
PAD_TOKEN, EOS_TOKEN = "<pad>", "<eos>"
VOCAB_SIZE = 2 + len(set(ALPHABET))  # pad, end and one token per character


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character and a pad and an end token: 23 tokens for the default alphabet."""
    vocab = {token: index for index, token in enumerate([PAD_TOKEN, EOS_TOKEN, *sorted(set(alphabet))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, padding_side="left"
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Loaded as the fast tokenizer it was saved as (`AutoTokenizer` would map a Qwen2 folder to Qwen2's class)."""
    return PreTrainedTokenizerFast.from_pretrained(path)


def build_model(path: str | Path, config: StudyConfig, seed: int) -> None:
    """Save a randomly initialised Qwen2 of the configured size and the character tokenizer to `path`."""
    build_tiny_model(
        path,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=seed,
        tokenizer=build_char_tokenizer(),
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        max_position_embeddings=256,
    )


def _batch(tokenizer, prompts: list[str], solutions: list[str], max_length: int, device) -> dict[str, torch.Tensor]:
    """Right-padded prompt + solution + end token, the loss on the solution and the end token only, each solution cut
    at `max_length` tokens with its end token (what RL's completions can hold: a recheck past it is seen as far as a
    rollout could see it). Tokenized in two batched calls, not two per row: the warm start's step is host-bound."""
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    solution_ids = tokenizer(solutions, add_special_tokens=False)["input_ids"]
    rows = [
        prompt + [*solution, tokenizer.eos_token_id][:max_length]
        for prompt, solution in zip(prompt_ids, solution_ids, strict=True)
    ]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (row, prompt) in enumerate(zip(rows, prompt_ids, strict=True)):
        input_ids[index, : len(row)] = torch.tensor(row)
        labels[index, len(prompt) : len(row)] = input_ids[index, len(prompt) : len(row)]
        attention_mask[index, : len(row)] = 1
    return {
        "input_ids": input_ids.to(device),
        "labels": labels.to(device),
        "attention_mask": attention_mask.to(device),
    }


def warm_start(path: str | Path, config: StudyConfig, held_out_prompts: set[str], seed: int) -> dict:
    """Supervised steps on fresh problems until the probe's greedy accuracy reaches `sft_target_accuracy` (checked
    every `sft_check_every` steps) or `sft_max_steps`; saves the model back to `path` and returns the record. Each
    worked solution rechecks a geometric number of times (`sft_recheck_probability`): the verbose habit the paper
    regime starts RL from.

    Attention runs on SDPA's math backend: the fused kernels' backward (flash, memory-efficient) adds in a
    nondeterministic order on a GPU (deterministic algorithms with `warn_only` only warn about it), and a start point
    rebuilt on a fresh machine must reproduce its recorded weights bit for bit."""
    device = torch.device(config.device)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device)
    rng = random.Random(seed)
    low, high = config.buckets[0][0], config.buckets[-1][1]

    def fresh(count: int) -> list:
        problems = []
        while len(problems) < count:
            problem = draw_problem(rng, low, high)
            if problem.prompt not in held_out_prompts:
                problems.append(problem)
        return problems

    probe = to_dataset(fresh(config.sft_probe_problems), config.buckets)
    settings = EvalSettings(0, 1.0, 1.0, config.max_completion_length, config.eval_max_rows, seed, config.bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.sft_learning_rate, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / config.sft_warmup_steps)
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16)
    began, checks, step = time.perf_counter(), [], 0
    model.train()
    with sdpa_kernel(SDPBackend.MATH):
        while step < config.sft_max_steps:
            problems = fresh(config.sft_batch_size)
            solutions = [p.worked(draw_rechecks(rng, config.sft_recheck_probability)) for p in problems]
            prompts = [p.prompt for p in problems]
            with autocast:
                loss = model(**_batch(tokenizer, prompts, solutions, config.max_completion_length, device)).loss
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % config.sft_check_every == 0 or step == config.sft_max_steps:
                greedy = evaluate_held_out(model, tokenizer, probe, settings)["greedy"]
                checks.append({"step": step, "loss": loss.item(), "probe_greedy": greedy})
                print(
                    f"warm start step {step}: loss {loss.item():.3f}, probe greedy {greedy[OVERALL]:.3f}", flush=True
                )
                if greedy[OVERALL] >= config.sft_target_accuracy:
                    break
    model.save_pretrained(path)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": step,
        "seconds": time.perf_counter() - began,
        "reached_target": checks[-1]["probe_greedy"][OVERALL] >= config.sft_target_accuracy,
        "checks": checks,
    }
