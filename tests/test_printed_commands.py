"""Every command README.md, docs/*.md and benchmarks/README.md print runs as printed from the repository root in a
fresh shell with no environment activated: it calls `.venv/bin/...` or `make`, and its script or module, with the
printed arguments and `--help` appended, parses them (argparse stops at the first unknown option or choice before it
reaches `--help`), and every file it names exists or is written by an earlier printed command (`--help` would not
see a missing one). Only sections headed "On a GPU machine" (benchmarks/README.md's, docs/multi-gpu.md's plan) use that
machine's own `python3` and `pip`; their module commands are checked the same way. Nothing here needs a GPU or the network."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Sections whose commands run in another shell: a GPU machine's own python3, with no .venv.
OTHER_MACHINE_HEADING = "## On a GPU machine"
SETTING = r"[A-Z_]+=\S*"  # an environment setting before a command, NAME=value
EXECUTABLE = rf"(?:{SETTING}\s+)*(?:\.venv/bin/\S+|python3?|pip3?|accelerate|pytest|torchrun|deepspeed|make)\s+\S"
# Words naming a file a command reads (or writes, after an output option); shell expansions are not checked.
FILE_SUFFIXES = (".gguf", ".json", ".jsonl", ".yaml", ".yml", ".py", ".safetensors", ".txt", ".csv", ".whl", ".pt")
OUTPUT_OPTIONS = ("--output", "--output_dir", "--output-dir")
# A fresh login shell: no VIRTUAL_ENV, no .venv/bin on PATH.
FRESH_SHELL = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}

# Runs in `.venv/bin/python` from the repository root: each (target, arguments) as `python [-m] target arguments
# --help` would, one interpreter for all; prints the ones whose arguments did not parse.
PARSE_EVERY_COMMAND = """
import contextlib, io, json, os, runpy, sys
failed = []
for kind, target, arguments in json.loads(sys.argv[1]):
    sys.argv = [target, *arguments, "--help"]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            if kind == "module":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` puts it first
                runpy.run_path(target, run_name="__main__")
        code = "no exit at --help"
    except SystemExit as stop:
        code = stop.code
    except Exception as error:
        code = repr(error)
    if code not in (0, None):
        failed.append([target, arguments, code, errors.getvalue()[-600:]])
print(json.dumps(failed))
"""


def _lines_and_sections(text: str) -> list[tuple[str, str, bool]]:
    """(candidate command, heading it is under, whether it is inline prose) for each code line and code span; a
    line ending in a backslash is joined to the next."""
    found, heading, fenced, pending = [], "", None, ""
    for raw in text.splitlines():
        if raw.startswith("#") and fenced is None:
            heading = raw.strip()
        if raw.startswith("```"):
            fenced = None if fenced is not None else raw[3:].strip()
            continue
        code = fenced in ("bash", "sh") or (fenced is None and raw.startswith("    "))
        if code:
            line = pending + " " + raw.strip() if pending else raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].strip()
                continue
            pending = ""
            found.append((line, heading, False))
        elif fenced is None:
            found += [(span, heading, True) for span in re.findall(r"`([^`]+)`", raw)]
    return found


def printed_commands() -> list[tuple[Path, str, str, bool]]:
    """(document, command, heading, whether inline) for every printed command, `&&` chains split, comments dropped."""
    commands = []
    for document in DOCUMENTS:
        for line, heading, inline in _lines_and_sections(document.read_text()):
            for part in line.split("&&"):
                command = re.sub(r"\s+#.*$", "", part).strip()
                if re.match(EXECUTABLE, command):
                    commands.append((document, command, heading, inline))
    return commands


def _words(command: str) -> list[str]:
    """The command's words from the executable on, after any `NAME=value` environment settings."""
    words = shlex.split(command)
    return words[next(index for index, word in enumerate(words) if not re.fullmatch(SETTING, word)) :]


