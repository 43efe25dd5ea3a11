"""A tiny causal LM and tokenizer built from code and saved to a folder, and its supervised warm start: the offline
stand-in the quick start, the demo and the math recipe run on.

Nothing can be downloaded in CI or offline set-ups, yet `DAPOTrainer(model=path)` should run the same loading code as
with a hub id: this writes a real `save_pretrained` folder (Qwen2 architecture, byte-level BPE tokenizer, ChatML template).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Qwen2's pre-tokenizer split (digits one by one, words with their leading space), so `AutoTokenizer`, which loads
# this folder as a `Qwen2Tokenizer`, tokenizes exactly as the tokenizer built here.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Text the byte-level BPE learns its merges from: the math prompt template and arithmetic, so such prompts are short.
CORPUS = [
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.",
    'Remember to put your answer on its own line after "Answer:".',
    *(f"What is {a} + {b}? Answer: {a + b}" for a in range(10) for b in range(10)),
]


def build_tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Qwen2-style byte-level BPE (Qwen2's pre-tokenizer, ChatML template) trained on a few sentences."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    output_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    kind: str = "causal_lm",
    tokenizer: PreTrainedTokenizerFast | None = None,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
) -> str:
    """Save a randomly initialised model (2 layers by default) and its tokenizer (the tiny BPE one by default) to
    `output_dir`; return the path. Its context holds a prompt and DAPOConfig's default completion length (512).

    `kind`: `"causal_lm"` (Qwen2), `"moe"` (Qwen3-MoE, 4 experts, returns the router load-balancing loss) or
    `"reward"` (a Qwen2 sequence classifier with one score, the shape of a reward model).
    """
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    shared = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if kind == "causal_lm":
        model = Qwen2ForCausalLM(Qwen2Config(**shared))
    elif kind == "moe":
        config = Qwen3MoeConfig(
            **shared,
            head_dim=hidden_size // num_heads,
            moe_intermediate_size=hidden_size // 2,
            num_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
        )
        model = Qwen3MoeForCausalLM(config)
    elif kind == "reward":
        model = Qwen2ForSequenceClassification(Qwen2Config(**shared, num_labels=1))
    else:
        raise ValueError(f"kind={kind!r}: use 'causal_lm', 'moe' or 'reward'.")
    if model.can_generate():
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    _save_from_this_process(model, tokenizer, Path(output_dir))
    return str(output_dir)


def _save_from_this_process(model, tokenizer, output_dir: Path) -> None:
    """Write the model and tokenizer from this process, whatever its rank: every process that builds the (seeded,
    identical) model can load it once this returns. Within a process group transformers writes a model's files on
    rank 0 only, which left the other ranks without weights; each process writes into a folder of its own beside
    `output_dir` and moves every file into place with an atomic replace, so processes building into one folder
    never read a partial file."""
    output_dir.mkdir(parents=True, exist_ok=True)
    # this process writes its copy, whatever its rank
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    with tempfile.TemporaryDirectory(dir=output_dir.parent, prefix=f".{output_dir.name}-") as private:
        model.save_pretrained(private)
        tokenizer.save_pretrained(private)
        for written in Path(private).iterdir():
            os.replace(written, output_dir / written.name)


def supervised_warm_start(
    model_dir: str | Path, prompts: list[list[dict]], answers: list[str], steps: int, learning_rate: float = 3e-3
) -> None:
    """Full-batch supervised steps on `prompt -> "Answer: <answer>"`, saved back to `model_dir`.

    RL starts from a model that already writes the answer format and is sometimes right; a random-init model never
    writes `Answer:` at all, so every math reward would be -1. Stopping this early leaves a partly right model,
    standing in for a base model's prior. Within a process group transformers saves on rank 0 only: run it on the
    main process while the others wait (the math recipe does, with `main_process_first`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows, prompt_lengths = [], []
    for prompt, answer in zip(prompts, answers, strict=True):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(f"Answer: {answer}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids)
        prompt_lengths.append(len(prompt_ids))
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    labels = torch.full_like(input_ids, -100)
    for index, (row, start) in enumerate(zip(rows, prompt_lengths, strict=True)):
        labels[index, start : len(row)] = input_ids[index, start : len(row)]
    attention_mask = (torch.arange(width) < torch.tensor([len(r) for r in rows]).unsqueeze(1)).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(steps):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)
