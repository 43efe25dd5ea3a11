"""The three generation engines `bench_peers.py` sets side by side, each built from one checkpoint folder for one
shape and called the same way: `generate(prompt ids, max_new_tokens) -> Generated` (completions, each with its end
token or at the cap; the engine's logprobs of them, or None; what the engine tells of the call).

- `paged`: trl-dapo's `PagedRolloutEngine` on the folder's model (bf16 on CUDA), `max_rows` = the shape's rows, its
  memory budget `memory_fraction` of the device; fixed lengths with `min_new_tokens`.
- `vllm`: `vllm.LLM` on the folder, as TRL's colocate mode builds it where a choice is TRL's (bf16, seed 0,
  `logprobs_mode="processed_logprobs"`, `logprobs=0`: the sampled token's logprob) and vLLM's defaults elsewhere (its
  compilation and CUDA graphs, its batched-token budget; TRL caps that at 4,096), prefix caching on, `max_num_seqs` =
  the shape's rows, `gpu_memory_utilization` = the paged engine's budget; fixed lengths with `ignore_eos`. Before each
  measured call the prefix cache is emptied, as TRL empties it at every weight sync: no call finds an earlier call's
  prompts cached.
- `cb`: transformers' continuous batching exactly as TRL 1.16 drives it: a `GRPOTrainer` with
  `use_transformers_continuous_batching=True` generates through its own `_generate_single_turn` (its generation
  config, its `ContinuousBatchingConfig`: `max_memory_percent` 0.5 of the free memory unless `cb_config` says
  otherwise; a manager built, warmed up and torn down in every call). Continuous batching drops `min_new_tokens`, so
  fixed lengths pass `eos_token_id=-1` (no end token) in `generation_kwargs`. It returns no logprobs: TRL recomputes
  them with the training model.

vLLM is imported only where its engine is built: the other engines, the CPU and `--help` run without it.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.workload import kv_bytes_per_token

GROUP = 16  # rows per distinct prompt, as DAPO samples them
TAIL_SHARE = 0.25  # "few rows running": fewer than this share of the call's rows


@dataclass
class Generated:
    """A call's completions (each ends with its end token, kept, or at the cap) and what the engine tells of it. Its
    logprobs are read out of the engine's own form by `logprobs()` after the call's clock has stopped: the engines
    return them as their callers use them (the paged engine a device tensor, vLLM an object per token)."""

    completions: list[list[int]]
    read_logprobs: Callable[[], list[list[float]]] | None  # None where the engine returns none
    stats: dict = field(default_factory=dict)

    def logprobs(self) -> list[list[float]] | None:
        """The engine's logprob of each completion token, or None."""
        return None if self.read_logprobs is None else self.read_logprobs()


def end_token_ids(folder: Path) -> list[int]:
    """The ids that end a completion, as TRL's GRPOTrainer takes them (and vLLM, from the same files): the tokenizer's
    end token and every one the model's generation config declares."""
    from transformers import GenerationConfig

    ids = [AutoTokenizer.from_pretrained(folder).eos_token_id]
    declared = (
        GenerationConfig.from_pretrained(folder).eos_token_id if (folder / "generation_config.json").exists() else None
    )
    ids += [declared] if isinstance(declared, int) else list(declared or [])
    return list(dict.fromkeys(i for i in ids if i is not None))


def load_model(folder: Path, device: str):
    """The folder's model in the precision the engines run (bf16 on CUDA, float32 on the CPU), SDPA attention."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.set_attn_implementation("sdpa")
    return model


def torch_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
    }


class PagedPeer:
    name = "paged"

    def __init__(self, folder: Path, rows: int, fixed: bool, memory_fraction: float, device: str, **_) -> None:
        from trl_dapo.rollout import PagedRolloutEngine

        self.fixed, self.device, self.memory_fraction = fixed, device, memory_fraction
        self.model = load_model(folder, device)
        ends = end_token_ids(folder)
        pad = AutoTokenizer.from_pretrained(folder).pad_token_id
        self.engine = PagedRolloutEngine(
            self.model, eos_token_ids=ends, pad_token_id=ends[0] if pad is None else pad, dtype=self.model.dtype,
            cuda_graph=device == "cuda", memory_fraction=memory_fraction, max_rows=rows,
        )  # fmt: skip
        self.engine.sync_weights(self.model)

    def fresh(self) -> None:
        """Nothing carries over between the engine's calls."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generated:
        from trl_dapo.rollout import TokenSampling

        settings = TokenSampling(max_new_tokens, temperature=1.0, min_new_tokens=max_new_tokens if self.fixed else 0)
        out = self.engine.generate(prompts, settings)

        def rows() -> list[list[float]]:
            return [row[: len(c)].tolist() for row, c in zip(out.logprobs.cpu(), out.completions, strict=True)]

        return Generated(out.completions, rows, out.stats.as_dict())

    def memory(self) -> dict:
        if self.device != "cuda":
            return {}
        total = torch.cuda.get_device_properties(0).total_memory
        return {**torch_memory(self.device), "budget_gib": self.memory_fraction * total / 2**30}


