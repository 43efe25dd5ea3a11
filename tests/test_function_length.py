"""No function of the package is longer than `MAX_LINES` lines (its signature, docstring and body): a longer one is
cut into named steps, so each can be read, tested and changed alone."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trl_dapo"
MAX_LINES = 80


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """`(name, lines)` of every function (methods and nested functions included) longer than `limit` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_of_the_package_is_longer_than_the_limit():
    found = {
        f"{path.relative_to(PACKAGE)}:{name}": lines
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, lines in long_functions(path.read_text(), MAX_LINES)
    }
    assert found == {}, f"cut these into named steps of at most {MAX_LINES} lines"


def test_a_function_is_measured_from_its_def_to_its_last_line():
    source = (
        "def short():\n    return 1\n\n\nclass A:\n    def long(self):\n"
        + "        x = 1\n" * 4
        + "        return x\n"
    )
    assert long_functions(source, 5) == [("long", 6)]
    assert long_functions(source, 6) == []
