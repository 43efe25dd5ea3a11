"""What `use_vllm=True` needs before any model loads: vLLM installed (else the install line of the tested version),
and in server mode a server that answers within `vllm_server_timeout` (TRL's own check asks with no timeout: a server
that accepted the connection and never answered hung the trainer's set-up); the colocate example and the math recipe
with `--use_vllm` stop before loading anything where vLLM or CUDA is missing."""

import configparser
import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import trl.generation.vllm_client
import trl.generation.vllm_generation
from trl import ModelConfig, TrlParser

import dapo_math
import dapo_vllm_colocate
from benchmarks.kit.gpu_kit_build import VLLM_VERSION
from dapo_math import RecipeConfig, ScriptArguments
from helpers import arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.trainer.collection.vllm_path import VLLM_INSTALL

INSTALL = re.escape('`pip install "trl-dapo[vllm]"` (vLLM 0.26.0, which needs torch 2.11.0 and a CUDA GPU')


def always(reward: float):
    def constant(completions, **kwargs) -> list[float]:
        return [reward] * len(completions)

    return constant


def vllm_trainer(model: str, output, **settings) -> DAPOTrainer:
    args = dapo_args(output, use_vllm=True, per_device_train_batch_size=8, **settings)
    return DAPOTrainer(model=model, reward_funcs=always(1.0), args=args, train_dataset=arithmetic_prompts(8))


def test_without_vllm_the_tested_versions_install_line_comes_before_any_model_loads(tmp_path):
    """TRL's error came once the model had loaded, and named `pip install trl[vllm]` (the newest vLLM TRL admits)."""
    assert not trl.generation.vllm_generation.is_vllm_available()
    absent = str(tmp_path / "no-model-here")  # loading it would fail: the error must come first
    with pytest.raises(ImportError, match=rf"^DAPOConfig.use_vllm=True needs vLLM, .*{INSTALL}"):
        vllm_trainer(absent, tmp_path / "out", vllm_mode="colocate")


@pytest.fixture
def trls_own_client(monkeypatch):
    """TRL's real `VLLMClient` (whose check of the server would hang), vLLM's presence faked where TRL asks."""
    for module in (trl.generation.vllm_generation, trl.generation.vllm_client):
        monkeypatch.setattr(module, "is_vllm_available", lambda *args, **kwargs: True)


def built_within(seconds: float, build) -> BaseException | None:
    """What building raised (None: nothing), failing the test when it is still running after `seconds`."""
    raised = []

    def run() -> None:
        try:
            build()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the trainer's set-up still runs after {seconds} s"
    return raised[0] if raised else None


def test_a_server_that_accepts_and_never_answers_is_named_within_its_timeout(tiny_model, tmp_path, trls_own_client):
    with socket.socket() as silent:  # connections queue in its backlog: accepted by the kernel, never answered
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        settings = dict(vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=port, vllm_server_timeout=1)
        # generous against the 1 s asked for; with no bound on TRL's ask the set-up never ends
        error = built_within(60, lambda: vllm_trainer(tiny_model, tmp_path, **settings))
    expected = (
        f"the vLLM server at http://127.0.0.1:{port} did not answer http://127.0.0.1:{port}/health within "
        "vllm_server_timeout=1 s (it accepted the connection but sent no answer)"
    )
    assert isinstance(error, ConnectionError) and expected in str(error), error


def test_a_server_that_is_not_there_is_named_with_its_base_url(tmp_path, trls_own_client):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"  # bound, not listening: connections are refused
        with pytest.raises(ConnectionError, match=rf"server at {re.escape(url)} did not answer .* \(no connection"):
            vllm_trainer(str(tmp_path / "no-model-here"), tmp_path, vllm_mode="server", vllm_server_base_url=url,
                         vllm_server_timeout=0.5)  # fmt: skip


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None or torch.cuda.is_available(), reason="here vLLM or CUDA is present"
)
def test_the_colocate_example_stops_before_loading_anything_without_vllm_or_cuda(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "recipes" / "dapo_vllm_colocate.py"),
        "--model",
        str(tmp_path / "absent.gguf"),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([*command, "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, env=env)
    expected = (
        'dapo_vllm_colocate: cannot run here: vLLM is not installed: `pip install "trl-dapo[vllm]"` installs the '
        f"tested version (docs/vllm.md); no CUDA GPU is visible to torch {torch.__version__}: vLLM runs in this "
        "process on one.\n"
    )
    assert (result.returncode, result.stderr[-len(expected) :]) == (1, expected), result.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("has_vllm", "has_cuda"), [(False, True), (True, False), (True, True)])
def test_the_colocate_example_names_what_is_missing(monkeypatch, has_vllm, has_cuda):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *rest: object() if name == "vllm" and has_vllm else real_find_spec(name, *rest),
    )
    missing = dapo_vllm_colocate.missing_for_colocate()
    assert [("vLLM is not installed" in line, "no CUDA GPU" in line) for line in missing] == (
        [(True, False)] * (not has_vllm) + [(False, True)] * (not has_cuda)
    )


def test_the_math_recipe_with_vllm_stops_before_building_its_model(tmp_path):
    """`--use_vllm true --vllm_mode colocate` reach DAPOConfig; without vLLM the recipe stops before its model."""
    parser = TrlParser((ScriptArguments, RecipeConfig, ModelConfig))
    config = ROOT / "recipes" / "configs" / "tiny_cpu.yaml"
    arguments = [
        "--config",
        str(config),
        "--use_vllm",
        "true",
        "--vllm_mode",
        "colocate",
        "--output_dir",
        str(tmp_path),
    ]
    script_args, training_args, model_args = parser.parse_args_and_config(args=arguments)
    with pytest.raises(ImportError, match=rf"needs vLLM, .*{INSTALL}"):
        dapo_math.main(script_args, training_args, model_args)
    assert not (tmp_path / "tiny-model").exists()


def test_the_vllm_extra_the_docs_and_the_kit_name_one_version():
    """The install line the errors give installs the vLLM the docs and the GPU kit name, with vLLM 0.26.0's own pins
    (its metadata on PyPI: `torch==2.11.0`, `transformers>=5.5.3`)."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extra = set(setup["options.extras_require"]["vllm"].split())
    assert extra == {f"vllm=={VLLM_VERSION}", "torch==2.11.0", "transformers>=5.5.3,<6"}
    assert VLLM_INSTALL == 'pip install "trl-dapo[vllm]"'
    docs = (ROOT / "docs" / "vllm.md").read_text()
    assert 'pip install -e ".[vllm]"' in docs and f"**{VLLM_VERSION}** only" in docs