def _targets(command: str, inline: bool) -> list[tuple[str, str, list[str]]]:
    """The python targets a command runs, ("module" | "script", name, arguments); arguments of a sketch in prose
    (`--check ...`) are not checked. `accelerate launch` runs its script; its config file must exist."""
    words = _words(command)
    program, rest = Path(words[0]).name, words[1:]
    if program == "accelerate":
        assert rest[0] == "launch", command
        options = rest[1:]
        config = options[options.index("--config_file") + 1] if "--config_file" in options else None
        assert config is None or (ROOT / config).is_file(), command
        script = next(index for index, word in enumerate(options) if word.endswith(".py"))
        kind, target, arguments = "script", options[script], options[script + 1 :]
    elif program.startswith("python"):
        if rest[0] == "-c":  # a line of Python, no script
            return []
        if rest[0] == "-m":
            kind, target, arguments = "module", rest[1], rest[2:]
        else:
            kind, target, arguments = "script", rest[0], rest[1:]
    else:
        return []
    return [(kind, target, [] if inline and "..." in arguments else arguments)]


def test_every_printed_command_calls_the_venv_or_make_outside_the_other_machines_section():
    commands = printed_commands()
    assert len(commands) >= 60  # README, docs/performance.md, docs/ablation.md and benchmarks/README.md all print some
    bare = [
        (document.name, command)
        for document, command, heading, _ in commands
        if not _words(command)[0].startswith((".venv/bin/", "make")) and not heading.startswith(OTHER_MACHINE_HEADING)
    ]
    assert bare == []


def test_every_printed_command_runs_as_printed_in_a_fresh_shell():
    """`make` targets exist (a dry run), `.venv/bin/accelerate` starts, and every python command's script or module
    parses its printed arguments; the tests `pytest` commands name are collected. Bare `python3` commands of the other
    machine's section are checked with `.venv/bin/python`, the same modules."""
    targets, make_commands, pytest_commands = [], set(), []
    for _, command, _, inline in printed_commands():
        words = _words(command)
        if words[0] == "make":
            make_commands.add(tuple(words[1:]))
        elif words[1:3] == ["-m", "pytest"]:
            pytest_commands.append(words[3:])
        elif words[1:3] != ["-m", "pip"] and not words[0].startswith("pip"):
            targets += _targets(command, inline)
    distinct = sorted({(kind, target, tuple(arguments)) for kind, target, arguments in targets})
    assert {target for _, target, _ in distinct} >= {"benchmarks.trainer.bench_step", "recipes/dapo_ablation.py"}

    run = subprocess.run(
        [".venv/bin/python", "-c", PARSE_EVERY_COMMAND, json.dumps([list(target) for target in distinct])],
        cwd=ROOT, env=FRESH_SHELL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == []
    for arguments in sorted(make_commands):
        dry_run = subprocess.run(["make", "-n", *arguments], cwd=ROOT, env=FRESH_SHELL, capture_output=True, text=True)
        assert dry_run.returncode == 0, (arguments, dry_run.stderr)
    tests = sorted({word for arguments in pytest_commands for word in arguments if word.startswith("tests/")})
    collected = subprocess.run(
        [".venv/bin/python", "-m", "pytest", *tests, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=FRESH_SHELL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert collected.returncode == 0 and len(tests) >= 3, (tests, collected.stdout[-2000:])
    launcher = subprocess.run(
        [".venv/bin/accelerate", "launch", "--help"], cwd=ROOT, env=FRESH_SHELL, capture_output=True
    )
    assert launcher.returncode == 0


def named_files(command: str) -> tuple[list[str], list[str]]:
    """(files the command reads, files it writes): its words with a file suffix, an output option's value among the
    written ones; words with a shell expansion are left out."""
    reads, writes, words = [], [], _words(command)
    for index, word in enumerate(words[1:], start=1):
        value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
        if value.startswith("-") or "$" in value or not value.endswith(FILE_SUFFIXES):
            continue
        written = words[index - 1] in OUTPUT_OPTIONS or word.split("=", 1)[0] in OUTPUT_OPTIONS
        (writes if written else reads).append(value)
    return reads, writes


def test_every_file_a_printed_command_reads_exists_or_an_earlier_command_writes_it():
    written, missing = set(), []
    for document, command, _, inline in printed_commands():
        if inline and "..." in command:  # a sketch in prose
            continue
        reads, writes = named_files(command)
        missing += [(document.name, path) for path in reads if not (ROOT / path).exists() and path not in written]
        written.update(writes)
    assert missing == []


def test_named_files_tells_what_a_command_reads_from_what_it_writes():
    reads, writes = named_files(
        ".venv/bin/python recipes/x.py --model model.gguf --config=a.yaml --output out.json --name '$(y).json'"
    )
    assert reads == ["recipes/x.py", "model.gguf", "a.yaml"] and writes == ["out.json"]
