import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import end_sooner
from trl_dapo.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ending_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model whose greedy rows end at lengths set by their prompt (`helpers.end_sooner`), saved."""
    folder = tmp_path_factory.mktemp("ending-model")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    end_sooner(AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
