"""The README's quick start runs exactly as printed (offline, on the CPU here), and its shell commands need no activated
environment."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_quick_start_runs_as_printed(tmp_path, monkeypatch):
    quick_start = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)  # it writes tiny-model/ and out/ where it runs
    namespace: dict = {}
    exec(compile(quick_start, str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2
    assert trainer.args.num_generations == 16 and trainer.args.generation_batch_size == 16
    # a prompt and a default-length completion fit the tiny model's context (transformers warns past it)
    longest_prompt = max(
        len(trainer.processing_class(prompt)["input_ids"]) for prompt in namespace["dataset"]["prompt"]
    )
    assert longest_prompt + trainer.args.max_completion_length <= trainer.model.config.max_position_embeddings


def test_printed_commands_need_no_activated_environment():
    """A fresh shell after `make demo` has no `accelerate` or project `python` on its PATH (exit status 127): every
    command the README prints is `make ...` or calls `.venv/bin/...`."""
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    commands = [line for block in blocks for line in block.splitlines() if line and not line.startswith(" ")]
    assert len(commands) >= 3, commands
    assert [c for c in commands if not c.startswith(("make ", ".venv/bin/"))] == []
    assert re.findall(r"`((?:accelerate|python3?|pip|pytest|torchrun|deepspeed) [^`]*)`", text) == []
