"""A continuous-batching rollout engine over a paged KV cache for decoder-only models, returning sampled logprobs.

DAPO's rollouts are long and uneven (lengths geometric-like up to tens of thousands of tokens), and dynamic sampling
multiplies them. Decoding a static batch until its longest row ends wastes most of the work on finished rows, and a
cache preallocated at rows x maximum length runs out of memory. Here:

- a fixed pool of decode slots is refilled from the waiting rows as rows finish (`scheduler.py`, driven by each
  call's `Generation`, `generation.py`), so a call costs its total tokens rather than rows x its longest row, and
  any number of rows completes;
- the KV cache is a pool of pages sized from a memory budget; rows of one prompt share its pages, prefilled once;
  when pages run out the latest rows are preempted and recomputed later; rows a stream leaves decoding can keep
  their pages' KV for a later stream to continue them from (`kept.py`, partial rollouts);
- decode attention reads only each row's filled pages (`paged_attention.py`), prefill uses PyTorch's
  memory-efficient scaled-dot-product attention;
- on CUDA one decode step (all layers, sampling, bookkeeping) is a CUDA graph per slot-count bucket (powers of two),
  replayed `sync_every` times between host synchronisations; the per-layer norms, activations and q/k/v and gate/up
  projections and the sampling head are compiled with `torch.compile`.

The weights are a bf16 snapshot of the training model (`weights.py`, LoRA merged), refreshed in place once per
generation batch; the KV cache and the decoder layers' linear weights can be FP8 (`fp8.py`). What differs between
model families (a layer's weight names, q/k norms, the MLP's activation, the rotary tables) is the model's
architecture (`architectures/`); the layer loops here are shared. The logprob of each
sampled token is `log_softmax(logits / temperature)` (`token_sampling.py`): the old policy of the DAPO ratio.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from ..models import base_model
from .architectures import architecture_for
from .fp8 import (
    FP8_LINEARS,
    KV_CACHE_DTYPES,
    WEIGHTS_DTYPES,
    LayerCache,
    cache_bytes_per_token,
    fp8_linear,
    fp8_unsupported_reason,
    linear,
    quantize_linears,
)
from .generation import DeviceTimer, Generation, GenerationOutput, RolloutStats, on_side_stream, slot_bucket
from .kept import KeptBytes, KeptRow, pool_room
from .paged_attention import rms_norm, rotated_heads, triton
from .token_sampling import TokenSampling, pick_tokens, stop_table
from .weights import WeightSnapshot, gather_nothing

logger = logging.getLogger(__name__)

ATTENTION_KERNELS = ("triton", "reference")


class PagedRolloutEngine:
    """Generate completions and their logprobs for any number of prompts within a memory budget.

    `attention_kernel` picks the decode attention: "triton" (CUDA; the default there when Triton is installed) or
    "reference" (PyTorch's, the default elsewhere). Besides `generate` and `stream`, benchmarks read `architecture`
    (the model family's `DecoderArchitecture`), `snapshot` (the weights; `snapshot.layers[i]` by the names
    `architectures/base.py` lists), `attention_kernel`, `cos` / `sin` (rotary tables by position, built by the first
    call), `down_bias` and `sample_tokens`.
    """

    def __init__(
        self,
        model,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        dtype: torch.dtype,
        cuda_graph: bool,
        memory_fraction: float = 0.85,
        max_rows: int = 1024,
        max_cache_tokens: int | None = None,
        page_size: int = 16,
        sync_every: int = 32,
        prefill_tokens: int = 16384,
        compile_decode: bool | None = None,
        attention_kernel: str | None = None,
        show_progress: bool = False,
        device: torch.device | None = None,
        gather=gather_nothing,
        kv_cache_dtype: str = "bf16",
        weights_dtype: str = "bf16",
    ) -> None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1].")
        if max_rows < 1 or page_size < 1 or sync_every < 1 or prefill_tokens < 1:
            raise ValueError("max_rows, page_size, sync_every and prefill_tokens must be positive.")
        if attention_kernel not in (None, *ATTENTION_KERNELS):
            raise ValueError(f"attention_kernel={attention_kernel!r} must be one of {ATTENTION_KERNELS} or None.")
        self.architecture = architecture_for(base_model(model))
        self.snapshot = WeightSnapshot(model, dtype, self.architecture, device=device, gather=gather)
        self._set_fp8(kv_cache_dtype, weights_dtype)
        config = self.snapshot.config
        self.device, self.dtype, self.cuda_graph = self.snapshot.device, dtype, cuda_graph
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.memory_fraction, self.max_rows, self.max_cache_tokens = memory_fraction, max_rows, max_cache_tokens
        self.kept = KeptBytes()  # the KV this engine's streams kept that is still held (`kept.py`)
        self.page_size, self.sync_every, self.prefill_tokens = page_size, sync_every, prefill_tokens
        self.show_progress = show_progress
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = self.snapshot.lm_head.size(0)
        self.stop_table = stop_table(self.eos_token_ids, self.vocab_size, self.device)
        self._rope_length = 0
        self.warm_steps: set[tuple] = set()  # (bucket, settings) whose decode step has run (compiled, kernels chosen)
        # decode attention: the Triton kernel on CUDA where installed, else the PyTorch reference (it reads the pages
        # of the longest row at the last synchronisation, a length a CUDA graph would freeze at its capture)
        triton_runs = self.device.type == "cuda" and triton is not None
        if attention_kernel == "triton" and not triton_runs:
            raise ValueError("attention_kernel='triton' needs a CUDA device and Triton installed.")
        self.attention_kernel = attention_kernel or ("triton" if triton_runs else "reference")
        self._attention_inputs, self._decode_qkv, self._layer_output = self._qkv, self._normed_qkv, self._mlp
        self._final_norm, self._pick = self._residual_norm, pick_tokens
        self._fp8_output = fp8_linear
        self._down_biases: dict[int, torch.Tensor | None] = {}  # decode rows -> the down projection's bias argument
        wanted = cuda_graph if compile_decode is None else compile_decode
        if wanted and self.device.type == "cuda" and triton is None:
            logger.warning("Triton is not installed: the rollout engine decodes with unfused kernels.")
        elif wanted:
            # one compile serves every row count, cache size and prefill chunk (the sizes that vary are symbolic; a
            # compile specialised to them would recompile inside the next call, whose pool differs), and every layer
            # but the first, which has no delta to add and its own; the sampling head fuses its vocabulary passes
            self._attention_inputs = _compile_with_rows(self._qkv, tuple(range(9)))  # x, delta, cos, ... scales
            # decode compiles the projection alone: the attention kernel rotates q and k and writes the cache
            self._decode_qkv = _compile_with_rows(self._normed_qkv, (0, 1))
            self._layer_output = _compile_with_rows(self._mlp, (0, 1))
            self._final_norm = _compile_with_rows(self._residual_norm, (0, 1))
            self._pick = _compile_with_rows(pick_tokens, (0, 2, 5))  # hidden, noise, generated
            # FP8 weights: the output projection's activation quantisation fused (eager, six kernels a layer)
            self._fp8_output = _compile_with_rows(fp8_linear, (0,))

    def _set_fp8(self, kv_cache_dtype: str, weights_dtype: str) -> None:
        """FP8 (`fp8.py`) for the KV cache and / or the decoder layers' linear weights ("bf16": the engine's dtype),
        where the device runs it: the weights need FP8 tensor cores, the cache Triton's e4m3 on CUDA (the CPU's
        reference attention reads an FP8 cache too)."""
        for name, value, choices in (
            ("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES),
            ("weights_dtype", weights_dtype, WEIGHTS_DTYPES),
        ):
            if value not in choices:
                raise ValueError(f"{name}={value!r} must be one of {choices}.")
        reason = fp8_unsupported_reason(self.snapshot.device)
        if reason is not None and (
            weights_dtype == "fp8" or (kv_cache_dtype == "fp8" and self.snapshot.device.type == "cuda")
        ):
            name = "weights_dtype" if weights_dtype == "fp8" else "kv_cache_dtype"
            raise ValueError(f"{name}='fp8' cannot run here: {reason}; use 'bf16'.")
        self.fp8_kv_cache, self.fp8_weights = kv_cache_dtype == "fp8", weights_dtype == "fp8"
        if self.fp8_weights:
            shapes = {tuple(self.snapshot.layers[0][name].shape) for name in FP8_LINEARS}
            if any(size % 16 for shape in shapes for size in shape):
                raise ValueError(f"weights_dtype='fp8' needs the linear layers' sizes in multiples of 16: {shapes}.")
            quantize_linears(self.snapshot.layers)

    def sync_weights(self, model) -> None:
        """Copy the training weights into the snapshot the engine reads (once per generation batch), and quantise
        the copy in place with FP8 weights."""
        self.snapshot.sync(model)
        if self.fp8_weights:
            quantize_linears(self.snapshot.layers)

    # -------------------------------------------------------------------------------------------- model math

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def _residual_norm(self, x, delta, weight: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x if delta is None else x + delta, weight)

    def _normed_qkv(self, x, delta, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k/v projection (T, (heads + 2 kv_heads) head_dim) of tokens x + delta (T, hidden; `delta` the
        previous layer's MLP output, or None), and x + delta. The residual add of the previous layer is done here,
        fused with the norm that reads it: done after the down projection it is a matrix product that first copies x
        to its output (a copy kernel per layer)."""
        if delta is not None:
            x = x + delta
        return linear(self._rms_norm(x, layer["input_norm"]), layer, "qkv_weight", layer["qkv_bias"]), x

    def _qkv(self, x, delta, cos, sin, slots, k_cache, v_cache, k_scale, v_scale, layer: dict[str, torch.Tensor]):
        """Rotated q, k, v of tokens x + delta under their positions' rotary `cos`, `sin` (T, head_dim), and
        x + delta (see `_normed_qkv`); k and v are also written to cache `slots` (quantised where the cache is: its
        scales are not None). The returned k and v are the unquantised ones, which the prefill attends to."""
        qkv, x = self._normed_qkv(x, delta, layer)
        qk_norm = self.architecture.qk_norm(layer)
        q, k, v = rotated_heads(qkv, cos, sin, self.num_heads, self.num_kv_heads, qk_norm, self.eps)
        LayerCache(k_cache, v_cache, k_scale, v_scale).write(slots, k, v)
        return q, k, v, x

    def _mlp(self, x, attention_out, layer: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """After the output projection: the residual x + attention_out, and the MLP's input to its down projection
        (run outside, `_down_projection`; the next layer adds its output to the residual)."""
        x = x + attention_out
        return x, self.architecture.mlp(self._rms_norm(x, layer["post_norm"]), layer)

    @staticmethod
    def _down_projection(hidden: torch.Tensor, layer: dict[str, torch.Tensor], bias: torch.Tensor | None = None):
        return linear(hidden, layer, "down_weight", bias)

    def down_bias(self, rows: int) -> torch.Tensor | None:
        """The bias the decode step's down projection is called with at `rows` rows: None, or zeros where that is
        faster. Given a bias, cuBLAS runs the product through cuBLASLt, whose split-K kernels read some long weights
        faster at decode rows and others slower (H200, 2026-12-03: Qwen2.5-7B's down projection at 64 rows 37.7 vs
        40.8 us, Qwen2.5-1.5B's at 128 rows 16.2 vs 12.7 us), so with CUDA graphs both are timed once per row count,
        over every layer's weight in a graph as the decode step runs them, alternately, best of three each. Near a
        tie the choice can differ between machines, and with it the products' rounding."""
        if rows in self._down_biases:
            return self._down_biases[rows]
        if not self.cuda_graph:
            return None
        outputs, inputs = self.snapshot.layers[0]["down_weight"].shape
        zeros = torch.zeros(outputs, dtype=self.dtype, device=self.device)
        generator = torch.Generator(self.device).manual_seed(0)  # the sampling noise's generator is left alone
        hidden = torch.randn(rows, inputs, dtype=self.dtype, device=self.device, generator=generator)

        def products(bias: torch.Tensor | None) -> None:
            for layer in self.snapshot.layers:
                self._down_projection(hidden, layer, bias)

        without, with_bias = [], []
        for _ in range(3):
            without.append(_graph_seconds(lambda: products(None)))
            with_bias.append(_graph_seconds(lambda: products(zeros)))
        self._down_biases[rows] = zeros if min(with_bias) < 0.98 * min(without) else None
        return self._down_biases[rows]

    def _output_projection(self, attention: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """(..., heads, head_dim) attention output to (T, hidden), outside the compiled layer: its input is often a
        view, whose base the compiled code would guard on (and recompile for), and a bf16 product is not fused. FP8
        weights compile the product on a contiguous copy, so that its activations' quantisation fuses."""
        x = attention.reshape(-1, attention.size(-2) * attention.size(-1))
        if self.fp8_weights:
            return self._fp8_output(x.contiguous(), layer["o_weight_fp8"], layer["o_weight_scale"])
        return torch.nn.functional.linear(x, layer["o_weight"])

    def _rope_tables(self, length: int) -> bool:
        """cos/sin tables for positions below `length`, at least the model's own maximum (built once); whether they
        were rebuilt (graphs captured over the previous ones are then stale)."""
        if self._rope_length >= length:
            return False
        length = max(length, getattr(self.snapshot.config, "max_position_embeddings", 0) or 0)
        cos, sin = self.architecture.rotary_tables(length, self.device)
        self.cos, self.sin, self._rope_length = cos.to(self.dtype), sin.to(self.dtype), length
        return True

    def sample_tokens(
        self, hidden: torch.Tensor, noise: torch.Tensor | None, settings: TokenSampling, generated: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling head as the decode step runs it (compiled where the decode step is): each row's next token
        and its logprob from its final-norm hidden state, its `sampling_noise` and its tokens generated so far."""
        return self._pick(hidden, self.snapshot.lm_head, noise, settings, self.stop_table, generated)

    # ---------------------------------------------------------------------------------------------- generate

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], settings: TokenSampling, row_max_new_tokens: list[int] | None = None
    ) -> GenerationOutput:
        """Completions of `prompt_ids` and their logprobs. `row_max_new_tokens`: each row's own cap (at most
        `settings.max_new_tokens`), so that callers comparing engines can give every engine the same per-row lengths:
        with `min_new_tokens = max_new_tokens` no stop token is sampled and each row ends exactly at its cap."""
        if not prompt_ids or any(len(prompt) == 0 for prompt in prompt_ids):
            raise ValueError("generate needs at least one prompt, and no prompt may be empty.")
        if settings.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={settings.max_new_tokens} must be at least 1.")
        if row_max_new_tokens is not None and (
            len(row_max_new_tokens) != len(prompt_ids)
            or not all(1 <= cap <= settings.max_new_tokens for cap in row_max_new_tokens)
        ):
            raise ValueError(
                f"row_max_new_tokens: one cap per prompt ({len(prompt_ids)}), each from 1 to max_new_tokens="
                f"{settings.max_new_tokens}; got {len(row_max_new_tokens)} caps from {min(row_max_new_tokens, default=0)}"
                f" to {max(row_max_new_tokens, default=0)}."
            )
        return Generation(self, prompt_ids, settings, row_max_new_tokens=row_max_new_tokens).run()

    @torch.no_grad()
    def stream(
        self,
        prompt_ids: list[list[int]],
        settings: TokenSampling,
        resumed: list[tuple[list[int], torch.Tensor]] | None = None,
        keep_room: int = 0,
    ) -> RolloutStream:
        """A generation call that takes more prompts while it decodes (streaming dynamic sampling), starting with
        `prompt_ids` (`resumed`: as in `RolloutStream.add`); its decode slots are `max_rows`. `keep_room`: bytes its
        pool leaves free for the KV its end keeps (`RolloutStream.keep`, at most that many)."""
        if not prompt_ids or any(len(prompt) == 0 for prompt in prompt_ids):
            raise ValueError("stream needs at least one prompt to start, and no prompt may be empty.")
        if settings.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={settings.max_new_tokens} must be at least 1.")
        return RolloutStream(self, prompt_ids, settings, resumed, keep_room)

    def memory_bytes(self) -> int:
        """The device's memory (the host's for the CPU): what a share such as the kept cache's budget is of."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def cache_bytes_per_token(self) -> int:
        layers = len(self.snapshot.layers)
        return cache_bytes_per_token(layers, self.num_kv_heads, self.head_dim, self.dtype, self.fp8_kv_cache)

    def _workspace_bytes(self, slots: int) -> int:
        """Upper estimate of what a decode step of `slots` rows and a prefill chunk allocate beyond the cache."""
        config, element = self.snapshot.config, self.dtype.itemsize
        sampling = slots * self.vocab_size * 4 * 8  # logits, tempered, log-softmax, noise, sort keys and indices
        decode = slots * (6 * config.hidden_size + 3 * config.intermediate_size) * element
        prefill = self.prefill_tokens * (
            8 * config.hidden_size + 4 * config.intermediate_size + 6 * self.num_heads * self.head_dim
        ) * element  # fmt: skip
        return int(1.25 * (sampling + decode + prefill))

    def cache_pages(self, prompt_ids: list[list[int]], max_new_tokens: int) -> int:
        """KV pages for one call: what every row could hold at once, at most what the budget and
        `max_cache_tokens` allow."""
        unique_prompt_tokens = sum(len(prompt) for prompt in {tuple(p) for p in prompt_ids})
        wanted = unique_prompt_tokens + len(prompt_ids) * (max_new_tokens + 2 * self.page_size)
        if self.max_cache_tokens is not None:
            wanted = min(wanted, self.max_cache_tokens)
        return self._budget_pages(math.ceil(wanted / self.page_size), len(prompt_ids), max_new_tokens)

    def stream_pages(self, longest_prompt: int, rows: int, max_new_tokens: int, keep_room: int = 0) -> int:
        """KV pages for a stream: its `max_rows` slots at once with prompts `longest_prompt` tokens long, at most what
        the budget and `max_cache_tokens` allow for a call with `rows` output rows, `keep_room` bytes left free."""
        at_once = self.max_rows * (longest_prompt + max_new_tokens + 2 * self.page_size)
        if self.max_cache_tokens is not None:
            at_once = min(at_once, self.max_cache_tokens)
        return self._budget_pages(math.ceil(at_once / self.page_size), rows, max_new_tokens, keep_room)

    def _budget_pages(self, pages: int, rows: int, max_new_tokens: int, keep_room: int = 0) -> int:
        """`pages`, at most what the memory budget leaves for the KV cache of a call with `rows` output rows, with
        `keep_room` bytes left free for the KV the call's end keeps (`pool_room`)."""
        if self.device.type == "cuda":
            slots = slot_bucket(min(rows, self.max_rows), self.max_rows)
            outputs = (rows + 1) * max_new_tokens * 8
            free = pool_room(self.budget_left(), self.kept.bytes, keep_room) - self._workspace_bytes(slots) - outputs
            pages = min(pages, int(free // (self.page_size * self.cache_bytes_per_token())) - 1)
        return pages

    def budget_left(self) -> float:
        """Bytes the process may still allocate under `memory_fraction` of the device (unbounded off CUDA, where the
        budget is not applied): what a new KV pool, or a kept copy of one's pages beside it, may take."""
        if self.device.type != "cuda":
            return math.inf
        return self.memory_fraction * self.memory_bytes() - torch.cuda.memory_allocated(self.device)


def _compile_with_rows(function, row_arguments: tuple[int, ...]):
    """`torch.compile(function)` with the first dimension of the positional tensor arguments `row_arguments` (tokens,
    rows, cache slots) symbolic from the first call; every other size stays specialised, also when engines of other
    models share the compiled code: by default a second model's sizes would turn the model dimensions symbolic (the
    7B decode step ran 6% slower after a 0.5B engine in the same process)."""
    compiled = torch.compile(function, fullgraph=True)

    def call(*args):
        for index in row_arguments:
            if isinstance(args[index], torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(args[index], 0)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            return compiled(*args)

    return call


def _graph_seconds(function, replays: int = 3) -> float:
    """Device seconds per call of `function` replayed as a CUDA graph (captured after one warm-up call)."""
    on_side_stream(function)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


class RolloutStream:
    """One generation call fed while it runs: `add` queues rows of new prompts (refilling slots as rows end), `step`
    decodes up to `sync_every` tokens per running row and reports the rows that ended, `outputs` reads them.

    Its decode slots are the engine's `max_rows`; the KV pool is sized for that many rows at once with prompts as long
    as the longest first one (within the memory budget; rows wait or are preempted beyond it); the output buffers
    double when rows outgrow them (captured graphs are then captured again). Rows are never cut: the caller stops
    stepping (dropping what is in flight, or keeping its KV with `keep` for a later stream's `adopt`) or steps until
    `idle` (finishing it).
    """

    def __init__(
        self,
        engine: PagedRolloutEngine,
        prompt_ids: list[list[int]],
        settings: TokenSampling,
        resumed: list[tuple[list[int], torch.Tensor]] | None = None,
        keep_room: int = 0,
    ) -> None:
        rows = max(len(prompt_ids), engine.max_rows)  # output rows allocated (grown by `add`); all slots usable
        pages = engine.stream_pages(max(map(len, prompt_ids)), rows, settings.max_new_tokens, keep_room)
        self._generation = Generation(engine, prompt_ids, settings, capacity=rows, num_pages=max(pages, 0))
        self._timer = DeviceTimer(engine.device)
        self._open = set(range(len(prompt_ids)))  # rows added and not yet reported as ended
        self._generation.resume(list(range(len(prompt_ids))), resumed)

    @property
    def stats(self) -> RolloutStats:
        return self._generation.stats

    @property
    def rows(self) -> int:
        """Rows added so far."""
        return self._generation.stats.rows

    @property
    def idle(self) -> bool:
        """No row waits or decodes."""
        return self._generation.done

    def add(
        self, prompt_ids: list[list[int]], resumed: list[tuple[list[int], torch.Tensor]] | None = None
    ) -> list[int]:
        """Queue rows (a prompt repeated for each of its samples shares one prefill); returns their row indices.
        `resumed`: per row, tokens already sampled (by an earlier policy) and their logprobs, or empty ones: such a
        row continues after them, its KV recomputed under the current weights, its old logprobs kept as they were."""
        self._check_open()
        if not prompt_ids or any(len(prompt) == 0 for prompt in prompt_ids):
            raise ValueError("add needs at least one prompt, and no prompt may be empty.")
        rows = self._generation.add_rows(prompt_ids, resumed)
        self._open.update(rows)
        return rows

    @torch.no_grad()
    def step(self) -> list[int]:
        """Admit waiting rows, decode up to `sync_every` steps, synchronise; the rows that ended since the last step
        (none once idle)."""
        self._check_open()
        if not self._generation.done:
            self._generation.step(self._timer)
        ended = sorted(self._open - self._generation.unfinished_rows())
        self._open -= set(ended)
        return ended

    def _check_open(self) -> None:
        if self._generation.released:
            raise RuntimeError("the stream is closed: its KV pool is freed, no row decodes again.")

    def keep(self, rows: list[int], max_bytes: int) -> dict[int, KeptRow]:
        """Copy the KV of those of `rows` still decoding out of the pool, within `max_bytes` (`kept.py`): by row, what
        a later stream's `adopt` continues them from after `close` frees the pool. Rows not returned have none kept."""
        self._check_open()
        return self._generation.keep(rows, max_bytes)

    def adopt(self, rows: list[int], kept: list[KeptRow]) -> int:
        """Resumed rows just added (`add` or the stream's first rows, with their tokens in `resumed`) continue from
        their kept KV instead of a prefill, where a slot and pages are free; returns how many did."""
        self._check_open()
        return self._generation.adopt(rows, kept)

    def outputs(self, rows: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Completions of `rows` (each cut after its EOS; an unfinished row's tokens so far, at the last step's
        synchronisation) and their logprobs, (len(rows), max_new_tokens) on the engine's device, zero past each
        completion."""
        return self._generation.read(rows)

    def close(self) -> RolloutStats:
        """The call's statistics, with the rows left unfinished. Frees the KV pool and the captured graphs now, not
        when the stream is collected: a reference the caller still holds (or a cycle through it) would otherwise keep
        a pool sized for every slot alive through the training passes that follow. Read outputs before closing."""
        scheduler = self._generation.scheduler
        unfinished = [*scheduler.running, *scheduler.waiting]
        stats = self._generation.finish_stats(self._timer)
        stats.unfinished_rows, stats.unfinished_tokens = len(unfinished), int(scheduler.generated[unfinished].sum())
        self._generation.release()
        return stats
