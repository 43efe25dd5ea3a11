"""bf16 autocast on a CPU without bf16 instructions. There torch emulates bf16 arithmetic, and a training step can take
several times as long as in float32. `DAPOConfig`'s default turns bf16 on with `use_cpu=True`, as TRL's does, so the
trainer warns once per process, naming `bf16=False`."""

from __future__ import annotations

import functools
import logging
import platform

import torch

logger = logging.getLogger(__name__)

# The features torch's CPU report names for bf16 arithmetic: AVX512-BF16 and AMX-BF16 on x86, BF16 (NEON, SVE) on Arm.
BF16_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")


def cpu_has_bf16_instructions() -> bool | None:
    """Whether this CPU has bf16 instructions; None where the installed torch cannot tell (one without
    `torch.cpu.get_capabilities`, on a CPU other than x86)."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        found = capabilities()
        return any(found.get(feature, False) for feature in BF16_FEATURES)
    if platform.machine().lower() in X86_MACHINES:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return None


def warn_if_cpu_bf16_is_emulated(bf16: bool, device: torch.device) -> None:
    """Warn (once per process) when bf16 autocast is to run on a CPU without bf16 instructions."""
    if bf16 and device.type == "cpu" and cpu_has_bf16_instructions() is False:
        _warn_once()


@functools.cache
def _warn_once() -> None:
    logger.warning(
        "bf16 autocast runs on a CPU without bf16 instructions (AVX512-BF16 or AMX on x86, BF16 on Arm), where torch "
        "emulates it: a training step can take several times as long as in float32. Pass bf16=False (--bf16 false) "
        "to train in float32."
    )
