"""The generation engines `bench_peers.py` sets side by side, each built from one checkpoint folder for one shape and
called the same way: `generate(prompt ids, max_new_tokens, lengths) -> Generated` (completions, each with its end token
or at the cap; the engine's logprobs of them as one flat tensor, converted inside the call so that the conversion
counts in its time, or None; what the engine tells of the call). `lengths`: each row's exact length (every engine
then does the same work: no end token ends a row, each stops at its own length), or None for lengths to the end token
or `max_new_tokens`.

- `paged`: trl-dapo's `PagedRolloutEngine` on the folder's model (bf16 on CUDA), `max_rows` = the shape's rows, its
  memory budget `memory_fraction` of the device; exact lengths as per-row caps (`row_max_new_tokens`) with the end
  token blocked (`min_new_tokens` = the shape's maximum, the same in every call: the compiled sampling head
  specialises on it).
- `vllm`, `vllm_no_logprobs`: `vllm.LLM` on the folder, tuned for offline throughput as vLLM's own advice goes
  (`vllm_engine_kwargs`): `max_num_seqs` = the shape's rows, CUDA graphs captured up to that many sequences (vLLM's
  default stops at min(2 x max_num_seqs, 512)), async scheduling, at least 16,384 batched tokens, no detokenization
  (`detokenize=False`; with exact lengths no tokenizer at all); as TRL's colocate mode where a choice is TRL's (bf16,
  seed 0, `logprobs_mode="processed_logprobs"`), prefix caching on, `gpu_memory_utilization` = the paged engine's
  budget. Exact lengths are per-request `max_tokens` with `ignore_eos`. `vllm` returns the sampled tokens' logprobs
  (`logprobs=0`, as TRL asks, in vLLM's flat form), `vllm_no_logprobs` none. Before each measured call the prefix
  cache is emptied, as TRL empties it at every weight sync: no call finds an earlier call's prompts cached.
- `cb`: transformers' continuous batching as TRL 1.16 drives it: a `GRPOTrainer` with
  `use_transformers_continuous_batching=True` generates through its own `_generate_single_turn` (`generate_batch`
  with its generation config and `ContinuousBatchingConfig`, the memory share the other engines get on CUDA; a
  manager built, warmed up and torn down in every call). Exact lengths: no end token (`eos_token_id=-1`), each
  request's own `max_new_tokens` (the one argument `generate_batch` does not take per request, set on the requests as
  its manager receives them). It reports each row as it finishes (`report`), so a call cut off by a time limit still
  tells how many tokens it had completed. It returns no logprobs: TRL recomputes them with the training model.

vLLM is imported only where its engine is built: the other engines, the CPU and `--help` run without it; the
arguments it is built and called with are plain dictionaries (`vllm_engine_kwargs`, `vllm_sampling_kwargs`).
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from benchmarks.core.workload import kv_bytes_per_token

GROUP = 16  # rows per distinct prompt, as DAPO samples them
TAIL_SHARE = 0.25  # "few rows running": fewer than this share of the call's rows
VLLM_MIN_BATCHED_TOKENS = 16384  # vLLM's batched-token budget per step, at least (its default is smaller)


@dataclass
class Generated:
    """A call's completions (each ends with its end token, kept, or at its length) and what the engine tells of it."""

    completions: list[list[int]]
    logprobs: torch.Tensor | None  # float32, every completion's tokens one after the other; None: the engine has none
    stats: dict = field(default_factory=dict)


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

    def __init__(self, folder: Path, rows: int, memory_fraction: float, device: str, max_new_tokens: int, **_) -> None:
        from trl_dapo.rollout import PagedRolloutEngine

        self.device, self.memory_fraction, self.new_tokens = device, memory_fraction, max_new_tokens
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

    def generate(self, prompts: list[list[int]], max_new_tokens: int, lengths: list[int] | None = None) -> Generated:
        from trl_dapo.rollout import TokenSampling

        blocked = self.new_tokens if lengths is not None else 0  # exact lengths: no end token, in every call alike
        settings = TokenSampling(max_new_tokens, temperature=1.0, min_new_tokens=blocked)
        out = self.engine.generate(prompts, settings, row_max_new_tokens=lengths)
        counts = torch.tensor([len(c) for c in out.completions], device=out.logprobs.device)
        kept = torch.arange(out.logprobs.size(1), device=out.logprobs.device) < counts[:, None]
        return Generated(out.completions, out.logprobs[kept].cpu(), out.stats.as_dict())

    def memory(self) -> dict:
        if self.device != "cuda":
            return {}
        total = torch.cuda.get_device_properties(0).total_memory
        return {**torch_memory(self.device), "budget_gib": self.memory_fraction * total / 2**30}


