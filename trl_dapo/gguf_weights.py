"""The weights of the model transformers would build from a GGUF header, against the weights the file holds.

A size field that no tensor confirms still sizes the model transformers builds, as does a size the header leaves out
(transformers then takes its config class's default): a 3.4 KB file with `feed_forward_length = 2**26` and no
feed-forward tensor, a 6 MB file of 20,000 layers holding norm tensors alone, a 7 KB `qwen2moe` file that asked for
94 GB. The sizes here are transformers' own: its GGUF field mapping and its config class's defaults (without reading
the file again: its GGUF reader took 10 s on SmolLM2's). The weights they imply (attention in every layer, the
feed-forward or the experts, the embedding; no norm, no bias) may be at most `MAX_BUILT_PER_HELD` times the weights
the file's tensors hold, which lie, not overlapping, within the file's bytes (`gguf_header.py`). An honest file comes
out near 1x (hybrid models, whose attention is in some layers only, a little above).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

MAX_BUILT_PER_HELD = 4
# llama.cpp's architecture names that transformers renames (`load_gguf_checkpoint`), and the config its model type reads
RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
TEXT_CONFIGS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def built_config(fields: dict[str, Any]) -> tuple[Any, dict[str, str]] | None:
    """The config transformers builds from these header fields, and which of its attributes came from which field;
    None for an architecture transformers does not map (it refuses the file itself). A `ValueError` when transformers'
    config class refuses the sizes."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = fields["general.architecture"]
    model_type = RENAMED.get(architecture, architecture)
    mapping = GGUF_CONFIG_MAPPING.get(model_type)
    if mapping is None or model_type in ("general", "tokenizer"):
        return None
    values, sources = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {})), {}
    for key, attribute in mapping.items():
        value = fields.get(f"{architecture}.{key}")
        if attribute is not None and isinstance(value, int | float) and not isinstance(value, bool):
            values[attribute], sources[attribute] = value, f"{architecture}.{key}"
    try:
        return AutoConfig.for_model(TEXT_CONFIGS.get(model_type, model_type), **values), sources
    except (ValueError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"transformers' {model_type} config refuses its sizes ({error})") from None


def _size(config: Any, *names: str) -> int:
    """The first of `names` that `config` sets to a whole number (0 when none does)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def weight_groups(config: Any) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{part of the model: (its weights, the config attributes that size it)}."""
    width, layers, vocabulary = (
        _size(config, "hidden_size"),
        _size(config, "num_hidden_layers"),
        _size(config, "vocab_size"),
    )
    heads = _size(config, "num_attention_heads")
    key_heads = _size(config, "num_key_value_heads") or heads
    head_dim = _size(config, "head_dim") or (width // heads if heads else 0)
    experts = _size(config, "num_experts", "num_local_experts")
    expert_width = _size(config, "moe_intermediate_size") or _size(config, "intermediate_size")
    shared = _size(config, "shared_expert_intermediate_size") if experts else 0
    dense = 0 if experts else _size(config, "intermediate_size")
    return {
        "attention": (
            layers * width * head_dim * 2 * (heads + key_heads),
            ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"),
        ),
        "the feed-forward": (layers * 3 * width * dense, ("num_hidden_layers", "hidden_size", "intermediate_size")),
        "the experts": (
            layers * experts * 3 * width * expert_width,
            ("num_hidden_layers", "num_experts", "num_local_experts", "hidden_size", "moe_intermediate_size"),
        ),
        "the shared expert": (
            layers * 3 * width * shared,
            ("num_hidden_layers", "hidden_size", "shared_expert_intermediate_size"),
        ),
        "the embedding": (vocabulary * width, ("vocab_size", "hidden_size")),
    }


def _described(config: Any, attributes: tuple[str, ...], sources: dict[str, str]) -> str:
    said = []
    for attribute in attributes:
        value = getattr(config, attribute, None)
        if value is not None:
            origin = (
                f"from {sources[attribute]}" if attribute in sources else "transformers' default: not in the header"
            )
            said.append(f"{attribute} = {value} ({origin})")
    return ", ".join(said)


def check_built_weights(path: Path, fields: dict[str, Any], shapes: list[tuple[int, ...]]) -> None:
    """At most `MAX_BUILT_PER_HELD` times the weights the tensors of `shapes` hold, else a `ValueError` naming the
    path, the part of the model that weighs most and the sizes (and their fields) that make it."""
    try:
        built = built_config(fields)
    except ValueError as error:
        raise ValueError(f"{path}: the GGUF header's sizes make no model: {error}.") from None
    if built is None:
        return
    config, sources = built
    groups = weight_groups(config)
    total, held = sum(weights for weights, _ in groups.values()), sum(math.prod(shape) for shape in shapes)
    if total <= MAX_BUILT_PER_HELD * held:
        return
    part, (weights, attributes) = max(groups.items(), key=lambda item: item[1][0])
    gib = total * 4 / 2**30
    memory = f"{gib:.1f} GiB" if gib >= 1 else f"{total * 4 / 2**20:.0f} MiB"
    raise ValueError(
        f"{path}: the GGUF header sizes a model of {total:,} weights ({memory} in float32), "
        f"{total / max(held, 1):,.0f} times the {held:,} its tensors hold in its {path.stat().st_size:,} bytes (at "
        f"most {MAX_BUILT_PER_HELD}x is accepted): nearly all of them would not be the file's. The most, "
        f"{weights:,}, in {part}: {_described(config, attributes, sources)}. The header is corrupt or was edited: a "
        "size field set too large, or left out so that transformers' default applies."
    )
