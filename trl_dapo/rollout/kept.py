"""Kept KV: the cache of rows a stream left decoding, held across the training step and a weight sync, so the next
stream continues them from it instead of prefilling their prompt and tokens again (partial rollouts).

When a partial round stops, its rows still decoding are carried. Without a kept cache the next round prefills each
one's prompt and tokens under the new weights (the preemption path). With one, `Generation.keep` copies the pages
that hold the KV of chosen rows (their prompt and every token but the last sampled one, whose KV the next decode
step writes) out of the stream's pool into a compact `KeptCache` before the pool is freed; the training passes then
run beside that cache alone, not beside the whole pool. The next stream's `Generation.adopt` copies each row's pages
into its own pool and puts the row straight into a decode slot with its last token: it continues under the new
weights reading KV the older weights wrote, the staleness AReaL- and Kimi-style partial rollouts accept (each token
keeps the logprob of the policy that sampled it, and the trainer's old policy and rollout correction handle the
mismatch).

Rows of one prompt share its full pages in the pool; they share them in the kept cache and again in the next pool.
A row that does not fit the byte budget at keep time, or a free slot and pages at adopt time, is prefilled as before.
Nothing here is saved with checkpoints: a resumed run prefills its carried rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .fp8 import LayerCache, as_bytes


class KeptCache:
    """Pages of KV copied out of a stream's pool (every layer's k and v, and FP8 scales), in the order they were
    kept; freed once no `KeptRow` refers to it."""

    def __init__(self, caches: list[LayerCache], source_pages: list[int], page_size: int, device) -> None:
        slots = page_slots(torch.tensor(source_pages, dtype=torch.long, device=device), page_size)
        self.layers = [
            LayerCache(*(None if tensor is None else as_bytes(tensor)[slots] for tensor in cache)) for cache in caches
        ]
        self.pages, self.page_size = len(source_pages), page_size
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in layer if t is not None)

    def copy_into(self, caches: list[LayerCache], pages: list[int], targets: list[int], device) -> None:
        """Write this cache's `pages` into the pool pages `targets` of `caches` (a stream's pool)."""
        source = page_slots(torch.tensor(pages, dtype=torch.long, device=device), self.page_size)
        target = page_slots(torch.tensor(targets, dtype=torch.long, device=device), self.page_size)
        for cache, kept in zip(caches, self.layers, strict=True):
            for tensor, values in zip(cache, kept, strict=True):
                if tensor is not None:
                    as_bytes(tensor)[target] = values[source]


@dataclass(frozen=True)
class KeptRow:
    """One row's kept KV: its pages in `cache` (positions below its prompt and tokens less one, page after page)
    and the last token it sampled, which its next decode step feeds."""

    cache: KeptCache
    pages: tuple[int, ...]
    last_token: int


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of whole pages, page after page."""
    offsets = torch.arange(page_size, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).flatten()


def choose_pages(rows_pages: list[list[int]], budget_pages: int) -> tuple[list[int], dict[int, int]]:
    """Which rows keep their pages within `budget_pages` (a page shared by several rows counted once), in order, a row
    that does not fit skipped (a later, shorter one may): the chosen rows' indices and each kept pool page's place in
    the kept cache."""
    chosen, places = [], {}
    for index, pages in enumerate(rows_pages):
        new = [page for page in dict.fromkeys(pages) if page not in places]
        if len(places) + len(new) > budget_pages:
            continue
        for page in new:
            places[page] = len(places)
        chosen.append(index)
    return chosen, places


class KeptBytes:
    """The bytes of the kept caches still alive (each counted until it is freed), which a new stream's pool may count
    as its own: they are freed once their rows are adopted."""

    def __init__(self) -> None:
        self.bytes = 0

    def hold(self, cache: KeptCache) -> None:
        self.bytes += cache.nbytes
        weakref.finalize(cache, self._release, cache.nbytes)

    def _release(self, nbytes: int) -> None:
        self.bytes -= nbytes


def pool_room(budget_left: float, kept_bytes: int, keep_room: int) -> float:
    """Bytes a stream's KV pool may take: what the memory budget leaves (`budget_left`, the kept caches alive
    excluded), less the room its end keeps for its carried rows' KV (`keep_room`), of which the kept caches alive now
    (`kept_bytes`, freed once the stream adopts their rows) already hold part: the pool and those caches together stay
    within the budget, and after adoption `keep_room` is free for the stream's own `keep`."""
    return budget_left - max(keep_room - kept_bytes, 0)
