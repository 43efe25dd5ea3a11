"""One process of `check_launch_config_rollout.py`: runs `recipes/dapo_math.py` with its arguments under `accelerate
launch` until the paged engine's first generation, saves what that generation read and returned, and exits.

Usage (the driver builds it): `accelerate launch ... benchmarks/multi_gpu/launch_config_rollout_worker.py DUMP
ENGINE_DTYPE recipes/dapo_math.py RECIPE_ARGS...`. `ENGINE_DTYPE`: `default` (the engine's own choice: bf16 on CUDA,
float32 on the CPU) or `bfloat16` (also on the CPU, to compare the CUDA set-up's numerics there).

Saved to DUMP (torch.save): the engine's weight snapshot (every tensor), the rotary module's buffers and the cos / sin
tables the engine decoded with, the state of the generator `sampling_noise` draws from (CUDA's on CUDA) just before the
call, the prompts, the completions and their per-token logprobs.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from trl_dapo.rollout import PagedRolloutEngine


def force_engine_dtype(dtype: torch.dtype) -> None:
    build = PagedRolloutEngine.__init__

    def init(self, model, **kwargs):
        build(self, model, **{**kwargs, "dtype": dtype})

    PagedRolloutEngine.__init__ = init


def dump_first_generation(path: str) -> None:
    generate = PagedRolloutEngine.generate

    def first_generation(self, prompt_ids, settings):
        cuda = self.device.type == "cuda"
        rng = torch.cuda.get_rng_state(self.device) if cuda else torch.get_rng_state()
        snapshot = {name: tensor.detach().cpu().clone() for name, tensor in self.snapshot.tensors.items()}
        output = generate(self, prompt_ids, settings)
        rotary = self.architecture.rotary
        torch.save(
            {
                "snapshot": snapshot,
                "rotary_buffers": {name: buffer.detach().cpu().clone() for name, buffer in rotary.named_buffers()},
                "cos": self.cos.detach().cpu().clone(),
                "sin": self.sin.detach().cpu().clone(),
                "rng_state": rng,
                "prompt_ids": [list(prompt) for prompt in prompt_ids],
                "completions": output.completions,
                "logprobs": output.logprobs.detach().cpu().clone(),
                "engine_dtype": str(self.dtype),
                "settings": repr(settings),
            },
            path,
        )
        sys.stdout.flush()
        os._exit(0)  # the first generation is all this diagnostic needs: no training step

    PagedRolloutEngine.generate = first_generation


def main() -> None:
    dump, engine_dtype, recipe, *recipe_args = sys.argv[1:]
    if engine_dtype != "default":
        force_engine_dtype(getattr(torch, engine_dtype))
    dump_first_generation(dump)
    sys.argv = [recipe, *recipe_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(recipe)))  # the recipe imports its folder's modules
    runpy.run_path(recipe, run_name="__main__")
    raise SystemExit("the recipe finished without a paged-engine generation")


if __name__ == "__main__":
    main()
