"""The TRL boundary: TRL changes the private attributes and methods of `GRPOTrainer` (and of the transformers
`Trainer` under it) between minor versions, so only `trainer/trainer.py` (the hooks) and `trainer/trl_view.py` (what
the other parts are handed) touch them. A TRL upgrade is audited there, name by name against `READ_AT_THE_BOUNDARY`.

TRL's private names are read from the installed classes, not written down: every name `dir(GRPOTrainer)` lists that
starts with one underscore (methods, class attributes) and every `self._name` their modules assign (instance
attributes such as `_metrics`). A module's own private members (`self._step` of the paged engine's generation) are
not TRL's: an access through `self` counts only in a class built on TRL's trainer."""

import ast
import inspect
import sys
from pathlib import Path

from trl import GRPOTrainer

PACKAGE = Path(__file__).resolve().parent.parent / "trl_dapo"
BOUNDARY = ("trainer/trainer.py", "trainer/trl_view.py")
# TRL's private names the boundary reads, calls or overrides: what to check when TRL changes.
READ_AT_THE_BOUNDARY = [
    "_buffered_inputs",
    "_calculate_rewards",
    "_compute_loss",
    "_defer_fsdp_gradient_reduction",
    "_generate_and_score_completions",
    "_generate_single_turn",
    "_get_output_dir",
    "_get_per_token_logps_and_entropies",
    "_get_train_sampler",
    "_is_vlm",
    "_issue_warnings_after_load",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_log_metric",
    "_metrics",
    "_name",
    "_prepare_inputs",
    "_run_epoch",
    "_save_checkpoint",
    "_step",
    "_tag_names",
    "_tokenize_prompts",
    "_tokenizer",
]


def trl_private_names() -> set[str]:
    names = {name for name in dir(GRPOTrainer) if name.startswith("_") and not name.startswith("__")}
    for cls in GRPOTrainer.__mro__:
        if cls.__module__.split(".")[0] not in ("trl", "transformers"):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(sys.modules[cls.__module__]))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                names.add(node.attr)
    return names


def private_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """`(line, name)` of every use of one of `names` in `source`: an attribute (`x._name`, `Class._name`), a name a
    class defines in its body (an override) or a string handed to `getattr` and its siblings. Attributes of `self`
    count only inside a class built on a trainer (elsewhere they are the class's own)."""
    uses = []

    def visit(node: ast.AST, in_trainer_class: bool) -> None:
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base).split(".")[-1] for base in node.bases}
            in_trainer_class = bool(bases & {"GRPOTrainer", "Trainer", "DAPOTrainer"})
            for statement in node.body if in_trainer_class else []:
                for name in _defined_names(statement) & names:
                    uses.append((statement.lineno, name))
        if isinstance(node, ast.Attribute) and node.attr in names:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if in_trainer_class or not own:
                uses.append((node.lineno, node.attr))
        if _names_an_attribute(node) and node.args[1].value in names:
            uses.append((node.lineno, node.args[1].value))
        for child in ast.iter_child_nodes(node):
            visit(child, in_trainer_class)

    visit(ast.parse(source), False)
    return uses


def _names_an_attribute(node: ast.AST) -> bool:
    """`getattr(x, "name")`, `setattr`, `hasattr` or `delattr` with the name written out."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    )


def _defined_names(statement: ast.stmt) -> set[str]:
    """The names a statement of a class body defines: a method, or the targets of an assignment."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
        return {statement.name}
    targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
    return {target.id for target in targets if isinstance(target, ast.Name)}


def package_uses(names: set[str]) -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        uses = private_uses(path.read_text(), names)
        if uses:
            found[path.relative_to(PACKAGE).as_posix()] = uses
    return found


def test_trls_private_names_are_read_only_at_the_boundary():
    names = trl_private_names()
    assert {"_metrics", "_tokenizer", "_generate_and_score_completions", "_get_train_sampler"} <= names
    uses = package_uses(names)
    outside = {path: found for path, found in uses.items() if path not in BOUNDARY}
    assert outside == {}, f"TRL's private names used outside {BOUNDARY}: read them in trl_view.py instead"
    read = sorted({name for path in BOUNDARY for _, name in uses.get(path, [])})
    assert read == READ_AT_THE_BOUNDARY, "a TRL private name was added to or dropped from the boundary: list it"


def test_the_scan_finds_each_kind_of_use():
    """The scanner on a made-up module: an attribute of a held trainer, a TRL method called on its class, a string
    given to getattr and an override are found; a class's own `self._step` is not, a trainer subclass's is."""
    source = """
class Collaborator:
    def __init__(self, trainer):
        self.metrics = trainer._metrics
        self.forward = GRPOTrainer._get_per_token_logps_and_entropies
        self.tokenizer = getattr(trainer, "_tokenizer")

    def run(self):
        self._step()


class Subclass(GRPOTrainer):
    _tag_names = ["dapo"]

    def _prepare_inputs(self, inputs):
        return self._step
"""
    uses = private_uses(source, trl_private_names())
    assert uses == [
        (4, "_metrics"),
        (5, "_get_per_token_logps_and_entropies"),
        (6, "_tokenizer"),
        (13, "_tag_names"),
        (15, "_prepare_inputs"),
        (16, "_step"),
    ]
