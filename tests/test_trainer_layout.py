"""The trainer package's layout: the trainer's side (`trainer.py`, `trl_view.py`, `set_up.py`) on top, four
sub-packages under it, and imports that run one way only, read from the code with `ast`.

Between sub-packages an import (a type-only one under `if TYPE_CHECKING:` included) goes only where `MAY_IMPORT`
allows, never up to the trainer's side, and through the sub-package's `__init__` (its public names), never into one
of its modules; the sub-packages import each other in no loop. Inside one, modules import each other in no loop
outside type-only imports. `docs/design.md`'s map names the sub-packages there are (the modules' length:
`test_file_length.py`)."""

import ast
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "trl_dapo" / "trainer"
PACKAGE = "trl_dapo.trainer"
TOP = "the trainer's side"  # the modules directly in trl_dapo/trainer/: they may import every sub-package
# What each sub-package may import of the others; none may import the trainer's side.
MAY_IMPORT = {
    "configuration": set(),
    "collection": {"configuration"},
    "training": {"configuration"},
    "safety": {"configuration", "training"},
}


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
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = here.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    if node.module:
        return [base]
    # `from . import name`: the module `name` where there is one, else the package's face
    return [
        f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", folder, package) else base for alias in node.names
    ]


def _is_module(name: str, folder: Path, package: str) -> bool:
    path = folder.joinpath(*name.removeprefix(package).lstrip(".").split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def sub_packages(folder: Path) -> set[str]:
    return {path.parent.name for path in folder.glob("*/__init__.py")}


def unit(name: str, package: str, subs: set[str]) -> str:
    """The sub-package a module belongs to, or `TOP` for the modules directly in the package."""
    first = name.removeprefix(package).lstrip(".").split(".")[0]
    return first if first in subs else TOP


def wrong_crossings(folder: Path, package: str, may_import: dict[str, set[str]]) -> list[str]:
    """Imports between sub-packages that `may_import` does not allow (upward to the trainer's side included), and
    imports into a sub-package's module rather than its `__init__`: `module:line -> target`, type-only ones too."""
    subs = sub_packages(folder)
    wrong = []
    for found in package_imports(folder, package):
        source, goal = unit(found.module, package, subs), unit(found.target, package, subs)
        if source == goal:
            continue
        upward = goal == TOP or (source != TOP and goal not in may_import.get(source, set()))
        inside = goal != TOP and found.target != f"{package}.{goal}"
        if upward or inside:
            wrong.append(f"{found.module}:{found.line} -> {found.target}")
    return wrong


def loops(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The loops of a directed graph, each once (as its strongly connected component, sorted)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {node: reach(node) for node in graph}
    found = {tuple(sorted(n for n in reached[node] if node in reached[n])) for node in graph if node in reached[node]}
    return sorted(list(component) for component in found)


def sub_package_loops(folder: Path, package: str) -> list[list[str]]:
    """Loops between the sub-packages (and the trainer's side), type-only imports included."""
    subs = sub_packages(folder)
    edges = {(unit(i.module, package, subs), unit(i.target, package, subs)) for i in package_imports(folder, package)}
    return loops({(a, b) for a, b in edges if a != b})


def module_loops(folder: Path, package: str) -> list[list[str]]:
    """Loops between modules outside type-only imports (between sub-packages there are none once the rules hold, so
    these are the loops inside one)."""
    return loops({(i.module, i.target) for i in package_imports(folder, package) if not i.type_only})


def mapped_sub_packages(design: str) -> set[str]:
    """The folders the map in `docs/design.md` (its first code block) lists under `trainer/`."""
    block = re.search(r"```\n(.*?)```", design, re.DOTALL).group(1)
    names, inside = set(), False
    for line in block.splitlines():
        if line.startswith("  trainer/"):
            inside = True
        elif inside and not line.startswith("    "):
            break
        elif inside and (match := re.match(r"    (\w+)/\s", line)):
            names.add(match.group(1))
    return names


def test_imports_between_the_sub_packages_run_one_way():
    assert sub_packages(TRAINER) == set(MAY_IMPORT)
    assert wrong_crossings(TRAINER, PACKAGE, MAY_IMPORT) == [], (
        "import only what MAY_IMPORT allows, through the sub-package's __init__ (its public names)"
    )
    assert sub_package_loops(TRAINER, PACKAGE) == []


def test_no_loop_inside_a_sub_package_but_type_only_ones():
    assert module_loops(TRAINER, PACKAGE) == []


def test_the_design_map_names_the_sub_packages():
    assert mapped_sub_packages((ROOT / "docs" / "design.md").read_text()) == sub_packages(TRAINER)


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_find_an_upward_import_a_loop_and_a_reach_inside(tmp_path):
    """On a made-up package: a type-only import from the bottom sub-package up to another is wrong and makes a loop
    between them; one into a module rather than the face is wrong; a runtime loop inside a sub-package is found, a
    type-only one is not."""
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import Thing\n"
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "seam.py": "from .top import Thing\nfrom .low import Base\n",
            "low/__init__.py": "from .a import Base\n",
            "low/a.py": type_only + "from . import b\n",
            "low/b.py": "from .a import Base\n",
            "top/__init__.py": "from .c import Thing\n",
            "top/c.py": "from ..low import Base\nfrom ..low.b import helper\nfrom .d import x\n",
            "top/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import Thing\n",
        },
    )
    rules = {"low": set(), "top": {"low"}}
    assert wrong_crossings(tmp_path, "pkg", rules) == ["pkg.low.a:3 -> pkg.top", "pkg.top.c:2 -> pkg.low.b"]
    assert sub_package_loops(tmp_path, "pkg") == [["low", "top"]]
    assert module_loops(tmp_path, "pkg") == [["pkg.low.a", "pkg.low.b"]]
    _write(tmp_path, {"low/a.py": "Base = 1\n", "top/c.py": "from ..low import Base\nfrom .d import x\n"})
    assert wrong_crossings(tmp_path, "pkg", rules) == []
    assert sub_package_loops(tmp_path, "pkg") == []
    assert module_loops(tmp_path, "pkg") == []


def test_the_map_is_read_from_the_design_notes_first_block():
    design = "x\n```\ntrl_dapo/\n  trainer/   a\n    trainer.py  b\n    one/    c\n    two/     d\n  other/  e\n```\n"
    assert mapped_sub_packages(design) == {"one", "two"}
