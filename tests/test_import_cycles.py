"""No module of `trl_dapo/` imports another in a loop, type-only imports (`if TYPE_CHECKING:`) and imports inside
functions included: a loop ties its modules into one, none of them read, tested or changed alone, and a runtime one
breaks at import time as soon as the order of the imports changes. Read from the code with `ast`
(`import_graph.py`)."""

from itertools import pairwise
from pathlib import Path

from import_graph import Import, loops, package_imports, shortest_loop, write_package

ROOT = Path(__file__).resolve().parent.parent


def import_loops(folder: Path, package: str) -> list[str]:
    """Each loop of the package's imports, once, as the path of imports that leads back to its start, each module with
    the line of its import of the next: `a:line -> b:line (type-only) -> a`, where b's import is under
    `if TYPE_CHECKING:`."""
    imports = package_imports(folder, package)
    edges = {(found.module, found.target) for found in imports}
    first: dict[tuple[str, str], Import] = {}
    for found in imports:
        first.setdefault((found.module, found.target), found)
    described = []
    for component in loops(edges):
        path = shortest_loop(edges, component[0])
        steps = []
        for source, target in pairwise(path):
            found = first[(source, target)]
            steps.append(f"{source}:{found.line}{' (type-only)' if found.type_only else ''}")
        described.append(" -> ".join([*steps, path[0]]))
    return described


def test_no_module_of_the_package_imports_another_in_a_loop():
    found = import_loops(ROOT / "trl_dapo", "trl_dapo")
    assert found == [], "import loops (break each: a base type or a shared type in a module both sides read):\n" + (
        "\n".join(found)
    )


def test_a_loop_is_found_through_every_kind_of_import(tmp_path):
    """On a made-up package: a loop through a type-only import, one through an import inside a function and
    `from package import module`, and one through an absolute import and a relative import two levels up, each
    found and printed as its path; a package whose `__init__` gathers its modules' names is no loop with them."""
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    write_package(
        tmp_path,
        {
            "__init__.py": "from .a import A\nfrom .c import C\n",
            "a.py": type_only,
            "b.py": "from .a import A\n",
            "c.py": "def late():\n    from .sub import d\n",
            "sub/__init__.py": "",
            "sub/d.py": "from pkg import c\n",
            "sub/deep/__init__.py": "",
            "sub/deep/e.py": "from ...sub import f\n",
            "sub/f.py": "import pkg.sub.deep.e\n",
        },
    )
    assert import_loops(tmp_path, "pkg") == [
        "pkg.a:3 (type-only) -> pkg.b:1 -> pkg.a",
        "pkg.c:2 -> pkg.sub.d:1 -> pkg.c",
        "pkg.sub.deep.e:1 -> pkg.sub.f:1 -> pkg.sub.deep.e",
    ]
    write_package(tmp_path, {"a.py": "A = 1\n", "sub/d.py": "D = 1\n", "sub/f.py": "F = 1\n"})
    assert import_loops(tmp_path, "pkg") == []


def test_the_shortest_way_back_is_the_loop_printed():
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("b", "a"), ("c", "d")}
    assert shortest_loop(edges, "a") == ["a", "b", "a"]
    assert shortest_loop(edges, "c") == ["c", "a", "b", "c"]
    assert shortest_loop(edges, "d") == []
    assert shortest_loop({("x", "x")}, "x") == ["x", "x"]
