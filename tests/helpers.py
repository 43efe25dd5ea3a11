"""Shared test helpers: fixed-length prompts, config defaults for the CPU, simple rewards, a free port, worker
launches, a scripted stand-in for the engine's stream, a partial-rollouts trainer and its generation batches."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.rollout.generation import RolloutStats

TESTS = Path(__file__).parent
ACCELERATE_CONFIGS = TESTS.parent / "recipes" / "accelerate"
CPU_ARGS = dict(use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)


def arithmetic_prompts(count: int, offset: int = 0) -> Dataset:
    """Prompts of identical token length (no left padding), so any batch split gives the same positions."""
    rows = [(i + offset) for i in range(count)]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i % 10} + {i // 10 % 10} ?"}] for i in rows],
            "index": rows,
        }
    )


def dapo_args(output_dir, **overrides) -> DAPOConfig:
    values = dict(
        output_dir=str(output_dir),
        num_generations=4,
        max_completion_length=8,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        seed=0,
        **CPU_ARGS,
    )
    values.update(overrides)
    return DAPOConfig(**values)


def length_reward(completion_ids, **kwargs) -> list[float]:
    """Varied within most groups: a completion's length parity."""
    return [float(len(ids) % 2) for ids in completion_ids]


def first_token_parity(completion_ids, **kwargs) -> list[float]:
    """Varied within most groups of a random model's samples (whose lengths mostly hit the limit)."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


def alternating_reward(completion_ids, **kwargs) -> list[float]:
    """0, 1, 0, 1, ... by row within each call: every group of an even size varies (with greedy rows too, whose samples
    are all alike), and a group's rewards do not depend on its rank's share of rows (shares of an even size)."""
    return [float(j % 2) for j in range(len(completion_ids))]


def end_sooner(model, end_token_id: int, scale: float = 10.0):
    """`model` (the tiny one, its embeddings tied to its output layer) with the end token's row scaled by `scale`:
    its logit grows with how the last hidden state aligns with that row, so greedy rows end at lengths their prompt
    sets (1 to 17 tokens over the arithmetic prompts at scale 10), where the tiny model's rows all run to the limit."""
    with torch.no_grad():
        model.get_input_embeddings().weight[end_token_id] *= scale
    return model


def teacher_forced_logprobs(model, batch) -> torch.Tensor:
    """log_softmax of a plain transformers forward at each completion token: an independent computation of what the
    training model assigns to the sampled tokens."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1 : -1]
    return logits.log_softmax(-1).gather(2, batch["completion_ids"].unsqueeze(2)).squeeze(2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_worker(
    script: str, processes: int, model: str, output: Path, *args: str, config: str = "cpu_ddp", timeout: int = 600
) -> None:
    """`accelerate launch` a worker of tests/ on CPU processes (gloo) under one of the recipes' accelerate configs
    (from the repository root, where their DeepSpeed JSON paths start) with the model folder, an output path and
    `args`; a run past `timeout` seconds (ranks waiting on each other) fails."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        "--num_processes", str(processes), "--main_process_port", str(free_port()),
        str(TESTS / script), model, str(output), *args,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=TESTS.parent, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


def spawn_ranks(script: str, processes: int, *args: str, one_device: bool = False, timeout: int = 600) -> None:
    """Start the processes of a distributed run of a worker of tests/ ourselves, as torchrun would: for launchers
    accelerate has no config for. `one_device`: every rank on the first CUDA device (each with LOCAL_RANK 0), for
    several ranks sharing one GPU over gloo; else rank r is local rank r (CPU ranks, DeepSpeed's among them)."""
    port = str(free_port())
    runs = []
    with contextlib.ExitStack() as files:
        for rank in range(processes):
            local = "0" if one_device else str(rank)
            environment = {
                **os.environ, "RANK": str(rank), "WORLD_SIZE": str(processes), "LOCAL_RANK": local,
                "LOCAL_WORLD_SIZE": "1" if one_device else str(processes), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }  # fmt: skip
            log = files.enter_context(tempfile.TemporaryFile("w+"))  # a pipe could fill and stall a rank
            command = [sys.executable, str(TESTS / script), *args]
            runs.append((subprocess.Popen(command, cwd=TESTS, env=environment, stderr=log, text=True), log))
        try:
            for run, _ in runs:
                run.wait(timeout=timeout)
        finally:
            for run, _ in runs:
                run.kill()
        for rank, (run, log) in enumerate(runs):
            log.seek(0)
            assert run.returncode == 0, f"rank {rank}: {log.read()[-4000:]}"


def trained_rows(trainer, micro_batches=None) -> dict:
    """The rows of `micro_batches` (default: the whole buffered generation batch) as one padded batch, in pass order
    (an empty pass's stand-in row left out)."""
    from trl_dapo.rollout_batch import concat_rollouts

    micro_batches = trainer._buffered_inputs if micro_batches is None else micro_batches
    passes = [
        rows
        for micro_batch in micro_batches
        for rows, empty in zip(micro_batch.passes, micro_batch.empty, strict=True)
        if not empty
    ]
    return concat_rollouts(passes, trainer._tokenizer.pad_token_id)