class VllmPeer:
    name = "vllm"

    def __init__(self, folder: Path, rows: int, fixed: bool, memory_fraction: float, **_) -> None:
        from vllm import LLM

        self.fixed, self.memory_fraction = fixed, memory_fraction
        self.kv_bytes_per_token = kv_bytes_per_token(AutoConfig.from_pretrained(folder))
        self.llm = LLM(
            model=str(folder), dtype="bfloat16", seed=0, max_num_seqs=rows, enable_prefix_caching=True,
            gpu_memory_utilization=memory_fraction, logprobs_mode="processed_logprobs",
        )  # fmt: skip

    def fresh(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generated:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(
            n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens, ignore_eos=self.fixed, logprobs=0
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        completions = [list(output.outputs[0].token_ids) for output in outputs]

        def rows() -> list[list[float]]:  # with logprobs=0 each position holds the sampled token's entry alone
            return [
                [position[token].logprob for position, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
                for output, tokens in zip(outputs, completions, strict=True)
            ]

        return Generated(completions, rows)

    def memory(self) -> dict:
        """Its KV cache (blocks x block size tokens) and its budget, a share of the whole device's memory."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks and cache.block_size else None
        return {
            "kv_cache_tokens": tokens,
            "kv_cache_gib": tokens * self.kv_bytes_per_token / 2**30 if tokens else None,
            "budget_share": self.memory_fraction,
        }


class ContinuousBatchingPeer:
    name = "cb"

    def __init__(self, folder: Path, rows: int, fixed: bool, device: str, max_new_tokens: int,
                 cb_config: dict | None = None, **_) -> None:  # fmt: skip
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.device = device
        model = load_model(folder, device)
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(), use_transformers_continuous_batching=True, max_completion_length=max_new_tokens,
            num_generations=GROUP, per_device_train_batch_size=GROUP, temperature=1.0, bf16=device == "cuda",
            use_cpu=device != "cuda", report_to=[], generation_kwargs={"eos_token_id": -1} if fixed else None,
            transformers_continuous_batching_config=cb_config,
        )  # fmt: skip
        self.trainer = GRPOTrainer(
            model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
            train_dataset=Dataset.from_dict({"prompt": ["-"] * GROUP}),
            processing_class=AutoTokenizer.from_pretrained(folder),
        )  # fmt: skip
        self.budget_gib = self.trainer.continuous_batching_config.max_memory_percent * free / 2**30
        self.finished = self._record_finish_times(model)

    @staticmethod
    def _record_finish_times(model) -> list:
        """The last call's requests' finish times (their lifespans' ends), read from what `generate_batch` returns
        before TRL keeps only the tokens."""
        finished: list = []
        generate_batch = model.generate_batch

        def recording(*args, **kwargs):
            outputs = generate_batch(*args, **kwargs)
            finished[:] = [output.lifespan[1] for output in outputs.values()]
            return outputs

        model.generate_batch = recording
        return finished

    def fresh(self) -> None:
        """TRL builds a new manager in every call: nothing carries over."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Generated:
        self.trainer.generation_config.max_new_tokens = max_new_tokens
        completions, _ = self.trainer._generate_single_turn(prompts, None, {}, GROUP)  # its end token kept
        return Generated(completions, None, {"tail_s": tail_seconds(self.finished)})

    def memory(self) -> dict:
        return {**torch_memory(self.device), "budget_gib": self.budget_gib} if self.device == "cuda" else {}


def tail_seconds(finish_times: list[float]) -> float | None:
    """Time from the moment fewer than TAIL_SHARE of the rows were still running to the last row's end (every row
    starts at the call's start)."""
    if not finish_times:
        return None
    ends = sorted(finish_times)
    return ends[-1] - ends[-math.ceil(TAIL_SHARE * len(ends))]


def tail_steps(lengths: list[int]) -> int:
    """Decode steps with fewer than TAIL_SHARE of the rows running, every row decoding from the first step until it
    ends: from the end of the k-th longest completion (k the rows that make that share) to the longest's end."""
    ordered = sorted(lengths, reverse=True)
    return ordered[0] - ordered[math.ceil(TAIL_SHARE * len(ordered)) - 1]


ENGINES = {"paged": PagedPeer, "vllm": VllmPeer, "cb": ContinuousBatchingPeer}
