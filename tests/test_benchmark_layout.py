"""The benchmarks' layout: every module in a sub-package by concern, none with more than `MOST_MODULES` modules, and
imports that run one way only, read from the code with `ast` (`import_graph.py`; type-only ones under
`if TYPE_CHECKING:` and imports inside functions included). `core` (what every benchmark shares) and `kit` (the GPU
kit) import none of the others; the others import `core`, and `peers` also `rollout`'s measurements; nothing imports
in a loop. A module that moves leaves no stale name behind: every `benchmarks.<module>` and `benchmarks/<path>.py`
that code, tests and docs name exists, and `benchmarks/README.md` lists every module under its sub-package."""

import re
from pathlib import Path

from import_graph import loops, package_imports, write_package

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
PACKAGE = "benchmarks"
MOST_MODULES = 10
# What each sub-package may import of the others.
MAY_IMPORT = {
    "core": set(),
    "kit": set(),
    "rollout": {"core"},
    "trainer": {"core"},
    "multi_gpu": {"core"},
    "peers": {"core", "rollout"},
}
# Where benchmark modules are named: code, tests and docs; not docs/history.md (the past as it was) nor this file's
# made-up examples.
NAMING = ["README.md", "Makefile", "benchmarks/**/*.py", "benchmarks/README.md", "docs/*.md", "recipes/**/*.py"]
NAMING += ["tests/*.py", "trl_dapo/**/*.py"]
NOT_READ = {"docs/history.md", "tests/test_benchmark_layout.py"}
DOTTED = re.compile(r"(?<![\w/.-])benchmarks((?:\.\w+)+)")
PATH = re.compile(r"(?<![\w/.-])benchmarks/([\w/]+\.py)\b")


def sub_packages(folder: Path) -> set[str]:
    return {path.parent.name for path in folder.glob("*/__init__.py")}


def unit(module: str, package: str) -> str:
    """The sub-package a module belongs to ("" for the package itself or a module directly in it)."""
    parts = module.removeprefix(package).lstrip(".").split(".")
    return parts[0] if len(parts) > 1 else ""


def loose_modules(folder: Path) -> list[str]:
    """The modules outside every sub-package (the package's own `__init__.py` aside)."""
    return sorted(path.name for path in folder.glob("*.py") if path.name != "__init__.py")


def crowded_folders(folder: Path) -> dict[str, int]:
    """The folders with more than `MOST_MODULES` modules (`__init__.py` aside), with their count."""
    counts = {
        str(sub.relative_to(folder)): sum(1 for path in sub.glob("*.py") if path.name != "__init__.py")
        for sub in [folder, *(path.parent for path in folder.rglob("__init__.py"))]
    }
    return {name: count for name, count in counts.items() if count > MOST_MODULES}


def forbidden_imports(folder: Path, package: str, may_import: dict[str, set[str]]) -> list[str]:
    """Imports from one sub-package into another that `may_import` does not allow (into the package's own
    `__init__` included): `module:line -> target`, type-only ones too."""
    wrong = []
    for found in package_imports(folder, package):
        source, goal = unit(found.module, package), unit(found.target, package)
        if source != goal and goal not in may_import.get(source, set()):
            wrong.append(f"{found.module}:{found.line} -> {found.target}")
    return wrong


def import_loops(folder: Path, package: str) -> list[list[str]]:
    """Loops between the sub-packages, then between the modules, type-only imports included."""
    imports = package_imports(folder, package)
    units = {(unit(i.module, package), unit(i.target, package)) for i in imports}
    return loops({(a, b) for a, b in units if a != b}) + loops({(i.module, i.target) for i in imports})


def is_module(dotted: str, root: Path) -> bool:
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def stale_names(text: str, root: Path) -> list[str]:
    """The benchmark modules and files a text names that do not exist under `root`: `benchmarks.a.b` must be a module
    or package (or a name in a module: `benchmarks.a.b.NAME`), `benchmarks/a/b.py` a file."""
    stale = []
    for match in DOTTED.finditer(text):
        dotted = "benchmarks" + match.group(1)
        owner = dotted.rpartition(".")[0]
        if not is_module(dotted, root) and not root.joinpath(*owner.split(".")).with_suffix(".py").is_file():
            stale.append(dotted)
    stale += [f"benchmarks/{name}" for name in PATH.findall(text) if not (root / "benchmarks" / name).is_file()]
    return stale


