"""Continuous-batching schedule for a paged KV cache: which rows decode, which wait, which pages each one reads.

Host-side bookkeeping only (no model, no device work), so it can be tested on its own. A fixed number of decode
slots is refilled from a queue of waiting rows whenever rows finish; the KV cache is a pool of fixed-size pages
handed out as rows grow. Rows of one prompt (the `num_generations` samples of a group) share the prompt's full pages,
prefilled once; each copies the prompt's last, partly filled page so it can append its own tokens. When the pool
runs short, the most recently admitted rows are preempted: their pages are freed and they wait at the head of the
queue to be recomputed (prefilled with the prompt and the tokens generated so far) later. Every row completes
whatever the pool size, as long as one row's whole sequence fits.

Between two synchronisations the device decodes `steps` tokens per row without the host; a row that finishes stops
writing, and its slot is refilled at the next synchronisation.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

# Share of the pool kept free when admitting rows, so rows already decoding rarely need to be preempted.
ADMISSION_WATERMARK = 0.01


class PagePool:
    """Reference-counted KV pages: a page returns to the free list when no row or prompt holds it any more."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.references = np.zeros(num_pages, dtype=np.int32)
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV cache: {count} pages asked for, {len(self._free)} free.")
        pages = [self._free.pop() for _ in range(count)]
        self.references[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        np.add.at(self.references, pages, 1)

    def release(self, pages: list[int]) -> None:
        np.subtract.at(self.references, pages, 1)
        self._free.extend(page for page in pages if self.references[page] == 0)


@dataclass
class Prefix:
    """A token sequence whose KV is (to be) written once into `pages`: a prompt shared by the rows waiting on it, or
    the prompt and generated tokens of one preempted row."""

    index: int
    tokens: list[int]
    waiting: int
    private: bool = False
    resumed: bool = False  # a row's prompt and the tokens an earlier call sampled for it (a partial rollout)
    pages: list[int] = field(default_factory=list)

    @property
    def prefilled(self) -> bool:
        return bool(self.pages)


@dataclass
class Admission:
    """What the device must do at one synchronisation before decoding the next steps."""

    prefill: list[Prefix]  # write KV of these sequences into their pages; keep each one's last hidden state
    copies: list[tuple[int, int]]  # (source page, destination page): a prompt's last page, copied for one row
    rows: list[int]  # rows admitted now (appended to the decode slots in this order)
    prefixes: list[int]  # the Prefix.index each admitted row samples its next token from
    released_prefixes: list[int]  # prefixes no waiting row needs any more (their hidden states can go)
    # pages whose content this admission's prefill and copies still read: freed by `complete` once they are done
    release_after: list[int] = field(default_factory=list)


class Scheduler:
    """Slots, pages and queue for one `generate` call over `prompts` (one entry per row)."""

    def __init__(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        page_size: int,
        num_pages: int,
        max_rows: int,
        steps: int,
    ) -> None:
        self.max_new_tokens, self.page_size, self.max_rows, self.steps = max_new_tokens, page_size, max_rows, steps
        self.pool = PagePool(num_pages)
        self.watermark = math.ceil(ADMISSION_WATERMARK * num_pages)
        rows = len(prompts)
        self.prompt_lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        self.generated = np.zeros(rows, dtype=np.int64)  # tokens recorded so far, per row
        self.max_pages = math.ceil((int(self.prompt_lengths.max()) + max_new_tokens) / page_size)
        self.page_table = np.zeros((rows, self.max_pages), dtype=np.int32)
        self.page_count = np.zeros(rows, dtype=np.int64)
        self.prompts = list(prompts)
        self.prefixes: dict[int, Prefix] = {}  # the ones still needed by a waiting row
        self._prefix_count = 0
        self.prefix_of: list[int] = []
        self._queue(prompts)
        self.waiting: deque[int] = deque(range(rows))
        self.running: list[int] = []  # rows in decode-slot order
        self.finished = 0
        self.preemptions = 0
        self._check_rows_fit(self.prompt_lengths, first_row=0)

    def add_rows(self, prompts: list[list[int]]) -> list[int]:
        """Queue rows of new prompts during a call (streaming refill): rows of one prompt in this call share its
        prefix. Returns their row indices. The page table widens when a prompt is longer than any before."""
        first = len(self.prompts)
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        self._check_rows_fit(lengths, first_row=first)
        longest = self._pages_for(int(lengths.max()) + self.max_new_tokens)
        if longest > self.max_pages:
            self.page_table = np.pad(self.page_table, ((0, 0), (0, longest - self.max_pages)))
            self.max_pages = longest
        self.prompt_lengths = np.concatenate([self.prompt_lengths, lengths])
        self.generated = np.concatenate([self.generated, np.zeros(len(prompts), dtype=np.int64)])
        self.page_table = np.concatenate([self.page_table, np.zeros((len(prompts), self.max_pages), np.int32)])
        self.page_count = np.concatenate([self.page_count, np.zeros(len(prompts), dtype=np.int64)])
        self.prompts.extend(prompts)
        self._queue(prompts)
        self.waiting.extend(range(first, first + len(prompts)))
        return list(range(first, first + len(prompts)))

    def _queue(self, prompts: list[list[int]]) -> None:
        """One prefix per distinct prompt of `prompts`, each waited on by its rows."""
        by_prompt: dict[tuple[int, ...], Prefix] = {}
        for prompt in prompts:
            prefix = by_prompt.get(tuple(prompt))
            if prefix is None:
                prefix = by_prompt[tuple(prompt)] = self._new_prefix(list(prompt), waiting=0)
            prefix.waiting += 1
            self.prefix_of.append(prefix.index)

    def _new_prefix(self, tokens: list[int], waiting: int, private: bool = False, resumed: bool = False) -> Prefix:
        prefix = Prefix(self._prefix_count, tokens, waiting, private, resumed)
        self._prefix_count += 1
        self.prefixes[prefix.index] = prefix
        return prefix

    def _check_rows_fit(self, prompt_lengths: np.ndarray, first_row: int) -> None:
        """Before anything is admitted: the longest of these rows (`first_row` onwards in this call) must fit the pool
        beside the admission watermark, or the call could never finish; the error names the row and the limits."""
        longest = int(prompt_lengths.argmax())
        usable = (self.pool.num_pages - self.watermark) * self.page_size
        if self._pages_for(int(prompt_lengths[longest]) + self.max_new_tokens) * self.page_size > usable:
            prompt_limit = usable - self.max_new_tokens
            refuse = f", or refuse longer prompts with max_prompt_length={prompt_limit}" if prompt_limit > 0 else ""
            raise ValueError(
                f"KV cache of {self.pool.num_pages * self.page_size} tokens cannot hold row {first_row + longest} of "
                f"this call: {int(prompt_lengths[longest])} prompt + {self.max_new_tokens} new tokens; give the rollout "
                f"engine more memory (rollout_memory_fraction) or lower max_completion_length{refuse}."
            )

    def _pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def _pages_to_decode(self, row: int, generated: int) -> int:
        """Pages a row needs for the next `steps` decode steps: its fed tokens are at positions prompt + generated
        - 1 onward, the last one ever fed at prompt + max_new_tokens - 2."""
        prompt = int(self.prompt_lengths[row])
        return self._pages_for(min(prompt + generated - 1 + self.steps, prompt + self.max_new_tokens - 1))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def positions(self) -> np.ndarray:
        """Position of the token each running row feeds next."""
        rows = self.running
        return self.prompt_lengths[rows] + self.generated[rows] - 1

    def slot_page_table(self) -> np.ndarray:
        return self.page_table[self.running]

    # --------------------------------------------------------------------------------------------- transitions

    def retire(self, generated: np.ndarray, active: np.ndarray) -> list[int]:
        """Record the device's counts for the running rows (slot order); free the slots and pages of finished rows.
        Returns the slot indices that stay, in order."""
        rows = np.asarray(self.running, dtype=np.int64)
        self.generated[rows] = generated
        kept = []
        for slot, (row, alive) in enumerate(zip(self.running, active, strict=True)):
            if alive:
                kept.append(slot)
            else:
                self._free_row(row)
                self.finished += 1
        self.running = [self.running[slot] for slot in kept]
        return kept

    def _free_row(self, row: int) -> None:
        self.pool.release(self.page_table[row, : self.page_count[row]].tolist())
        self.page_count[row] = 0

    def _grow(self, row: int, pages: int) -> None:
        count = int(self.page_count[row])
        self.page_table[row, count : count + pages] = self.pool.allocate(pages)
        self.page_count[row] = count + pages

    def reserve(self) -> list[int]:
        """Give every running row the pages of its next `steps` tokens, preempting the most recently admitted rows
        while the pool is short (the running rows keep their slots: preempted ones are the last slots). Returns the
        preempted rows, most recent first: requeueing each in that order (`requeue`, with its generated tokens)
        leaves the earliest admitted at the head of the queue."""
        needs = {
            row: self._pages_to_decode(row, int(self.generated[row])) - int(self.page_count[row])
            for row in self.running
        }
        need = sum(max(count, 0) for count in needs.values())
        self._evict_prompts(need)
        victims: list[int] = []
        while need > self.pool.free:  # the running list is in admission order: preempt from its end
            victim = self.running.pop()
            need -= max(needs[victim], 0)
            self._free_row(victim)
            victims.append(victim)
        for row in self.running:
            if needs[row] > 0:
                self._grow(row, needs[row])
        self.preemptions += len(victims)
        return victims

    def _evict_prompts(self, pages: int, keep: tuple[Prefix, ...] = ()) -> None:
        """Free the pages of prefilled prompts that only waiting rows need (they are prefilled again when their next
        row is admitted) until `pages` pages are free: cheaper than preempting a decoding row, and it keeps prompts
        whose rows are far apart in the queue from holding the pool."""
        for prefix in list(self.prefixes.values()):
            if self.pool.free >= pages:
                return
            if prefix.prefilled and not prefix.private and all(prefix is not kept for kept in keep):
                self.pool.release(prefix.pages)
                prefix.pages = []

    def resume(self, row: int, tokens: list[int]) -> None:
        """A waiting row not yet admitted continues after `tokens` (a partial rollout of an earlier call): its prompt
        and those tokens are prefilled as its own sequence, as a preempted row's are."""
        if not 0 < len(tokens) < self.max_new_tokens:
            raise ValueError(f"a resumed row needs 1 to {self.max_new_tokens - 1} tokens, got {len(tokens)}.")
        shared = self.prefixes[self.prefix_of[row]]
        if shared.prefilled or row not in self.waiting:
            raise ValueError("only a row that waits, behind a prompt not yet prefilled, can be resumed.")
        shared.waiting -= 1
        if shared.waiting == 0:
            del self.prefixes[shared.index]
        prefix = self._new_prefix(self.prompts[row] + list(tokens), waiting=1, private=True, resumed=True)
        self.prefix_of[row] = prefix.index
        self.generated[row] = len(tokens)

    def adopt(self, row: int, kept_pages: list[int], placed: dict[int, int]) -> list[tuple[int, int]] | None:
        """A resumed row whose KV is at hand (kept from an earlier call: `kept_pages`, keys of `placed`, which maps
        the kept pages already given a pool page in this call to it) skips its prefill: it takes a decode slot now,
        with pool pages for its kept ones (a page another row of this call already placed is shared) and for its next
        `steps` tokens. Returns the `(kept page, pool page)` pairs newly allocated, whose KV the caller copies; None,
        the row left waiting to be prefilled, when no slot is free or the pool is short."""
        prefix = self.prefixes.get(self.prefix_of[row])
        if prefix is None or not prefix.resumed or prefix.prefilled or row not in self.waiting:
            raise ValueError("only a resumed row that waits, its tokens not yet prefilled, can adopt a kept cache.")
        new = [page for page in dict.fromkeys(kept_pages) if page not in placed]
        decode = self._pages_to_decode(row, int(self.generated[row]))
        if len(self.running) >= self.max_rows or len(new) + max(decode - len(kept_pages), 0) + self.watermark > (
            self.pool.free
        ):
            return None
        allocated = self.pool.allocate(len(new))
        self.pool.share([placed[page] for page in kept_pages if page in placed])
        placed.update(zip(new, allocated, strict=True))
        self.page_table[row, : len(kept_pages)] = [placed[page] for page in kept_pages]
        self.page_count[row] = len(kept_pages)
        if decode > len(kept_pages):
            self._grow(row, decode - len(kept_pages))
        del self.prefixes[prefix.index]
        self.waiting.remove(row)
        self.running.append(row)
        return list(zip(new, allocated, strict=True))

    def requeue(self, row: int, generated_tokens: list[int]) -> None:
        """Put a preempted row back at the head of the queue, to be prefilled with its prompt and these tokens."""
        prefix = self._new_prefix(self.prompts[row] + generated_tokens, waiting=1, private=True)
        self.prefix_of[row] = prefix.index
        self.waiting.appendleft(row)

    def admit(self) -> Admission:
        """Fill free slots from the queue while pages last (keeping the watermark free)."""
        admission = Admission(prefill=[], copies=[], rows=[], prefixes=[], released_prefixes=[])
        pending: list[Prefix] = []  # prefixes this admission prefills or copies from: not to be evicted now
        while self.waiting and len(self.running) < self.max_rows:
            row = self.waiting[0]
            prefix = self.prefixes[self.prefix_of[row]]
            length = len(prefix.tokens)
            full, partial = divmod(length, self.page_size)
            # the token sampled now is fed at position `length`; the next `steps` ones after it
            last = min(length + self.steps, int(self.prompt_lengths[row]) + self.max_new_tokens - 1)
            decode_pages = self._pages_for(last)
            if prefix.private:
                need = max(decode_pages, self._pages_for(length))
            else:
                need = decode_pages - full + (0 if prefix.prefilled else self._pages_for(length))
            if need + self.watermark > self.pool.free:
                self._evict_prompts(need + self.watermark, keep=(prefix, *pending))
            if need + self.watermark > self.pool.free:
                break
            self.waiting.popleft()
            pending.append(prefix)
            if not prefix.prefilled:
                prefix.pages = self.pool.allocate(self._pages_for(length))
                admission.prefill.append(prefix)
            if prefix.private:  # the row owns its recomputed sequence's pages
                self.page_table[row, : len(prefix.pages)] = prefix.pages
                self.page_count[row] = len(prefix.pages)
            else:
                shared = prefix.pages[:full]
                self.pool.share(shared)
                self.page_table[row, :full] = shared
                self.page_count[row] = full
                if partial:
                    (copy,) = self.pool.allocate(1)
                    admission.copies.append((prefix.pages[full], copy))
                    self.page_table[row, full] = copy
                    self.page_count[row] = full + 1
            if decode_pages > self.page_count[row]:
                self._grow(row, decode_pages - int(self.page_count[row]))
            prefix.waiting -= 1
            if prefix.waiting == 0:
                if not prefix.private:
                    admission.release_after.extend(prefix.pages)
                admission.released_prefixes.append(prefix.index)
                del self.prefixes[prefix.index]
            admission.rows.append(row)
            admission.prefixes.append(prefix.index)
            self.running.append(row)
        if not self.running and self.waiting:
            raise RuntimeError("KV cache: no row can be admitted although none is running (pool too small).")
        return admission

    def complete(self, admission: Admission) -> None:
        """The device has done the admission's prefill and copies: free the pages only they still needed."""
        self.pool.release(admission.release_after)
