"""A package's imports of its own modules, read from the code with `ast` (nothing is imported): every `import` and
`from ... import` at any depth of a module (in functions, under `if TYPE_CHECKING:`), relative ones resolved, and
`from package import name` read as an import of the module `name` where there is one. The layout tests
(`test_trainer_layout.py`, `test_import_cycles.py`) read it.

An import of `a.b.c` is an import of that module only: Python runs `a.b`'s `__init__` first, but counting it would
make every package whose `__init__` gathers its modules' names a loop with them."""

import ast
from pathlib import Path
from typing import NamedTuple


class Import(NamedTuple):
    module: str  # the importing module, dotted
    target: str  # the module it imports, dotted
    type_only: bool
    line: int


def module_name(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    return ".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def package_imports(folder: Path, package: str) -> list[Import]:
    """Every import, at any depth of a module, of one module of `package` (in `folder`) by another."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = module_name(path, folder, package)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, type_only in _imports(ast.parse(path.read_text()), False):
            for target in _targets(node, here, folder, package):
                if target == package or target.startswith(package + "."):
                    found.append(Import(name, target, type_only, node.lineno))
    return found


def _imports(node: ast.AST, type_only: bool):
    """`(import node, whether it sits under if TYPE_CHECKING:)` for every import below `node`."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, type_only
    checking = isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    for child in ast.iter_child_nodes(node):
        yield from _imports(child, type_only or (checking and child in node.body))


def _targets(node: ast.Import | ast.ImportFrom, here: str, folder: Path, package: str) -> list[str]:
    """The modules an import statement in a module of package `here` reads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = here.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    # `from base import name`: the module `name` where there is one, else `base` (the package's face or a module)
    return [
        f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", folder, package) else base for alias in node.names
    ]


def _is_module(name: str, folder: Path, package: str) -> bool:
    if name != package and not name.startswith(package + "."):
        return False
    path = folder.joinpath(*name.removeprefix(package).lstrip(".").split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def loops(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The loops of a directed graph, each once (as its strongly connected component, sorted)."""
    graph = _graph(edges)
    reached = {node: _reach(graph, node) for node in graph}
    found = {tuple(sorted(n for n in reached[node] if node in reached[n])) for node in graph if node in reached[node]}
    return sorted(list(component) for component in found)


def shortest_loop(edges: set[tuple[str, str]], start: str) -> list[str]:
    """A shortest path from `start` back to itself, `[start, ..., start]`, or [] where none leads back."""
    graph = _graph(edges)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = node
                todo.append(nxt)
    return []


def _graph(edges: set[tuple[str, str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def write_package(folder: Path, files: dict[str, str]) -> None:
    """A made-up package for the tests of these readings: `{relative path: source}`."""
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