def vllm_capture_sizes(rows: int) -> list[int]:
    """The decode batch sizes vLLM captures a CUDA graph for: its own default pattern (1, 2, 4, then steps of 8 up to
    256 and of 16 beyond), here continued up to `rows` and ending at it, so that every decode step of a call whose
    rows all run at once replays a graph (vLLM's default stops at min(2 x max_num_seqs, 512))."""
    pattern = [1, 2, 4, *range(8, 256, 8), *range(256, rows + 1, 16)]
    return sorted({size for size in pattern if size <= rows} | {rows})


def vllm_engine_kwargs(folder: Path, rows: int, memory_fraction: float, exact_lengths: bool) -> dict:
    """`vllm.LLM`'s arguments for offline throughput at `rows` sequences: every row in one batch (`max_num_seqs`),
    graphs captured up to it, async scheduling (the next step scheduled while the device runs this one), a
    batched-token budget of at least VLLM_MIN_BATCHED_TOKENS; TRL's choices where TRL makes one. With exact lengths
    nothing needs a tokenizer (token-id prompts, `ignore_eos`, no detokenization), so none is loaded."""
    graphs = {"cudagraph_capture_sizes": vllm_capture_sizes(rows), "max_cudagraph_capture_size": rows}
    return {
        "model": str(folder), "dtype": "bfloat16", "seed": 0, "gpu_memory_utilization": memory_fraction,
        "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True,
        "max_num_seqs": rows, "max_num_batched_tokens": max(VLLM_MIN_BATCHED_TOKENS, rows),
        "async_scheduling": True, "skip_tokenizer_init": exact_lengths,
        "compilation_config": graphs,
    }  # fmt: skip


def vllm_sampling_kwargs(rows: int, max_new_tokens: int, lengths: list[int] | None, logprobs: bool) -> list[dict]:
    """One `SamplingParams`' arguments per row: temperature 1, top-p 1, no top-k, no detokenization; with `lengths`
    each row's exact length (`max_tokens` with `ignore_eos`), else up to the end token or `max_new_tokens`; with
    `logprobs` the sampled token's logprob (`logprobs=0`) in vLLM's flat form (no object per token)."""
    common = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "detokenize": False}
    if logprobs:
        common.update(logprobs=0, flat_logprobs=True)
    if lengths is None:
        return [{**common, "max_tokens": max_new_tokens} for _ in range(rows)]
    return [{**common, "max_tokens": length, "ignore_eos": True} for length in lengths]


def vllm_logprobs(outputs) -> torch.Tensor:
    """The sampled tokens' logprobs of vLLM's outputs, flat: a flat output's column at once, else (an older vLLM's
    form) the sampled token's entry at each position."""
    rows = []
    for output in outputs:
        sample = output.outputs[0]
        column = getattr(sample.logprobs, "logprobs", None)
        if isinstance(column, list | np.ndarray) and len(column) == len(sample.token_ids):
            rows.append(torch.as_tensor(np.asarray(column, dtype=np.float32)))
        else:
            entries = zip(sample.logprobs, sample.token_ids, strict=True)
            rows.append(torch.tensor([position[token].logprob for position, token in entries], dtype=torch.float32))
    return torch.cat(rows) if rows else torch.zeros(0)


