"""`make install` takes torch from PyTorch's CPU index where it answers, and PyPI's build of the same version where it
cannot be reached (pip says only "No matching distribution" then), with a notice naming the index and the size.

Run in a copy of the Makefile with no pip configuration and no network: PyPI is a local stand-in index, PyTorch's CPU
index either another stand-in or a closed local port, and each holds a stand-in `torch` wheel of a few hundred bytes
(so no test here can pull a CUDA build). The install then stops at the package's own dependencies, which the stand-in
PyPI lacks: these tests read which torch went in before that."""

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


def stand_in_index(folder: Path, version: str) -> str:
    """A PEP 503 index in `folder` holding one `torch` wheel of `version` (pure Python, no dependencies); its URL."""
    wheel = f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / wheel, "w") as archive:
        archive.writestr("torch/__init__.py", f"__version__ = {version!r}\n")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    (folder / "simple" / "torch").mkdir(parents=True)
    (folder / "simple" / "torch" / "index.html").write_text(f'<a href="../../{wheel}">{wheel}</a>\n')
    return (folder / "simple").as_uri()


def make_install(tmp_path: Path, torch_index: str) -> subprocess.CompletedProcess:
    """`make install` in a copy of the Makefile, PyPI's stand-in holding torch 2.13.0."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("Makefile", "setup.cfg", "pyproject.toml"):
        shutil.copy(ROOT / name, project / name)
    pypi = tmp_path / "pypi"
    pypi.mkdir()
    fresh_shell = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "PIP_CONFIG_FILE": os.devnull,  # no wheel folder, no mirror: only the indexes named here
        "PIP_INDEX_URL": stand_in_index(pypi, "2.13.0"),
        "PIP_RETRIES": "0",
    }
    return subprocess.run(
        ["make", "install", f"TORCH_INDEX={torch_index}"],
        cwd=project, env=fresh_shell, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def installed_torch(tmp_path: Path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "project" / ".venv").glob("lib/python*/site-packages/torch-*"))


def reached_the_package_install(run: subprocess.CompletedProcess) -> bool:
    """The torch step succeeded: make went on to the package's own install, the last command it ran, which fails
    for want of the package's dependencies in the stand-in PyPI."""
    return run.returncode != 0 and run.stdout.rstrip().endswith('.venv/bin/python -m pip install -q -e ".[dev]"')


def test_an_unreachable_pytorch_index_falls_back_to_pypis_torch_with_a_notice(tmp_path):
    run = make_install(tmp_path, f"{CLOSED}/whl/cpu")
    assert "No matching distribution found for torch==2.13.0+cpu" in run.stderr  # all pip itself says
    assert f"make: PyTorch's index {CLOSED}/whl/cpu cannot be reached from here (<urlopen error" in run.stderr
    assert "make: installing PyPI's torch==2.13.0 instead, a CUDA build: a wheel of about 0.5 GB" in run.stderr
    assert installed_torch(tmp_path) == ["torch-2.13.0.dist-info"]
    assert reached_the_package_install(run)
    assert not (tmp_path / "project" / ".venv" / ".installed").exists()


def test_the_cpu_index_comes_first_where_it_answers(tmp_path):
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    run = make_install(tmp_path, stand_in_index(cpu, "2.13.0+cpu"))
    assert installed_torch(tmp_path) == ["torch-2.13.0+cpu.dist-info"]
    assert "cannot be reached" not in run.stderr and "PyPI's torch" not in run.stderr
    assert reached_the_package_install(run)
