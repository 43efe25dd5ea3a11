"""bf16 on a CPU without bf16 instructions (torch emulates it there, several times slower than float32): the trainer
warns once per process, naming `bf16=False`; the CPU's features are read as the kernel reports them."""

import logging
import platform
from pathlib import Path

import pytest

from helpers import alternating_reward, arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.trainer.configuration import cpu_bf16

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.exists(), reason="reads the CPU's features from Linux's /proc/cpuinfo")
def test_the_cpus_bf16_instructions_are_those_the_kernel_reports():
    flags = set()
    for line in CPUINFO.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    expected = bool(flags & {"avx512_bf16", "amx_bf16"}) if platform.machine() == "x86_64" else "bf16" in flags
    assert cpu_bf16.cpu_has_bf16_instructions() is expected


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    """This CPU as one without bf16 instructions, the warning not yet given in this process."""
    monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_instructions", lambda: False)
    cpu_bf16._warn_once.cache_clear()
    yield
    cpu_bf16._warn_once.cache_clear()


def build(tiny_model, output_dir, **overrides) -> DAPOTrainer:
    args = dapo_args(output_dir, num_generations=2, per_device_train_batch_size=4, **overrides)
    return DAPOTrainer(
        model=tiny_model, reward_funcs=alternating_reward, args=args, train_dataset=arithmetic_prompts(4)
    )


def emulated_bf16_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "CPU without bf16 instructions" in r.getMessage()]


def test_bf16_on_a_cpu_without_bf16_instructions_warns_once_naming_bf16_false(
    tiny_model, tmp_path, caplog, cpu_without_bf16
):
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        first = build(tiny_model, tmp_path / "a", bf16=None)  # the default: on with use_cpu=True, as TRL's
        build(tiny_model, tmp_path / "b", bf16=True)
    assert first.args.bf16 and first.accelerator.device.type == "cpu"
    warnings = emulated_bf16_warnings(caplog)
    assert len(warnings) == 1 and "Pass bf16=False (--bf16 false)" in warnings[0]


def test_no_warning_in_float32_or_on_a_cpu_with_bf16_instructions(tiny_model, tmp_path, caplog, monkeypatch):
    cpu_bf16._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="trl_dapo"):
        monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_instructions", lambda: False)
        build(tiny_model, tmp_path / "a", bf16=False)
        monkeypatch.setattr(cpu_bf16, "cpu_has_bf16_instructions", lambda: True)
        build(tiny_model, tmp_path / "b", bf16=True)
    assert emulated_bf16_warnings(caplog) == []
    cpu_bf16._warn_once.cache_clear()
