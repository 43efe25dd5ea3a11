"""`make install` where PyTorch's CPU index cannot be reached: pip says only "No matching distribution" (or
"ResolutionImpossible"); the Makefile names the unreachable index and the two ways to install without it. Run in a
copy of the Makefile with both indexes on a closed local port and no pip configuration, so no network is needed."""

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def test_an_unreachable_pytorch_index_is_named_with_the_ways_to_install_without_it(tmp_path):
    for name in ("Makefile", "setup.cfg", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    fresh_shell = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PIP_CONFIG_FILE": os.devnull,  # no wheel folder, no mirror: pip finds torch nowhere
        "PIP_INDEX_URL": f"{CLOSED}/simple",
        "PIP_RETRIES": "0",
    }
    run = subprocess.run(
        ["make", "demo", f"TORCH_INDEX={CLOSED}/whl/cpu"],
        cwd=tmp_path, env=fresh_shell, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert "No matching distribution found for torch==2.13.0+cpu" in run.stderr  # all pip itself says
    assert f"PyTorch's index {CLOSED}/whl/cpu cannot be reached from here (<urlopen error" in run.stderr
    assert "point pip at it: PIP_FIND_LINKS=/path/to/wheels make demo\n" in run.stderr
    assert "(a CUDA build of several GB): make demo TORCH=torch==2.13.0 TORCH_INDEX=\n" in run.stderr
    assert not (tmp_path / ".venv" / ".installed").exists()