class VllmPeer:
    def __init__(
        self, folder: Path, rows: int, memory_fraction: float, exact_lengths: bool, logprobs: bool, **_
    ) -> None:
        from vllm import LLM

        self.logprobs, self.memory_fraction = logprobs, memory_fraction
        self.kv_bytes_per_token = kv_bytes_per_token(AutoConfig.from_pretrained(folder))
        self.llm = LLM(**vllm_engine_kwargs(folder, rows, memory_fraction, exact_lengths))

    def fresh(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, lengths: list[int] | None = None) -> Generated:
        from vllm import SamplingParams, TokensPrompt

        arguments = vllm_sampling_kwargs(len(prompts), max_new_tokens, lengths, self.logprobs)
        params = [SamplingParams(**kwargs) for kwargs in arguments]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        completions = [list(output.outputs[0].token_ids) for output in outputs]
        return Generated(completions, vllm_logprobs(outputs) if self.logprobs else None)

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

    def __init__(
        self, folder: Path, rows: int, exact_lengths: bool, device: str, max_new_tokens: int, memory_fraction: float,
        cb_config: dict | None = None, **_,
    ) -> None:  # fmt: skip
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.device = device
        model = load_model(folder, device)
        free = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(), use_transformers_continuous_batching=True, max_completion_length=max_new_tokens,
            num_generations=GROUP, per_device_train_batch_size=GROUP, temperature=1.0, bf16=device == "cuda",
            use_cpu=device != "cuda", report_to=[], generation_kwargs={"eos_token_id": -1} if exact_lengths else None,
            transformers_continuous_batching_config=cb_config or {"max_memory_percent": memory_fraction},
        )  # fmt: skip
        self.trainer = GRPOTrainer(
            model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
            train_dataset=Dataset.from_dict({"prompt": ["-"] * GROUP}),
            processing_class=AutoTokenizer.from_pretrained(folder),
        )  # fmt: skip
        self.budget_gib = self.trainer.continuous_batching_config.max_memory_percent * free / 2**30
        self.report: Callable[[int, int], None] = lambda rows, tokens: None  # rows and tokens finished so far
        self.finished = self._record_finish_times(model)
        self._lengths: dict[tuple[int, ...], deque[int]] = {}  # the call's exact lengths, by prompt, in row order
        model.init_continuous_batching = self._with_hooks(model.init_continuous_batching)

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

    def _with_hooks(self, init_continuous_batching):
        """`init_continuous_batching` whose manager gives each request its row's exact length (rows of one prompt
        are added in row order) and reports every finished row to `report`."""

        def init(*args, **kwargs):
            manager = init_continuous_batching(*args, **kwargs)
            add_request, get_result = manager.add_request, manager.get_result
            done = {"rows": 0, "tokens": 0}

            def add(input_ids, **options):
                waiting = self._lengths.get(tuple(input_ids))
                if waiting:
                    options["max_new_tokens"] = waiting.popleft()
                return add_request(input_ids, **options)

            def result(*args, **kwargs):
                output = get_result(*args, **kwargs)
                if output is not None and output.is_finished():
                    done["rows"] += 1
                    done["tokens"] += len(output.generated_tokens)
                    self.report(done["rows"], done["tokens"])
                return output

            manager.add_request, manager.get_result = add, result
            return manager

        return init

    def fresh(self) -> None:
        """TRL builds a new manager in every call: nothing carries over."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, lengths: list[int] | None = None) -> Generated:
        self.trainer.generation_config.max_new_tokens = max_new_tokens
        self._lengths = {}
        for prompt, length in zip(prompts, lengths or [], strict=lengths is not None):
            self._lengths.setdefault(tuple(prompt), deque()).append(length)
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


ENGINES = {
    "paged": PagedPeer,
    "vllm": functools.partial(VllmPeer, logprobs=True),
    "vllm_no_logprobs": functools.partial(VllmPeer, logprobs=False),
    "cb": ContinuousBatchingPeer,
}
