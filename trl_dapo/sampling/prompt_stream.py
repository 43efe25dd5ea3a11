"""`PromptStream`: the prompts for extra candidate rounds, drawn apart from the Trainer's own dataloader.

The Trainer's dataloader hands one generation batch per generation step and checkpoints its own position; extra
rounds draw from this stream instead, so the Trainer's epoch accounting stays untouched. Every rank builds the same
stream from the same seed, and its position is saved with the checkpoint.
"""

from __future__ import annotations

import torch


class PromptStream:
    """Endless, reshuffled-per-epoch sequence of dataset indices."""

    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True) -> None:
        if dataset_size <= 0:
            raise ValueError("train_dataset is empty: dynamic sampling needs prompts to draw extra rounds from.")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def take(self, count: int) -> list[int]:
        """The next `count` prompt indices, wrapping into a new epoch (a new permutation) as needed."""
        taken: list[int] = []
        while len(taken) < count:
            order = self._order()
            end = min(self.dataset_size, self.position + count - len(taken))
            taken.extend(order[self.position : end].tolist())
            self.position = end
            if self.position == self.dataset_size:
                self.epoch, self.position = self.epoch + 1, 0
        return taken

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
