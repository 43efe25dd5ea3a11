"""One generation call of the paged engine: its KV pool, decode slots, CUDA graphs and outputs, and the loop that
drives the scheduler (admit and prefill waiting rows, decode `sync_every` steps, synchronise, retire, preempt).

The engine (`paged_engine.py`) holds the weights and the per-layer math; a `Generation` holds what lives for one
`generate` call or one `RolloutStream` and is freed with it. It reads the engine through `EngineView`
(`engine_view.py`): the engine imports this module, never the other way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .engine_view import EngineView
from .fp8 import LayerCache
from .kept import KeptCache, KeptRow, choose_pages, page_slots
from .paged_attention import num_splits, reference_decode_attention, triton_decode_attention
from .scheduler import Prefix, Scheduler
from .token_sampling import TokenSampling, sampling_noise

MIN_SLOT_BUCKET = 8
# A decode step with fewer than this share of the engine's `max_rows` slots busy is a step of the tail: a few long
# rows decoded one token at a time while the others have ended.
TAIL_BUSY_SHARE = 0.25


@dataclass
class RolloutStats:
    """What one `generate` call did (benchmarks and the trainer's metrics read it)."""

    rows: int = 0
    generated_tokens: int = 0  # every row's tokens at the end of the call, a resumed row's earlier ones included
    decode_steps: int = 0
    tail_decode_steps: int = 0  # of those, steps with fewer than TAIL_BUSY_SHARE of the `max_rows` slots busy
    slot_steps: int = 0  # sum over decode steps of the decode batch's slots
    busy_slot_steps: int = 0  # of those, slots whose row was still generating
    pool_slot_steps: int = 0  # sum over decode steps of the engine's `max_rows` slots (busy / this: occupancy)
    prefill_tokens: int = 0
    resumed_rows: int = 0  # rows that continued after tokens an earlier call sampled (partial rollouts)
    resumed_tokens: int = 0  # those earlier tokens (in `generated_tokens`: this call generated the rest)
    resumed_prefill_tokens: int = 0  # prompt and earlier tokens prefilled for resumed rows (in `prefill_tokens`)
    kept_cache_rows: int = 0  # of the resumed rows, those that continued from a kept cache (`kept.py`), unprefilled
    kept_cache_tokens: int = 0  # their prompts and earlier tokens: the prefill the kept cache saved
    kept_cache_bytes: int = 0  # the KV this call kept for rows it left decoding (held through the training step)
    unfinished_rows: int = 0  # rows still decoding or waiting when a stream closed (its caller carries or drops them)
    unfinished_tokens: int = 0  # the tokens those rows held
    preemptions: int = 0
    synchronisations: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cache_tokens: int = 0  # KV pool capacity
    peak_memory_bytes: int = 0  # the device's peak allocated memory at the end of the call (since its last reset)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class GenerationOutput(NamedTuple):
    completions: list[list[int]]  # each cut after its first EOS (kept)
    logprobs: torch.Tensor  # (rows, max_new_tokens) float32 on the engine's device, zero past each completion
    stats: RolloutStats


def tail_steps(decoded: np.ndarray, steps: int, slots: int) -> int:
    """Of `steps` decode steps between two synchronisations, those with fewer than TAIL_BUSY_SHARE of `slots` busy,
    given the tokens each live row `decoded` in them: a row decodes from the first step until it ends, so step j has
    as many busy rows as rows that decoded more than j tokens."""
    needed = math.ceil(TAIL_BUSY_SHARE * slots)  # busy rows a step needs to be out of the tail
    if len(decoded) < needed:
        return steps
    kth_most = int(np.partition(decoded, len(decoded) - needed)[len(decoded) - needed])
    return steps - min(steps, kth_most)


def slot_bucket(rows: int, max_rows: int) -> int:
    """Decode-batch size for `rows` live rows: the next power of two (at least MIN_SLOT_BUCKET), at most max_rows."""
    return min(max_rows, max(MIN_SLOT_BUCKET, 2 ** math.ceil(math.log2(max(rows, 1)))))


def on_side_stream(function) -> None:
    """Run `function` on a fresh stream, ordered after and before the current one: a warm-up before a CUDA graph
    capture (PyTorch's advice, so that lazy initialisation happens outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)


class _SlotState:
    """Device state of the decode slots; the first `bucket` entries of each tensor are one decode batch."""

    def __init__(self, slots: int, max_pages: int, device) -> None:
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)
        self.rows = torch.zeros(slots, dtype=torch.long, device=device)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.page_table = torch.zeros(slots, max_pages, dtype=torch.int32, device=device)

    def counters(self) -> list[torch.Tensor]:
        return [self.tokens, self.positions, self.generated, self.active]


class Generation:
    """One `generate` call: its KV pool, slots, graphs and outputs, and the loop that drives the scheduler."""

    def __init__(
        self,
        engine: EngineView,
        prompt_ids: list[list[int]],
        settings: TokenSampling,
        capacity: int | None = None,
        num_pages: int | None = None,
        row_max_new_tokens: list[int] | None = None,
    ) -> None:
        """`capacity`: output rows to allocate (a stream adds rows up to it; default: the prompts'); `num_pages`: the
        KV pool (default: sized for `prompt_ids`); `row_max_new_tokens`: each row's own cap (a `generate` call's rows
        only), else `settings.max_new_tokens` for every row."""
        self.engine, self.settings = engine, settings
        self.rows, self.max_new = capacity or len(prompt_ids), settings.max_new_tokens
        engine._rope_tables(max(map(len, prompt_ids)) + self.max_new)
        device, page_size = engine.device, engine.page_size
        if num_pages is None:
            num_pages = engine.cache_pages(prompt_ids, self.max_new)
        self.scheduler = Scheduler(
            prompt_ids, self.max_new, page_size, max(num_pages, 0), engine.max_rows, engine.sync_every
        )
        self.stats = RolloutStats(rows=len(prompt_ids), cache_tokens=num_pages * page_size)
        # one extra page at the end takes the writes of idle slots and padding; zeros, so that unwritten entries of a
        # page (read and masked out by the reference attention) are finite
        self.trash_slot = num_pages * page_size
        slots = num_pages * page_size + page_size
        self.caches = [
            LayerCache.empty(slots, engine.num_kv_heads, engine.head_dim, engine.dtype, engine.fp8_kv_cache, device)
            for _ in engine.snapshot.layers
        ]
        self.slot_count = slot_bucket(min(self.rows, engine.max_rows), engine.max_rows)
        # the table's row stride is a kernel argument: a multiple of 16 keeps Triton's specialisation of it (and so
        # the kernel a graph captured in an earlier call compiled) the same in every call
        self.slots = _SlotState(self.slot_count, 16 * math.ceil(self.scheduler.max_pages / 16), device)
        self.out_tokens = torch.zeros(self.rows + 1, self.max_new, dtype=torch.int32, device=device)
        self.out_logprobs = torch.zeros(self.rows + 1, self.max_new, dtype=torch.float32, device=device)
        self.dump_index = self.rows * self.max_new  # the extra row takes idle slots' outputs
        # per-row caps: on the host for the scheduler's step count, on the device (the extra row's too) for the step
        self.row_caps, self.row_caps_device = None, None
        if row_max_new_tokens is not None:
            self.row_caps = np.asarray(row_max_new_tokens, dtype=np.int64)
            caps = torch.tensor([*row_max_new_tokens, self.max_new], dtype=torch.long)
            self.row_caps_device = caps.to(device)
        self.hidden: dict[int, torch.Tensor] = {}  # last hidden state of each prefilled prefix still needed
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if engine.cuda_graph else None
        self.released = False  # the KV pool and graphs freed (`release`)
        self.live = 0  # slots in use (the first `live` ones)
        self.max_length = 0  # longest context any running row can reach before the next synchronisation

    # ------------------------------------------------------------------------------------------------ loop

    def run(self) -> GenerationOutput:
        engine, scheduler = self.engine, self.scheduler
        timer = DeviceTimer(engine.device)
        progress = _progress(engine.show_progress, self.rows)
        last_report = 0
        while self.step(timer):
            if progress is not None:
                generated = int(scheduler.generated.sum())
                progress.update(generated - last_report)
                progress.set_postfix(rows=f"{scheduler.finished}/{self.rows}", live=self.live, refresh=False)
                last_report = generated
        if progress is not None:
            progress.close()
        completions, logprobs = self.read(list(range(self.rows)))
        return GenerationOutput(completions, logprobs, self.finish_stats(timer))

    def release(self) -> None:
        """Free the KV pool, the captured graphs and the prefill states: once no row decodes again, only the outputs
        stay (rows x max_new_tokens, small beside the pool)."""
        self.caches, self.graphs, self.hidden, self.released = [], {}, {}, True

    def finish_stats(self, timer: DeviceTimer) -> RolloutStats:
        """The call's statistics, with its device times and totals filled in."""
        stats, scheduler = self.stats, self.scheduler
        stats.prefill_s, stats.decode_s = timer.seconds("prefill"), timer.seconds("decode")
        stats.preemptions = scheduler.preemptions
        stats.generated_tokens = int(scheduler.generated.sum())
        if self.engine.device.type == "cuda":
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(self.engine.device)
        return stats

    def read(self, rows: list[int]) -> tuple[list[list[int]], torch.Tensor]:
        """Completions of `rows` so far (each cut after its EOS) and their logprobs, (len(rows), max_new_tokens) on
        the engine's device, zero past each completion."""
        lengths = self.scheduler.generated[rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.engine.device)
        tokens = self.out_tokens[index].cpu()
        completions = [tokens[i, :length].tolist() for i, length in enumerate(lengths.tolist())]
        columns = torch.arange(self.max_new, device=self.engine.device)
        mask = columns < torch.from_numpy(lengths).to(self.engine.device).unsqueeze(1)
        return completions, self.out_logprobs[index] * mask

    def step(self, timer: DeviceTimer) -> bool:
        """Admit waiting rows, decode up to `sync_every` steps and synchronise; False once no row is left."""
        engine, scheduler, stats = self.engine, self.scheduler, self.stats
        with timer.section("prefill"):
            self._admit()
        if scheduler.done:
            return False
        caps = self.max_new if self.row_caps is None else self.row_caps[scheduler.running]
        steps = min(engine.sync_every, int((caps - scheduler.generated[scheduler.running]).max()))
        bucket = slot_bucket(self.live, engine.max_rows)
        decode = self._decoder(bucket)
        with timer.section("decode"):
            for _ in range(steps):
                decode()
        stats.decode_steps += steps
        stats.slot_steps += steps * bucket
        stats.pool_slot_steps += steps * engine.max_rows  # the configured slots, whatever this call's rows
        self._synchronise(steps)
        return True

    def _synchronise(self, steps: int) -> None:
        """Read the running rows' counts back after `steps` decode steps (one host synchronisation) and retire the
        finished ones."""
        slots = self.slots
        counts = torch.stack([slots.active[: self.live].long(), slots.generated[: self.live]]).cpu().numpy()
        self.stats.synchronisations += 1
        decoded = counts[1] - self.scheduler.generated[self.scheduler.running]
        self.stats.busy_slot_steps += int(decoded.sum())
        self.stats.tail_decode_steps += tail_steps(decoded, steps, self.engine.max_rows)
        kept = self.scheduler.retire(counts[1], counts[0].astype(bool))
        self._compact(kept)

    def _compact(self, kept: list[int]) -> None:
        """Move the state of slots `kept` (in order) to the first slots."""
        if len(kept) == self.live and kept == list(range(self.live)):
            return
        index = torch.tensor(kept, dtype=torch.long, device=self.engine.device)
        for tensor in (self.slots.tokens, self.slots.active):  # the other counters are rewritten from the host
            tensor[: len(kept)] = tensor[index]
        self.slots.active[len(kept) :] = False
        self.live = len(kept)

    def _admit(self) -> None:
        """Reserve pages (preempting if short), admit waiting rows, prefill what they need, sample their next token
        and write the slot state of every running row."""
        engine, scheduler, device = self.engine, self.scheduler, self.engine.device
        victims = scheduler.reserve()
        self.live = len(scheduler.running)
        self.slots.active[self.live :] = False
        for row in victims:
            scheduler.requeue(row, self.out_tokens[row, : scheduler.generated[row]].tolist())
        admission = scheduler.admit()
        for prefix in admission.prefill:
            self.stats.prefill_tokens += len(prefix.tokens)
            if prefix.resumed:
                self.stats.resumed_prefill_tokens += len(prefix.tokens)
        self.hidden.update(self._prefill(admission.prefill))
        if admission.copies:
            source, target = (
                torch.tensor(pages, dtype=torch.long, device=device) for pages in zip(*admission.copies, strict=True)
            )
            source, target = (page_slots(pages, engine.page_size) for pages in (source, target))
            for cache in self.caches:
                cache.copy(target, source)
        if admission.rows:
            self._start_rows(admission.rows, admission.prefixes)
        scheduler.complete(admission)  # queued after the prefill and copies that read those pages
        for index in admission.released_prefixes:
            self.hidden.pop(index, None)
        running = scheduler.running
        live = len(running)
        if live:
            slots = self.slots
            slots.rows[:live] = torch.tensor(running, dtype=torch.long).to(device)
            slots.positions[:live] = torch.from_numpy(scheduler.positions()).to(device)
            slots.generated[:live] = torch.from_numpy(scheduler.generated[running]).to(device)
            table = torch.from_numpy(scheduler.slot_page_table())
            slots.page_table[:live, : table.size(1)] = table.to(device)
            self.max_length = int(scheduler.page_count[running].max()) * engine.page_size
        self.live = live

    def _start_rows(self, rows: list[int], prefixes: list[int]) -> None:
        """Sample the next token of newly admitted rows from their prefix's last hidden state; append them to the
        slots (their slot counters are written by `_admit`)."""
        engine, scheduler, device = self.engine, self.scheduler, self.engine.device
        hidden = torch.stack([self.hidden[index] for index in prefixes])
        generated = torch.from_numpy(scheduler.generated[rows]).to(device)
        noise = sampling_noise(len(rows), engine.vocab_size, self.settings, device)
        token, logprob = engine.sample_tokens(hidden, noise, self.settings, generated)
        row_index = torch.tensor(rows, dtype=torch.long, device=device)
        flat = row_index * self.max_new + generated
        self.out_tokens.view(-1).index_copy_(0, flat, token.to(torch.int32))
        self.out_logprobs.view(-1).index_copy_(0, flat, logprob)
        first, count = len(scheduler.running) - len(rows), len(rows)
        slots = self.slots
        slots.tokens[first : first + count] = token
        stopped = engine.stop_table.index_select(0, token)
        caps = self.max_new if self.row_caps_device is None else self.row_caps_device[row_index]
        slots.active[first : first + count] = ~(stopped | (generated + 1 >= caps))
        scheduler.generated[rows] += 1

    # ------------------------------------------------------------------------------------- rows added mid-call

    @property
    def done(self) -> bool:
        """No row waits or decodes."""
        return self.scheduler.done

    def unfinished_rows(self) -> set[int]:
        """Rows still waiting or decoding."""
        return set(self.scheduler.running) | set(self.scheduler.waiting)

    def add_rows(self, prompt_ids: list[list[int]], resumed: list[tuple[list[int], torch.Tensor]] | None) -> list[int]:
        """Queue rows of new prompts while the call runs (a stream's `add`), growing what they outgrow: the rotary
        tables, the output buffers, the slot table's width (captured graphs read those, so they are captured again)."""
        if self.engine._rope_tables(max(map(len, prompt_ids)) + self.max_new):
            self.graphs.clear()
        rows = self.scheduler.add_rows(prompt_ids)
        added = len(self.scheduler.prompts)
        if added > self.rows:
            self._grow_outputs(max(added, 2 * self.rows))
        self.resume(rows, resumed)
        width = 16 * math.ceil(self.scheduler.max_pages / 16)
        if width > self.slots.page_table.size(1):  # a longer prompt than any before: widen the slot table
            table = self.slots.page_table
            self.slots.page_table = torch.zeros(table.size(0), width, dtype=table.dtype, device=table.device)
            self.slots.page_table[:, : table.size(1)] = table
            self.graphs.clear()
        self.stats.rows = added
        return rows

    def resume(self, rows: list[int], resumed: list[tuple[list[int], torch.Tensor]] | None) -> None:
        """Rows that continue after tokens sampled earlier: those tokens and their logprobs in the outputs."""
        if resumed is None:
            return
        if len(resumed) != len(rows):
            raise ValueError(f"resumed: {len(resumed)} entries for {len(rows)} rows.")
        for row, (tokens, logprobs) in zip(rows, resumed, strict=True):
            if tokens:
                self.scheduler.resume(row, list(tokens))
                self.stats.resumed_rows += 1
                self.stats.resumed_tokens += len(tokens)
                self.out_tokens[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
                self.out_logprobs[row, : len(tokens)] = logprobs[: len(tokens)].to(self.out_logprobs)

    def keep(self, rows: list[int], max_bytes: int) -> dict[int, KeptRow]:
        """The KV of those of `rows` that decode (a waiting row has none to keep), copied out of the pool within
        `max_bytes` and what the memory budget leaves beside the pool (a row that does not fit is skipped), by row;
        the rest are prefilled again when resumed."""
        scheduler, page_size = self.scheduler, self.engine.page_size
        running = set(scheduler.running)
        decoding = [row for row in rows if row in running]
        # a row's KV covers its prompt and its tokens but the last one, which the next decode step feeds
        lengths = [int(scheduler.prompt_lengths[row] + scheduler.generated[row]) - 1 for row in decoding]
        pages = [
            scheduler.page_table[row, : math.ceil(length / page_size)].tolist()
            for row, length in zip(decoding, lengths, strict=True)
        ]
        max_bytes = min(max_bytes, self.engine.budget_left())
        chosen, places = choose_pages(pages, int(max_bytes // (page_size * self.engine.cache_bytes_per_token())))
        if not chosen:
            return {}
        cache = KeptCache(self.caches, list(places), page_size, self.engine.device)
        self.engine.kept.hold(cache)
        self.stats.kept_cache_bytes += cache.nbytes
        rows_kept = [decoding[i] for i in chosen]
        last = self.out_tokens[rows_kept, (scheduler.generated[rows_kept] - 1).tolist()].tolist()
        return {
            row: KeptRow(cache, tuple(places[page] for page in pages[i]), token)
            for row, i, token in zip(rows_kept, chosen, last, strict=True)
        }

    def adopt(self, rows: list[int], kept: list[KeptRow]) -> int:
        """Resumed rows (added, not yet admitted) that continue from their kept KV: each takes a decode slot and pool
        pages holding a copy of its kept ones, and decodes its last token next, without a prefill; a row that finds no
        slot or too few pages stays waiting and is prefilled. Returns how many were adopted."""
        scheduler, device = self.scheduler, self.engine.device
        placed: dict[KeptCache, dict[int, int]] = {}
        adopted = 0
        for row, keep in zip(rows, kept, strict=True):
            copies = scheduler.adopt(row, list(keep.pages), placed.setdefault(keep.cache, {}))
            if copies is None:
                continue
            if copies:
                keep.cache.copy_into(self.caches, *map(list, zip(*copies, strict=True)), device)
            slot = len(scheduler.running) - 1
            self.slots.tokens[slot], self.slots.active[slot] = keep.last_token, True
            self.stats.kept_cache_rows += 1
            self.stats.kept_cache_tokens += int(scheduler.prompt_lengths[row] + scheduler.generated[row])
            adopted += 1
        self.live = len(scheduler.running)
        return adopted

    def _grow_outputs(self, rows: int) -> None:
        """Reallocate the output buffers for `rows` rows (plus the row idle slots write to)."""
        for name in ("out_tokens", "out_logprobs"):
            old = getattr(self, name)
            new = torch.zeros(rows + 1, self.max_new, dtype=old.dtype, device=old.device)
            new[: self.rows] = old[: self.rows]
            setattr(self, name, new)
        self.rows, self.dump_index = rows, rows * self.max_new
        self.graphs.clear()  # captured graphs write to the previous buffers

    # ---------------------------------------------------------------------------------------------- prefill

    def _prefill(self, prefixes: list[Prefix]) -> dict[int, torch.Tensor]:
        """Write the KV of each sequence into its pages (in chunks of at most `prefill_tokens` padded tokens, longest
        first); return each one's final-norm hidden state at its last token."""
        engine = self.engine
        out: dict[int, torch.Tensor] = {}
        order = sorted(prefixes, key=lambda p: len(p.tokens), reverse=True)
        start = 0
        while start < len(order):
            width = len(order[start].tokens)
            count = max(1, min(len(order) - start, engine.prefill_tokens // width))
            chunk = order[start : start + count]
            out.update(zip([p.index for p in chunk], self._prefill_chunk(chunk, width), strict=True))
            start += count
        return out

    def _prefill_chunk(self, chunk: list[Prefix], width: int) -> torch.Tensor:
        engine, device, page_size = self.engine, self.engine.device, self.engine.page_size
        count = len(chunk)
        ids = np.full((count, width), engine.pad_token_id, dtype=np.int64)
        slots = np.full((count, width), self.trash_slot, dtype=np.int64)
        lengths = np.array([len(p.tokens) for p in chunk])
        for row, prefix in enumerate(chunk):
            length = len(prefix.tokens)
            ids[row, :length] = prefix.tokens
            pages = np.repeat(np.asarray(prefix.pages, dtype=np.int64), page_size)[:length]
            slots[row, :length] = pages * page_size + np.arange(length) % page_size
        # inputs of the compiled layer are never views (a view's base would be guarded on and recompiled for)
        ids_t = torch.from_numpy(ids.reshape(-1)).to(device)
        slots_t = torch.from_numpy(slots.reshape(-1)).to(device)
        positions = torch.arange(width, device=device).repeat(count)
        cos, sin = engine.cos[positions], engine.sin[positions]
        group = engine.num_heads // engine.num_kv_heads
        x, delta = F.embedding(ids_t, engine.snapshot.embed), None
        for layer, cache in zip(engine.snapshot.layers, self.caches, strict=True):
            q, k, v, x = engine._attention_inputs(x, delta, cos, sin, slots_t, *cache, layer)
            q = q.view(count, width, engine.num_heads, engine.head_dim).transpose(1, 2)
            k = k.view(count, width, engine.num_kv_heads, engine.head_dim).transpose(1, 2)
            v = v.view(count, width, engine.num_kv_heads, engine.head_dim).transpose(1, 2)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            # right padding: under the causal mask no real token sees a padded one
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x, hidden = engine._layer_output(x, engine._output_projection(attention.transpose(1, 2), layer), layer)
            delta = engine._down_projection(hidden, layer)
        last = torch.from_numpy(np.arange(count) * width + lengths - 1).to(device)
        return engine._residual_norm(x[last], delta[last], engine.snapshot.final_norm)

    # ----------------------------------------------------------------------------------------------- decode

    def _decode_step(self, bucket: int) -> None:
        """One token for each of the first `bucket` slots; static buffers only, so it can be graph-captured."""
        engine, slots, page_size = self.engine, self.slots, self.engine.page_size
        tokens, positions, generated = slots.tokens[:bucket], slots.positions[:bucket], slots.generated[:bucket]
        active, rows, table = slots.active[:bucket], slots.rows[:bucket], slots.page_table[:bucket]
        page_index = (positions // page_size).clamp(max=table.size(1) - 1)  # idle slots may hold any position
        page = table.gather(1, page_index.unsqueeze(1)).squeeze(1).long()
        write = torch.where(active, page * page_size + positions % page_size, self.trash_slot)
        lengths = torch.where(active, positions + 1, 0).to(torch.int32)
        cos, sin = engine.cos[positions], engine.sin[positions]  # once per step, not per layer
        use_triton = engine.attention_kernel == "triton"
        splits = num_splits(bucket, engine.num_kv_heads, engine.device) if use_triton else 0
        down_bias = engine.down_bias(bucket)
        x, delta = F.embedding(tokens, engine.snapshot.embed), None
        for layer, cache in zip(engine.snapshot.layers, self.caches, strict=True):
            qkv, x = engine._decode_qkv(x, delta, layer)
            heads, norm, eps = engine.num_heads, engine.architecture.qk_norm(layer), engine.eps
            new_token = (qkv, cos, sin, write, cache.k, cache.v, table, lengths, page_size, heads, norm, eps)
            scales = {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
            if use_triton:
                attention = triton_decode_attention(*new_token, splits, **scales)
            else:
                attention = reference_decode_attention(*new_token, self.max_length, **scales)
            x, hidden = engine._layer_output(x, engine._output_projection(attention, layer), layer)
            delta = engine._down_projection(hidden, layer, down_bias)
        hidden = engine._final_norm(x, delta, engine.snapshot.final_norm)
        noise = sampling_noise(bucket, engine.vocab_size, self.settings, engine.device)
        counts = generated.clone()  # not a view, as in `_start_rows`
        token, logprob = engine.sample_tokens(hidden, noise, self.settings, counts)
        flat = torch.where(active, rows * self.max_new + generated, self.dump_index)
        self.out_tokens.view(-1).index_copy_(0, flat, token.to(torch.int32))
        self.out_logprobs.view(-1).index_copy_(0, flat, logprob)
        caps = self.max_new if self.row_caps_device is None else self.row_caps_device.index_select(0, rows)
        finished = engine.stop_table.index_select(0, token) | (generated + 1 >= caps)
        generated.add_(active.long())
        positions.add_(active.long())
        tokens.copy_(token)
        active.logical_and_(~finished)

    def _decoder(self, bucket: int):
        """The decode step of a bucket as a callable: a CUDA graph replay when enabled, else the eager step."""
        if not self.engine.cuda_graph:
            return lambda: self._decode_step(bucket)
        graph = self.graphs.get(bucket)
        self.engine.down_bias(bucket)  # chosen before any capture (it times graphs of its own)
        # what the compiled code specialises on: the bucket and the settings the sampling head reads
        warm_key = (bucket, dataclasses.replace(self.settings, max_new_tokens=0))
        if graph is None and warm_key not in self.engine.warm_steps:
            # warm-up (compilation, kernel selection) runs the real step once: put the counters back afterwards so
            # the step replayed next is the same one (it rewrites the same cache and output entries). Once per engine:
            # later calls, with new pools, only capture.
            saved = [tensor.clone() for tensor in self.slots.counters()]
            on_side_stream(lambda: self._decode_step(bucket))
            for tensor, value in zip(self.slots.counters(), saved, strict=True):
                tensor.copy_(value)
            self.engine.warm_steps.add(warm_key)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._decode_step(bucket)
            self.graphs[bucket] = graph
        return graph.replay


class DeviceTimer:
    """Device time of named sections from CUDA events (read once at the end, no synchronisation in between);
    host time on the CPU."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.events: dict[str, list] = {}

    def section(self, name: str):
        timer = self

        class _Section:
            def __enter__(self):
                self.start = torch.cuda.Event(enable_timing=True) if timer.cuda else time.perf_counter()
                if timer.cuda:
                    self.start.record()

            def __exit__(self, *exc):
                if timer.cuda:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    timer.events.setdefault(name, []).append((self.start, end))
                else:
                    timer.events.setdefault(name, []).append(time.perf_counter() - self.start)

        return _Section()

    def seconds(self, name: str) -> float:
        entries = self.events.get(name, [])
        if not self.cuda:
            return float(sum(entries))
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in entries) / 1e3


def _progress(enabled: bool, rows: int):
    """A progress bar of generated tokens, shown only for calls that last more than a few seconds."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=f"rollout of {rows} rows", unit="tok", delay=3.0, dynamic_ncols=True)