def test_every_module_lives_in_a_sub_package_of_at_most_ten():
    assert sub_packages(BENCHMARKS) == set(MAY_IMPORT), "a new sub-package needs its rule in MAY_IMPORT"
    assert loose_modules(BENCHMARKS) == [], "put each module in the sub-package of its concern"
    assert crowded_folders(BENCHMARKS) == {}


def test_imports_between_the_sub_packages_run_one_way():
    assert forbidden_imports(BENCHMARKS, PACKAGE, MAY_IMPORT) == [], "import only what MAY_IMPORT allows"
    assert import_loops(BENCHMARKS, PACKAGE) == []


def test_every_benchmark_module_named_in_code_tests_and_docs_exists():
    named = {path for pattern in NAMING for path in ROOT.glob(pattern) if path.is_file()}
    stale = {
        str(path.relative_to(ROOT)): found
        for path in sorted(named)
        if str(path.relative_to(ROOT)) not in NOT_READ and (found := stale_names(path.read_text(), ROOT))
    }
    assert stale == {}


def test_the_readme_lists_every_module_under_its_sub_package():
    readme = (BENCHMARKS / "README.md").read_text()
    modules = {str(path.relative_to(BENCHMARKS)) for path in BENCHMARKS.glob("*/*.py") if path.name != "__init__.py"}
    assert {module for module in modules if f"({module})" not in readme} == set()


def test_the_checks_find_a_loose_module_a_crowded_folder_a_sideways_import_and_a_loop(tmp_path):
    """On a made-up package: a type-only import from `low` up to `top` is forbidden and closes a loop, so is one
    between two siblings (inside a function) and one of a module outside the sub-packages, which is loose; eleven
    modules in one folder crowd it."""
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top.c import Thing\n"
    write_package(
        tmp_path,
        {
            "__init__.py": "",
            "loose.py": "",
            "low/__init__.py": "",
            "low/a.py": type_only,
            "top/__init__.py": "",
            "top/c.py": "from pkg.low.a import Base\n\n\ndef late():\n    from pkg.side.d import other\n",
            "side/__init__.py": "",
            "side/d.py": "import pkg.top.c\nfrom pkg import loose\n",
            **{f"crowd/m{index}.py": "" for index in range(MOST_MODULES + 1)},
            "crowd/__init__.py": "",
        },
    )
    rules = {"low": set(), "top": {"low"}, "side": {"low"}, "crowd": set()}
    assert loose_modules(tmp_path) == ["loose.py"]
    assert crowded_folders(tmp_path) == {"crowd": MOST_MODULES + 1}
    assert forbidden_imports(tmp_path, "pkg", rules) == [
        "pkg.low.a:3 -> pkg.top.c",
        "pkg.side.d:1 -> pkg.top.c",
        "pkg.side.d:2 -> pkg.loose",
        "pkg.top.c:5 -> pkg.side.d",
    ]
    assert import_loops(tmp_path, "pkg") == [["low", "side", "top"], ["pkg.low.a", "pkg.side.d", "pkg.top.c"]]
    write_package(tmp_path, {"low/a.py": "Base = 1\n", "top/c.py": "from pkg.low.a import Base\n"})
    write_package(tmp_path, {"side/d.py": "from pkg.low import a\n"})
    assert forbidden_imports(tmp_path, "pkg", rules) == []
    assert import_loops(tmp_path, "pkg") == []


def test_a_stale_module_or_file_name_is_found(tmp_path):
    write_package(
        tmp_path, {"benchmarks/__init__.py": "", "benchmarks/core/__init__.py": "", "benchmarks/core/t.py": ""}
    )
    text = (
        "python -m benchmarks.core.t --x; from benchmarks.core.t import NAME; benchmarks/core/t.py; benchmarks/core/\n"
        "python -m benchmarks.t; import benchmarks.core.gone; benchmarks/t.py; docs/benchmarks.md; `benchmarks.`\n"
    )
    assert stale_names(text, tmp_path) == ["benchmarks.t", "benchmarks.core.gone", "benchmarks/t.py"]
