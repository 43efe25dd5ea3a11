"""The trainer package's layout: the trainer's side (`trainer.py`, `trl_view.py`, `set_up.py`) on top, four
sub-packages under it, and imports that run one way only, read from the code with `ast`.

Between sub-packages an import (a type-only one under `if TYPE_CHECKING:` included) goes only where `MAY_IMPORT`
allows, never up to the trainer's side, and through the sub-package's `__init__` (its public names), never into one
of its modules; the sub-packages import each other in no loop (no module of `trl_dapo/` imports another in a loop:
`test_import_cycles.py`). `docs/design.md`'s map names the sub-packages there are (the modules' length:
`test_file_length.py`)."""

import re
from pathlib import Path

from import_graph import loops, package_imports, write_package

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


def sub_package_loops(folder: Path, package: str) -> list[list[str]]:
    """Loops between the sub-packages (and the trainer's side), type-only imports included."""
    subs = sub_packages(folder)
    edges = {(unit(i.module, package, subs), unit(i.target, package, subs)) for i in package_imports(folder, package)}
    return loops({(a, b) for a, b in edges if a != b})


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


def test_the_design_map_names_the_sub_packages():
    assert mapped_sub_packages((ROOT / "docs" / "design.md").read_text()) == sub_packages(TRAINER)


def test_the_checks_find_an_upward_import_a_loop_and_a_reach_inside(tmp_path):
    """On a made-up package: a type-only import from the bottom sub-package up to another is wrong and makes a loop
    between them; one into a module rather than the face is wrong."""
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..top import Thing\n"
    write_package(
        tmp_path,
        {
            "__init__.py": "",
            "seam.py": "from .top import Thing\nfrom .low import Base\n",
            "low/__init__.py": "from .a import Base\n",
            "low/a.py": type_only,
            "low/b.py": "from .a import Base\n",
            "top/__init__.py": "from .c import Thing\n",
            "top/c.py": "from ..low import Base\nfrom ..low.b import helper\n",
        },
    )
    rules = {"low": set(), "top": {"low"}}
    assert wrong_crossings(tmp_path, "pkg", rules) == ["pkg.low.a:3 -> pkg.top", "pkg.top.c:2 -> pkg.low.b"]
    assert sub_package_loops(tmp_path, "pkg") == [["low", "top"]]
    write_package(tmp_path, {"low/a.py": "Base = 1\n", "top/c.py": "from ..low import Base\n"})
    assert wrong_crossings(tmp_path, "pkg", rules) == []
    assert sub_package_loops(tmp_path, "pkg") == []


def test_the_map_is_read_from_the_design_notes_first_block():
    design = "x\n```\ntrl_dapo/\n  trainer/   a\n    trainer.py  b\n    one/    c\n    two/     d\n  other/  e\n```\n"
    assert mapped_sub_packages(design) == {"one", "two"}
