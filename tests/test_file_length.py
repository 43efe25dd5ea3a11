"""No module of the rollout engine is longer than `MAX_LINES` lines: the engine grows by kernels, cache formats and
schedulers, and a module that holds several of them is read, reviewed and changed as one; a longer one is cut where
its parts meet (the engine's math, one call's state machine, the kernels, the quantisation). The trainer's modules,
one concern each in their sub-packages, stay under `TRAINER_MAX_LINES`."""

from pathlib import Path

ROLLOUT = Path(__file__).resolve().parent.parent / "trl_dapo" / "rollout"
MAX_LINES = 600
TRAINER = ROLLOUT.parent / "trainer"
TRAINER_MAX_LINES = 450


def long_modules(folder: Path, limit: int) -> dict[str, int]:
    """`{path: lines}` of every Python module under `folder` longer than `limit` lines."""
    found = {}
    for path in sorted(folder.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found[str(path.relative_to(folder))] = lines
    return found


def test_no_module_of_the_rollout_engine_is_longer_than_the_limit():
    assert long_modules(ROLLOUT, MAX_LINES) == {}, (
        f"cut these modules where their parts meet, at most {MAX_LINES} lines"
    )


def test_no_module_of_the_trainer_is_longer_than_its_limit():
    assert long_modules(TRAINER, TRAINER_MAX_LINES) == {}, (
        f"cut these modules where their parts meet, at most {TRAINER_MAX_LINES} lines"
    )


def test_a_module_is_measured_in_lines(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "long.py").write_text("x = 1\n" * 5)
    assert long_modules(tmp_path, 4) == {"nested/long.py": 5}
    assert long_modules(tmp_path, 5) == {}
