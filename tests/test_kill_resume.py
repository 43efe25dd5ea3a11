"""docs/reliability.md's kill and resume check: its settings train (the weights move), and a run killed with SIGKILL
inside a save and resumed ends on the uninterrupted run's checkpoint, to the bit. `compare_checkpoints.py`, which
prints both, is checked on hand-made weights."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from compare_checkpoints import compare
from compare_checkpoints import main as compare_main

ROOT = Path(__file__).parent.parent
SECTION = "## Kill and resume check"


def documented_commands() -> list[list[str]]:
    """The section's `.venv/bin/python` commands, as words, in the order it prints them."""
    text = (ROOT / "docs" / "reliability.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [
        line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL) for line in block.splitlines()
    ]
    return [shlex.split(line) for line in lines if line.startswith(".venv/bin/python")]


def runnable(words: list[str], folder: Path) -> list[str]:
    """A documented command run by this interpreter, its outputs under `folder` instead of `outputs/`."""
    return [sys.executable] + [word.replace("outputs/", f"{folder}/") for word in words[1:]]


def test_the_documented_check_trains_and_a_run_killed_in_a_save_resumes_to_the_bit(tmp_path):
    """The earlier form of the check (`--tiny_model_warm_start_steps 10`) skipped every step: compared the starting
    weights with themselves and exited 1 here."""
    commands = documented_commands()
    uninterrupted, killed = commands[0], commands[1]
    comparison = commands[-1]
    assert killed == [word.replace("uninterrupted", "killed") for word in uninterrupted] + [
        "--resume_from_checkpoint",
        "true",
    ]  # the same run, resumed
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's trl_dapo
    run = subprocess.run(runnable(uninterrupted, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'dapo/skipped_steps': '0'" in run.stdout  # its one log, at step 5: no step was skipped

    started = subprocess.Popen(runnable(killed, tmp_path), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    while not (tmp_path / "kill-check" / "killed" / "checkpoint-2").exists() and started.poll() is None:
        time.sleep(0.02)
    started.send_signal(signal.SIGKILL)  # inside the second save
    assert started.wait() == -signal.SIGKILL
    resumed = subprocess.run(runnable(killed, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    compared = subprocess.run(runnable(comparison, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True)
    assert compared.returncode == 0, compared.stdout + compared.stderr[-3000:]
    moved = float(re.search(r"max \|dW\| (\S+) over 26 tensors", compared.stdout).group(1))
    assert 1e-4 < moved < 0.1  # 5 AdamW steps at learning rate 1e-3: each moves a weight by about 1e-3
    for name in ("model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "dapo_sampling_state.pt"):
        assert re.search(rf"  {re.escape(name)}: max \|difference\| 0\.000e\+00 over \d+ tensors; equal to the bit",
                         compared.stdout), compared.stdout  # fmt: skip


def test_compare_measures_the_largest_change_and_equality_to_the_bit():
    start = {"w": torch.tensor([0.0, 1.0, -2.0]), "b": torch.tensor([3.0])}
    end = {"w": torch.tensor([0.25, 1.0, -2.5]), "b": torch.tensor([3.0])}
    moved = compare(start, end)
    assert (moved.tensors, moved.largest, moved.unequal) == (2, 0.5, ["/w"])
    negative_zero = {"w": torch.tensor([-0.0, 1.0, -2.0]), "b": torch.tensor([3.0])}
    assert compare(start, negative_zero).largest == 0.0 and compare(start, negative_zero).unequal == ["/w"]
    state = {"rng": (3, np.array([1, 2], dtype=np.uint32), None), "step": 4}
    assert compare(state, {"rng": (3, np.array([1, 2], dtype=np.uint32), None), "step": 4}).equal
    assert compare(state, {"rng": (3, np.array([1, 5], dtype=np.uint32), None), "step": 4}).largest == 3.0
    assert compare(state, {"rng": (3, np.array([1, 2], dtype=np.uint32), None), "step": 5}).unequal == ["/step"]
    assert compare(state, {"step": 4}).unequal == ["/rng/0", "/rng/1", "/rng/2"]


def test_compare_fails_where_the_check_would_prove_nothing(tmp_path, capsys):
    for name, weight in (("start", 1.0), ("end", 1.0), ("other", 1.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.tensor([weight, 2.0])}, tmp_path / name / "model.safetensors")
    folders = ["--start", str(tmp_path / "start"), "--end", str(tmp_path / "end"), "--other", str(tmp_path / "other")]
    assert compare_main(folders) == 1
    assert "max |dW| 0.000e+00 over 1 tensors\n  no weight moved" in capsys.readouterr().out
    save_file({"w": torch.tensor([1.5, 2.0])}, tmp_path / "end" / "model.safetensors")
    save_file({"w": torch.tensor([1.5, 2.0])}, tmp_path / "other" / "model.safetensors")
    assert compare_main(folders) == 0
    printed = capsys.readouterr().out
    assert "max |dW| 5.000e-01 over 1 tensors" in printed
    assert "  model.safetensors: max |difference| 0.000e+00 over 1 tensors; equal to the bit" in printed
    torch.save({"state": {0: {"step": torch.tensor(1.0)}}}, tmp_path / "other" / "optimizer.pt")
    assert compare_main(folders) == 1  # a file in one checkpoint only
    assert "in one only: ['optimizer.pt']" in capsys.readouterr().out


def test_the_check_keeps_the_demos_warm_start():
    """Ten supervised steps left the tiny model never right: every group all wrong, every step skipped."""
    assert all("--tiny_model_warm_start_steps" not in words for words in documented_commands())
