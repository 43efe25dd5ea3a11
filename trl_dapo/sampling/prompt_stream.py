"""Prompt streams: the prompts for extra candidate rounds, drawn apart from the Trainer's own dataloader.

The Trainer's dataloader hands one generation batch per generation step and checkpoints its own position; extra
rounds draw from a stream of their own instead, so the Trainer's epoch accounting stays untouched. Every rank builds
the same stream from the same seed, and its position is saved with the checkpoint (plain numbers and dicts, loadable
with `torch.load(weights_only=True)`). A map-style dataset is drawn by index in a seeded permutation per epoch; a
streaming `datasets.IterableDataset` is read by an iterator of its own, reshuffled per epoch with its buffered
shuffle.
"""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset, IterableDataset


class PromptStream:
    """Endless, reshuffled-per-epoch sequence of the rows of a map-style dataset."""

    def __init__(self, dataset: Dataset, seed: int, shuffle: bool = True) -> None:
        if len(dataset) == 0:
            raise ValueError("train_dataset is empty: dynamic sampling needs prompts to draw extra rounds from.")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    @property
    def num_prompts(self) -> int | None:
        """Prompts in one pass over the dataset."""
        return len(self.dataset)

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def _take_indices(self, count: int) -> list[int]:
        """The next `count` dataset indices, wrapping into a new epoch (a new permutation) as needed."""
        taken: list[int] = []
        while len(taken) < count:
            order = self._order()
            end = min(len(self.dataset), self.position + count - len(taken))
            taken.extend(order[self.position : end].tolist())
            self.position = end
            if self.position == len(self.dataset):
                self.epoch, self.position = self.epoch + 1, 0
        return taken

    def take(self, count: int) -> list[dict[str, Any]]:
        """The next `count` rows."""
        return [self.dataset[i] for i in self._take_indices(count)]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]


class IterablePromptStream:
    """Endless sequence of the rows of a streaming dataset: its own iterator, a new shuffle seed per epoch."""

    def __init__(self, dataset: IterableDataset, seed: int, shuffle: bool = True) -> None:
        self.source = dataset.shuffle(seed=seed) if shuffle else dataset
        self.epoch = 0
        self.rows_in_epoch = 0
        self.rows_per_epoch: int | None = None
        self._rows = iter(self.source)

    @property
    def num_prompts(self) -> int | None:
        """Prompts in one pass over the stream, known once a pass has ended."""
        return self.rows_per_epoch

    def _next_epoch(self) -> None:
        if self.rows_in_epoch == 0:
            raise ValueError("train_dataset is empty: dynamic sampling needs prompts to draw extra rounds from.")
        self.epoch, self.rows_per_epoch, self.rows_in_epoch = self.epoch + 1, self.rows_in_epoch, 0
        self.source.set_epoch(self.epoch)
        self._rows = iter(self.source)

    def take(self, count: int) -> list[dict[str, Any]]:
        """The next `count` rows, starting a new epoch whenever the stream ends."""
        taken: list[dict[str, Any]] = []
        while len(taken) < count:
            row = next(self._rows, None)
            if row is None:
                self._next_epoch()
                continue
            taken.append(row)
            self.rows_in_epoch += 1
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "rows_in_epoch": self.rows_in_epoch,
            "rows_per_epoch": self.rows_per_epoch,
            "source": self.source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.rows_in_epoch = state["epoch"], state["rows_in_epoch"]
        self.rows_per_epoch = state["rows_per_epoch"]
        self.source.set_epoch(self.epoch)
        self.source.load_state_dict(state["source"])
        self._rows = iter(self.source)


def make_prompt_stream(
    dataset: Dataset | IterableDataset, seed: int, shuffle: bool
) -> PromptStream | IterablePromptStream:
    """The stream that fits the dataset; other iterables (a plain `torch` IterableDataset) cannot be re-read."""
    if isinstance(dataset, IterableDataset):
        return IterablePromptStream(dataset, seed, shuffle)
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"train_dataset: dynamic sampling draws extra prompts from the training set, which a "
            f"{type(dataset).__name__} cannot provide; pass a datasets.Dataset or datasets.IterableDataset, or set "
            "DAPOConfig.dynamic_sampling=False."
        )
    return PromptStream(dataset, seed, shuffle)
