"""The README's quick start runs exactly as printed (offline, on the CPU here)."""

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
