"""What both the rollout engine and the training passes read of a transformers model: the model under a PEFT
wrapper, and the attention window it was trained with."""

from __future__ import annotations


def sliding_window(config) -> int | None:
    """The attention window of a model that uses one shorter than its context (Mistral v0.1's 4,096), else None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return window if window < (getattr(config, "max_position_embeddings", None) or window + 1) else None


def base_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
