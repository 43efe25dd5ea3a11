"""What the benchmarks run on: model configs, random-init models on the device, a word tokenizer, prompts, rewards,
and the bytes a decode step of a model must read.

Random init keeps the benchmarks download-free. With a 2,048-token vocabulary (the `-v2048` configs) a random-init
model ends a row with EOS (id 2 of the word tokenizer) with probability about 1/2,048 per step, so completion lengths
are geometric with mean about 2,000, capped at the maximum: DAPO's long, uneven tail.
"""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from trl_dapo.tiny_model import CHAT_TEMPLATE, build_tiny_model

BENCHMARKS = Path(__file__).parents[1]  # the benchmarks folder: its configs/ and results/
EOS_TOKEN_ID, PAD_TOKEN_ID = 2, 0  # of the word tokenizer and of the tiny model's tokenizer alike
# transformers' continuous batching sizes its cache from the host's memory on the CPU, which takes minutes to set up:
# the CPU smoke runs give it a small one (`transformers_continuous_batching_config`).
CPU_CB_CONFIG = {"num_blocks": 32, "max_batch_tokens": 512}


@functools.cache
def config_path(name: str) -> Path:
    """`benchmarks/configs/<name>.json`, or for "tiny" the tiny local model, built into a temporary folder."""
    if name == "tiny":
        folder = Path(tempfile.mkdtemp())
        build_tiny_model(folder)
        return folder / "config.json"
    return BENCHMARKS / "configs" / f"{name}.json"


def random_model(config_path: Path, device: str, dtype: torch.dtype | None, seed: int = 0):
    """Random init directly on the device (initialising a 1.5B model on the host takes longer than a step)."""
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_path)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def with_lora(model, rank: int, b_std: float = 0.0):
    """`model` wrapped in a LoRA adapter of `rank` on every linear layer (alpha = 2 x rank). PEFT starts B at zero, a
    no-op adapter; `b_std > 0` draws B from N(0, b_std²), so the adapter changes the weights as a trained one does."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear")).eval()
    if b_std:
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=b_std)
    return model


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One token per word `t<i>` for every id of the model's vocabulary, so any sampled id decodes."""
    vocab = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": 1, "<|im_end|>": EOS_TOKEN_ID}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def prompts(count: int, words: int = 24, vocab_size: int = 5100) -> Dataset:
    """Chat prompts of `words` words, every word inside the vocabulary (ids 100 to min(vocab_size, 5100) - 1)."""
    span = min(vocab_size, 5100) - 100
    rows = [" ".join(f"t{100 + (7 * i + 13 * j) % span}" for j in range(words)) for i in range(count)]
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": r}] for r in rows], "index": list(range(count))})


def token_prompts(rows: int, length: int, vocab_size: int, group: int = 16, seed: int = 0) -> list[list[int]]:
    """Prompt ids as DAPO generates them: groups of `group` consecutive identical prompts, random ids in [3, vocab)."""
    generator = torch.Generator().manual_seed(seed)
    groups = torch.randint(3, vocab_size, (-(-rows // group), length), generator=generator).tolist()
    return [groups[row // group] for row in range(rows)]


def geometric_lengths(rows: int, cap: int, end_probability: float, seed: int = 0) -> list[int]:
    """Per-row completion lengths as a random-init model samples them, drawn once so that every engine can be given
    the same ones: the end token comes with `end_probability` at each step (1/vocabulary for a near-uniform model), so
    a length is geometric on 1, 2, ... (the end token counted) and cut at `cap`. Inverse CDF of a seeded uniform:
    P(L > k) = (1 - p)^k."""
    if not 0 < end_probability < 1:
        raise ValueError(f"end_probability={end_probability} must be in (0, 1).")
    uniform = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lengths = torch.floor(torch.log1p(-uniform) / math.log1p(-end_probability)) + 1
    return lengths.clamp(max=cap).long().tolist()


def parity_reward(completion_ids, **kwargs) -> list[float]:
    return [float(sum(ids) % 2) for ids in completion_ids]


def uninformative_reward(fraction: float):
    """Groups of prompts with index % 100 < fraction*100 get a constant reward (filtered); others vary."""

    def reward(completion_ids, index, **kwargs) -> list[float]:
        return [
            0.0 if i % 100 < fraction * 100 else float(sum(ids) % 2)
            for ids, i in zip(completion_ids, index, strict=True)
        ]

    return reward


def decode_weight_bytes(model, bytes_per_value: int = 2) -> int:
    """Bytes of the weights one decode step reads: every parameter but the input embedding table (a step gathers a
    row per sequence from it), the output projection included (the same tensor when tied). LoRA adapters are left
    out: the engine decodes with them merged."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings().weight
    tied = embedding is base.get_output_embeddings().weight
    read = [p for name, p in base.named_parameters() if "lora_" not in name and (tied or p is not embedding)]
    return sum(p.numel() for p in read) * bytes_per_value


def kv_bytes_per_token(config, bytes_per_value: int = 2) -> int:
    """Bytes of one position's keys and values over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * bytes_per_value