class ScriptedStream:
    """A stand-in for the engine's `RolloutStream` whose rows decode one token per step up to a length fixed by their
    prompt (`[length]`), `slots` rows at a time in admission order: the driver's decisions can be derived by hand."""

    def __init__(self, prompts: list[list[int]], slots: int, resumed=None) -> None:
        self.lengths, self.generated, self.slots = [], [], slots
        self.waiting, self.running, self.busy, self.steps, self.resumed_tokens = [], [], 0, 0, 0
        self.add(prompts, resumed)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, prompts, resumed=None):
        rows = list(range(len(self.lengths), len(self.lengths) + len(prompts)))
        self.lengths += [prompt[0] for prompt in prompts]
        self.generated += [len(tokens) for tokens, _ in resumed] if resumed else [0] * len(prompts)
        self.resumed_tokens += sum(len(tokens) for tokens, _ in resumed) if resumed else 0
        self.waiting += rows
        return rows

    def step(self) -> list[int]:
        while self.waiting and len(self.running) < self.slots:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return []
        self.steps += 1
        self.busy += len(self.running)
        for row in self.running:
            self.generated[row] += 1
        ended = [row for row in self.running if self.generated[row] == self.lengths[row]]
        self.running = [row for row in self.running if row not in ended]
        return ended

    def outputs(self, rows):
        return [[5] * self.generated[row] for row in rows], torch.zeros(len(rows), 8)

    def close(self):
        return RolloutStats(
            generated_tokens=sum(self.generated),
            busy_slot_steps=self.busy,
            pool_slot_steps=self.steps * self.slots,
            decode_steps=self.steps,
            resumed_tokens=self.resumed_tokens,
        )


class Snapshots(TrainerCallback):
    """Parameters and AdamW moments after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[tuple[dict, dict]] = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        parameters = {n: p.detach().clone() for n, p in model.named_parameters()}
        moments = {id(p): s["exp_avg"].clone() for p, s in optimizer.state.items() if "exp_avg" in s}
        self.steps.append((parameters, moments))


# A loop whose bound is loaded from memory, as the decode kernel's is: Triton's interpreter converts the bound with
# int() on a one-element array, which NumPy 2.4 refuses (upstream triton-lang/triton#9171); compiled kernels are not
# affected.
INTERPRETER_LOOP_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def count(bound_ptr, out_ptr):
    total = 0
    for _ in range(0, tl.load(bound_ptr)):
        total += 1
    tl.store(out_ptr, total)
out = torch.zeros(1, dtype=torch.int32)
count[(1,)](torch.tensor([3], dtype=torch.int32), out)
assert out.item() == 3
"""


def run_in_triton_interpreter(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)


needs_triton = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import triton"], capture_output=True).returncode != 0,
    reason="Triton is not installed",
)


def partial_trainer(model: str, output, **overrides) -> DAPOTrainer:
    """Partial rollouts on the paged engine: batches of 4 groups of 2 greedy rows of the ending model (rows of 1 to 17
    tokens); 32 slots (the in-flight cap's 12 groups and a batch's 4 prompts, which enter whatever the cap, decode at
    once: none waits); the engine synchronising every 2 decode steps, so rounds stop with rows in flight; every group
    informative (`alternating_reward`)."""
    settings = dict(
        num_generations=2, per_device_train_batch_size=8, max_completion_length=24, rollout_engine="paged",
        partial_rollouts=True, rollout_max_rows=32, generation_kwargs={"do_sample": False}, max_steps=4,
        learning_rate=0.1,
    )  # fmt: skip
    trainer = DAPOTrainer(
        model=model, reward_funcs=alternating_reward, train_dataset=arithmetic_prompts(40),
        args=dapo_args(output, **settings | overrides),
    )  # fmt: skip
    trainer.paged_engine.sync_every = 2
    return trainer


# Sampled among each step's 3 likeliest tokens: the ending model's rows still end at varied lengths (1 to 24 tokens),
# and the samples of a group differ, so the weights move (greedy samples of a group are alike: no gradient).
SAMPLED = dict(generation_kwargs=None, top_k=3)


def record_batches(trainer: DAPOTrainer) -> list[tuple[int, dict, dict]]:
    """Each generation batch as collected: `(optimizer step, every rank's rows with each token's sampling step, the
    training model's weights that generated it)`."""
    records, collect = [], trainer.collector.collect

    def recorded(inputs, step):
        weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
        collected = collect(inputs, step)
        records.append((step, {key: value.clone() for key, value in collected.batch.items()}, weights))
        return collected

    trainer.collector.collect = recorded
    return records


def rows_of(batch: dict) -> list[tuple[list[int], list[int]]]:
    """Each row's prompt and completion tokens."""
    return [
        (p[pm.bool()].tolist(), c[cm.bool()].tolist())
        for p, pm, c, cm in zip(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], strict=True
        )
    ]
