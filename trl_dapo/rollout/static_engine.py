"""A static-KV-cache decoder for Llama-family models (Llama, Qwen2, Qwen3, Mistral) that returns sampled logprobs.

TRL's default `generate` path is launch-bound: hundreds of small kernels and Python work per decoded token. Here the
weights are snapshotted once per generation batch (bf16 on CUDA, LoRA merged, q/k/v and gate/up fused), the KV cache
is preallocated, and on CUDA one whole decode step — forward, sampling, cache and bookkeeping updates — is captured
as a CUDA graph and replayed per token. On CUDA the decoder layer and the sampling head of that step are also
compiled (`torch.compile`), which fuses norms, rotary embedding, cache writes, softmax and activations: a graph
replays kernels without launch cost, but each small kernel still costs a few microseconds, and unfused they dominate
the step. Sampling is Gumbel-max over `logits / temperature` (the same distribution as softmax sampling) with
optional top-k / top-p; the logprob returned for each sampled token is `log_softmax(logits / temperature)`, the
quantity TRL's training forward computes, so it is the old policy directly.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from .sampling import SamplingSettings, pick_tokens, sampling_noise
from .weights import WeightSnapshot, gather_nothing

logger = logging.getLogger(__name__)

MIN_BATCH_BUCKET = 16


class StaticRolloutEngine:
    """Generate completions and their logprobs from left-padded prompts with a preallocated cache."""

    def __init__(
        self,
        model,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        dtype: torch.dtype,
        cuda_graph: bool,
        bucket_rows: bool | None = None,
        compile_decode: bool | None = None,
        device: torch.device | None = None,
        gather=gather_nothing,
    ):
        self.snapshot = WeightSnapshot(model, dtype, device=device, gather=gather)
        self.config = self.snapshot.config
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.dtype, self.cuda_graph = dtype, cuda_graph
        self.bucket_rows = cuda_graph if bucket_rows is None else bucket_rows
        self.num_heads = self.config.num_attention_heads
        self.num_kv_heads = getattr(self.config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.num_heads
        self.eps = self.config.rms_norm_eps
        self._graph_key = None
        self._decode_layer, self._pick_function = self._layer, pick_tokens
        if self._can_compile(cuda_graph if compile_decode is None else compile_decode):
            # one compile of the layer serves every layer (same shapes); the sampling head fuses its vocabulary passes
            self._decode_layer = torch.compile(self._layer, fullgraph=True)
            self._pick_function = torch.compile(pick_tokens, fullgraph=True)
        self.device, self._rotary = self.snapshot.device, self.snapshot.rotary
        self.embed, self.final_norm = self.snapshot.embed, self.snapshot.final_norm
        self.lm_head, self.layers = self.snapshot.lm_head, self.snapshot.layers
        self.weights = self.snapshot.tensors

    def _can_compile(self, wanted: bool) -> bool:
        from torch.utils._triton import has_triton

        if wanted and self.cuda_graph and not has_triton():
            logger.warning("Triton is not installed: the rollout engine decodes with unfused kernels.")
            return False
        return wanted

    def sync_weights(self, model) -> None:
        """Copy the training weights into the snapshot the captured graph reads (once per generation batch)."""
        self.snapshot.sync(model)

    def _rope_tables(self, length: int) -> None:
        if getattr(self, "_rope_length", 0) >= length:
            return
        positions = torch.arange(length, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, device=self.device, dtype=torch.float32)
        cos, sin = self._rotary(probe, positions)
        self.cos, self.sin, self._rope_length = cos[0].to(self.dtype), sin[0].to(self.dtype), length

    # ------------------------------------------------------------------------------------------------ forward

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _forward(self, ids, positions, slots, key_mask, caches, layer_function=None):
        """Hidden state of the last position after writing k/v of `ids` (B, T) into cache slots `slots` (T,)."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (B, 1, T, D)
        layer_function = layer_function or self._layer
        for layer, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            x = layer_function(x, cos, sin, slots, key_mask, k_cache, v_cache, layer)
        return self._rms_norm(x[:, -1], self.final_norm)

    def _layer(self, x, cos, sin, slots, key_mask, k_cache, v_cache, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """One decoder layer on (B, T, hidden), writing its k/v into the cache at `slots`."""
        batch, steps, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self._rms_norm(x, layer["input_norm"])
        qkv = F.linear(h, layer["qkv_weight"], layer["qkv_bias"])
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(batch, steps, self.num_heads, self.head_dim)
        k = k.view(batch, steps, self.num_kv_heads, self.head_dim)
        if "q_norm" in layer:
            q, k = self._rms_norm(q, layer["q_norm"]), self._rms_norm(k, layer["k_norm"])
        q = self._rotate(q.transpose(1, 2), cos, sin)
        k = self._rotate(k.transpose(1, 2), cos, sin)
        v = v.view(batch, steps, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k_cache.index_copy_(2, slots, k)
        v_cache.index_copy_(2, slots, v)
        attention = self._attend(q, k_cache, v_cache, key_mask)
        x = x + F.linear(attention.transpose(1, 2).reshape(batch, steps, q_size), layer["o_weight"])
        gate, up = F.linear(self._rms_norm(x, layer["post_norm"]), layer["gate_up_weight"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer["down_weight"])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Grouped-query attention without repeating the cache: the query heads sharing a k/v head are batched
        against it. q (B, H, T, D), k/v (B, KV, L, D), key_mask (B, 1, T, L) -> (B, H, T, D)."""
        batch, heads, steps, dim = q.shape
        group = heads // self.num_kv_heads
        q = q.reshape(batch, self.num_kv_heads, group * steps, dim)
        scores = torch.matmul(q, k.transpose(2, 3)).float() * dim**-0.5
        scores = scores.view(batch, self.num_kv_heads, group, steps, -1).masked_fill(~key_mask.unsqueeze(1), -math.inf)
        weights = scores.softmax(dim=-1).to(v.dtype).view(batch, self.num_kv_heads, group * steps, -1)
        return torch.matmul(weights, v).view(batch, heads, steps, dim)

    def _sample(self, hidden: torch.Tensor, settings: SamplingSettings, step: torch.Tensor):
        """Next token and its logprob under `logits / temperature` (EOS suppressed before `min_new_tokens`)."""
        noise = sampling_noise(hidden.size(0), self.lm_head.size(0), settings, hidden.device)
        return self._pick_function(hidden, self.lm_head, noise, settings, self.eos, step)

    # ----------------------------------------------------------------------------------------------- generate

    def _allocate(self, batch: int, length: int, max_new: int) -> None:
        key = (batch, length, max_new)
        if getattr(self, "_buffers_key", None) == key:
            return
        shape = (batch, self.num_kv_heads, length, self.head_dim)
        self.caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in self.layers
        ]
        device = self.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch, length, dtype=torch.bool, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.out_tokens = torch.zeros(batch, max_new, dtype=torch.long, device=device)
        self.out_logps = torch.zeros(batch, max_new, dtype=torch.float32, device=device)
        self.eos = torch.tensor(self.eos_token_ids, device=device)
        self._buffers_key, self._graph_key, self._graph = key, None, None

    def _decode_step(self, settings: SamplingSettings) -> None:
        """One token for every row; every tensor it touches is a static buffer, so it can be graph-captured."""
        self.valid.index_fill_(1, self.slot, True)
        hidden = self._forward(
            self.tokens.unsqueeze(1),
            self.positions.unsqueeze(1),
            self.slot,
            self.valid[:, None, None, :],
            self.caches,
            self._decode_layer,
        )
        self._record(hidden, settings)

    def _record(self, hidden: torch.Tensor, settings: SamplingSettings) -> None:
        token, logp = self._sample(hidden, settings, self.step)
        token = torch.where(self.finished, torch.full_like(token, self.pad_token_id), token)
        self.out_tokens.index_copy_(1, self.step, token.unsqueeze(1))
        self.out_logps.index_copy_(1, self.step, logp.unsqueeze(1))
        self.finished |= torch.isin(token, self.eos)
        self.tokens.copy_(token)
        self.positions.add_(1)
        self.slot.add_(1)
        self.step.add_(1)

    def _decoder(self, settings: SamplingSettings):
        """The decode step as a callable: a CUDA graph replay when enabled, else the eager step."""
        if not self.cuda_graph:
            return lambda: self._decode_step(settings)
        key = (self._buffers_key, settings)
        if self._graph_key != key:
            # Warm-up and capture run at cache slot 0, which every prefill rewrites, so what they write into the
            # cache (NaN: no key is valid yet) never reaches a later step; `generate` resets the state afterwards.
            for tensor in self._state_tensors():
                tensor.zero_()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._decode_step(settings)  # warm-up outside capture (kernels, workspaces)
            torch.cuda.current_stream().wait_stream(stream)
            self.slot.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_step(settings)
            self._graph, self._graph_key = graph, key
        return self._graph.replay

    def _state_tensors(self) -> list[torch.Tensor]:
        return [
            self.tokens,
            self.positions,
            self.slot,
            self.step,
            self.valid,
            self.finished,
            self.out_tokens,
            self.out_logps,
        ]

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], settings: SamplingSettings
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Completion ids (cut after the first EOS, which is kept) and the logprob of each sampled token, as a
        (rows, max_new_tokens) float32 tensor on the engine's device, zero past each completion's end."""
        requested = len(prompt_ids)
        # Dynamic-sampling rounds come in many sizes: round the rows up to a power of two (filler rows repeat the
        # last prompt and are dropped) so a few captured graphs and caches serve them all.
        batch = max(MIN_BATCH_BUCKET, 2 ** math.ceil(math.log2(requested))) if self.bucket_rows else requested
        prompt_ids = list(prompt_ids) + [prompt_ids[-1]] * (batch - requested)
        prompt_width = max(map(len, prompt_ids))
        # Round the cache length up so graphs are reused across batches with slightly different prompt lengths.
        length = math.ceil((prompt_width + settings.max_new_tokens) / 64) * 64
        self._allocate(batch, length, settings.max_new_tokens)
        self._rope_tables(length)
        decode = self._decoder(settings)  # captured before the state is reset and the prefill fills it

        ids = torch.full((batch, prompt_width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros(batch, prompt_width, dtype=torch.bool)
        for row, prompt in enumerate(prompt_ids):
            ids[row, prompt_width - len(prompt) :] = torch.tensor(prompt)
            prompt_mask[row, prompt_width - len(prompt) :] = True
        ids, prompt_mask = ids.to(self.device), prompt_mask.to(self.device)
        positions = (prompt_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        for tensor in self._state_tensors():
            tensor.zero_()
        self.valid[:, :prompt_width] = prompt_mask
        causal = torch.ones(prompt_width, length, dtype=torch.bool, device=self.device).tril()
        key_mask = causal.unsqueeze(0) & self.valid.unsqueeze(1)
        # Rows that are all padding at a query position attend to nothing: let them see themselves to stay finite.
        key_mask |= torch.eye(prompt_width, length, dtype=torch.bool, device=self.device).unsqueeze(0)
        slots = torch.arange(prompt_width, device=self.device)
        hidden = self._forward(ids, positions, slots, key_mask.unsqueeze(1), self.caches)
        self.positions.copy_(positions[:, -1])
        self.slot.fill_(prompt_width - 1)  # _record advances it to the first decode slot
        self._record(hidden, settings)

        for step in range(1, settings.max_new_tokens):
            if step % 32 == 0 and bool(self.finished.all()):
                break
            decode()
        return self._collect(requested)

    def _collect(self, rows: int) -> tuple[list[list[int]], torch.Tensor]:
        tokens = self.out_tokens[:rows].cpu()
        is_eos = torch.isin(tokens, self.eos.cpu())
        lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, tokens.size(1))
        lengths = lengths.clamp(max=int(self.step.item()))
        completions = [tokens[row, :length].tolist() for row, length in enumerate(lengths.tolist())]
        columns = torch.arange(tokens.size(1), device=self.device)
        logprobs = self.out_logps[:rows] * (columns < lengths.to(self.device).unsqueeze(1))
        return completions, logprobs
