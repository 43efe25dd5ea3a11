"""DAPO on real vLLM, colocated in this process (`use_vllm=True, vllm_mode="colocate"`): skipped without CUDA or
vLLM. A small random Qwen2 saved to disk in bf16 (vLLM's dtype), trained in float32 under bf16 autocast, 3 steps of
the full recipe: dynamic sampling with a reward that makes half the groups constant, a soft overlong buffer that acts,
Clip-Higher. Checked: more rounds drawn than steps and groups filtered, vLLM's logprobs in the batch and close to the
training forward's at every step (so the weights were synced: the updates are large), vLLM's weights those of the
training model at the last generation, finite losses, weights moved.

Run as a plain `python3 -m pytest` process: TRL's colocate mode sets the rank and rendezvous variables vLLM's
external launcher reads, and vLLM opens a one-process group; both are undone when the test ends.
"""

import gc
import importlib.util
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import arithmetic_prompts, record_batches
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None, reason="needs a CUDA GPU and vLLM"
)


def even_prompts_constant(completion_ids, index, **kwargs) -> list[float]:
    """1.0 for every sample of an even-indexed prompt (a constant group: filtered), else the first token's parity."""
    return [1.0 if i % 2 == 0 else float(ids[0] % 2) for ids, i in zip(completion_ids, index, strict=True)]


@pytest.fixture
def vllm_process_state():
    """This process as it was once vLLM is gone: the environment TRL set for vLLM's launcher and the process group
    vLLM opened would make later trainers here believe they run distributed."""
    saved = dict(os.environ)
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()  # the test's trainer, and with it vLLM's engine
    cleanup_dist_env_and_memory()  # vLLM's own: its groups, the process group, the cached memory
    os.environ.clear()
    os.environ.update(saved)


def test_dapo_trains_on_colocated_vllm(tmp_path, vllm_process_state):
    model = bf16_copy(build_tiny_model(tmp_path / "float32", hidden_size=256, num_kv_heads=2, intermediate_size=512))
    args = DAPOConfig(
        output_dir=str(tmp_path / "run"), use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
        model_init_kwargs={"dtype": "float32"}, num_generations=4, per_device_train_batch_size=16,
        max_completion_length=32, overlong_buffer_len=16, learning_rate=1e-2, max_steps=3, seed=0, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    assert args.epsilon_high > args.epsilon and args.dynamic_sampling
    trainer = DAPOTrainer(
        model=model, reward_funcs=even_prompts_constant, args=args, train_dataset=arithmetic_prompts(64)
    )
    batches = record_batches(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    # dynamic sampling drew more rounds than steps and dropped the constant groups; the overlong penalty acted
    assert sum(h["dapo/gen_batches"] for h in logs) > 3 and sum(h["dapo/filtered_groups"] for h in logs) > 0
    assert min(h["dapo/overlong_penalty_mean"] for h in logs) < 0
    # vLLM's logprobs are the old policy, close to the training forward's before each step's update: vLLM's weights
    # follow the training model's (lr 1e-2 moves the logprobs far more than the numerics do)
    for _, batch, _ in batches:
        counted = batch["completion_mask"].bool()
        assert torch.isfinite(batch["old_per_token_logps"][counted]).all()
    gaps = [h["logprob_gap_mean"] for h in logs]
    assert all(0 < gap < 0.05 for gap in gaps), gaps
    assert max(h["logprob_gap_max"] for h in logs) < 1.0
    # vLLM holds the weights the last generation batch was sampled with, and they moved
    served = vllm_parameter(trainer, "model.layers.0.self_attn.o_proj.weight")
    (_, _, first), (_, _, last) = batches[0], batches[-1]
    assert torch.equal(served, last["model.layers.0.self_attn.o_proj.weight"].to(served.dtype))
    assert not torch.equal(served, first["model.layers.0.self_attn.o_proj.weight"].to(served.dtype))


def bf16_copy(folder: str) -> str:
    """The folder's model and tokenizer saved beside it in bf16, which vLLM then serves in (float32 weights it
    downcasts to its platform's preferred dtype)."""
    copy = f"{folder}-bf16"
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(copy)
    AutoTokenizer.from_pretrained(folder).save_pretrained(copy)
    return copy


def vllm_parameter(trainer: DAPOTrainer, name: str) -> torch.Tensor:
    """A parameter of the model colocated vLLM serves, where TRL's weight sync writes it."""
    served = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    return dict(served.named_parameters())[name].detach()
