"""The math recipe's `--config` YAML file, read within bounds before TRL's parser reads it.

YAML aliases repeat a node without repeating its text: nine levels of nine aliases (a few hundred bytes) stand for
387 million nodes, which TRL's parser expanded (it `str()`s each value it does not know and each `env:` value) and
an error message quoted whole (39 MB at seven levels). Here the file is refused past `MAX_BYTES`, past `MAX_DEPTH`
levels of nesting or past `MAX_NODES` nodes counted with every alias expanded (counted once per distinct node, so
the count itself costs what the file holds), and a key no argument takes, or an `env:` value that is not a single
value, is an error naming it with its value shortened, before any of it reaches TRL.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

import yaml

from trl_dapo.trainer.configuration import short_repr

MAX_BYTES = 1 << 20  # the shipped configs are under 4 KiB
MAX_NODES = 100_000  # with aliases expanded; the shipped configs hold under 200
MAX_DEPTH = 32  # levels of nesting; the shipped configs have 3


class _Bound:
    """Expanded node counts of a composed YAML document, each distinct node counted once, stopping at the bounds."""

    def __init__(self, path: Path) -> None:
        self.path, self.sizes, self.open = path, {}, set()

    def size(self, node: yaml.Node, depth: int = 1) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.open:
            raise ValueError(f"{self.path}: an alias refers to a node that contains it (line {_line(node)}).")
        if depth > MAX_DEPTH:
            raise ValueError(
                f"{self.path}: nested more than {MAX_DEPTH} levels deep (line {_line(node)}); a config holds "
                "settings, not data."
            )
        self.open.add(key)
        total = 1
        for child in _children(node):
            total += self.size(child, depth + 1)
            if total > MAX_NODES:
                raise ValueError(
                    f"{self.path}: more than {MAX_NODES} values once its aliases (*name) are expanded (from line "
                    f"{_line(node)}); a config holds settings, not data: write the values out, or drop the aliases "
                    "that repeat other aliases."
                )
        self.open.discard(key)
        self.sizes[key] = total
        return total


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def read_config_file(path: str | Path, arguments: Iterable[str]) -> dict:
    """The mapping in the YAML file at `path`, once its size, depth and expanded node count are within bounds, each
    of its keys is one of `arguments` (or `env`) and `env:` maps names to single values; else a `ValueError` naming
    the file and what to change."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than {MAX_BYTES}; a config holds settings, not data.")
    text = path.read_text()
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError as error:  # PyYAML composes nested nodes recursively
        raise ValueError(f"{path}: nested too deeply to read; a config holds settings, not data.") from error
    if root is not None:
        _Bound(path).size(root)
    config = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config is a YAML mapping of argument names to values, not {short_repr(config)}.")
    known = set(arguments)
    for key, value in config.items():
        if key != "env" and key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{path}: {short_repr(key)} (= {short_repr(value)}) is not an argument of this recipe{hint}; fix or "
                "remove it (--help lists them)."
            )
    _check_env(path, config.get("env", {}))
    return config


def _check_env(path: Path, env: object) -> None:
    """`env:` sets environment variables, each a single value."""
    if not isinstance(env, dict):
        raise ValueError(f"{path}: env must map variable names to values, not {short_repr(env)}.")
    for name, value in env.items():
        if not isinstance(name, str) or not isinstance(value, str | int | float | bool):
            raise ValueError(
                f"{path}: env {short_repr(name)} = {short_repr(value)}: an environment variable is a name and one "
                "value (a string or a number)."
            )
