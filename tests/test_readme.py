"""The README's quick start and its logging advice run exactly as printed (offline, on the CPU here); its commands
are checked with the docs' in test_printed_commands.py."""

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
README = TESTS.parent / "README.md"

# Builds a trainer on the CPU (its set-up logs the generation path and the padded passes at INFO) after the README's
# logging advice, then again once the script has configured logging itself.
LOGGING_SCRIPT = """
import logging, sys
sys.path.insert(0, {tests!r})
from helpers import arithmetic_prompts, dapo_args, length_reward
from trl_dapo import DAPOTrainer

def build(output):
    DAPOTrainer(model={model!r}, reward_funcs=length_reward, args=dapo_args(output), train_dataset=arithmetic_prompts(8))

{advice}
build({output!r} + "/a")
logging.basicConfig(stream=sys.stdout, format="configured %(levelname)s %(name)s: %(message)s")
build({output!r} + "/b")
"""


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


def test_the_logging_advice_shows_info_lines_once(tiny_model, tmp_path):
    """As the README prints it: a script with no logging set-up gets trl-dapo's INFO lines on stderr; once it
    configures logging, they reach its handler instead, none printed twice (a fresh process: pytest's own capture
    handlers would stand in for the script's)."""
    advice = next(
        block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL) if "verbosity" in block
    )
    script = LOGGING_SCRIPT.format(tests=str(TESTS), model=tiny_model, advice=advice, output=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    padded = "trl_dapo.trainer.training.passes:Training passes are padded: padding_free=None packs where flash attention runs"
    path = (
        "trl_dapo.trainer.collection.engine_choice:rollout_engine='auto': no CUDA device, using TRL's generation path."
    )
    assert run.stderr.count(f"INFO:{padded}") == 1 and run.stderr.count(f"INFO:{path}") == 1
    configured = run.stdout.splitlines()
    assert sum(line.startswith(f"configured INFO {padded.replace(':', ': ', 1)}") for line in configured) == 1
    assert sum(line == f"configured INFO {path.replace(':', ': ', 1)}" for line in configured) == 1
