"""`DAPOConfig`'s reference page, `docs/configuration.md`, built from the config itself: each field's type, default and
`help` from the dataclass, what it takes from the rule tables it is checked with (`field_rules.FIELD_RULES`,
`choices.FIELD_CHOICES` and its neighbours, `grpo_fields.unhonoured_fields`), and each field's description from the
class docstring. `COMMAND` writes it; `tests/test_configuration_reference.py` fails when the page and the code
differ."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import NamedTuple

import trl
from transformers import TrainingArguments
from trl import GRPOConfig

from .choices import FIELD_CHOICES, WITH_DYNAMIC_SAMPLING, WORDS_OR_NUMBER, choices_text, words_or_number_text
from .config import DAPOConfig
from .field_rules import FIELD_RULES
from .grpo_fields import GENERIC_REASON, REASONS, field_default, grpo_only_fields, unhonoured_fields

COMMAND = ".venv/bin/python -m trl_dapo.trainer.configuration.reference --output docs/configuration.md"
TRL_DOCS = f"https://huggingface.co/docs/trl/v{trl.__version__}/en/grpo_trainer#trl.GRPOConfig"
TRAINING_ARGUMENTS_DOCS = (
    "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"
)
# A field's entry in the docstring: "name (`type`, *optional*, defaults to `value`):", its description indented below.
_ENTRY = re.compile(r"^ {8}(\w+) \((.*), \*optional\*, defaults to `(.*)`\):$")


class Documented(NamedTuple):
    default: str  # as the docstring writes it
    description: str


def documented_fields(docstring: str) -> dict[str, Documented]:
    """Each field the class docstring describes (its `Parameters:` entries), by name, in the docstring's order."""
    found: dict[str, Documented] = {}
    name, default, lines = None, "", []
    for line in [*docstring.splitlines(), ""]:
        if name is not None and line.startswith(" " * 12):
            lines.append(line.strip())
            continue
        if name is not None:
            found[name] = Documented(default, " ".join(lines))
            name = None
        if entry := _ENTRY.match(line):
            name, default, lines = entry.group(1), entry.group(3), []
    return found


def docstring_problems(config_class: type, documented: dict[str, Documented]) -> list[str]:
    """Each field the class declares itself that its docstring does not describe, or describes with another default
    than the field's: the page's details would leave it out, or say what the code does not do."""
    problems, own = [], inspect.get_annotations(config_class)
    for field in dataclasses.fields(config_class):
        if field.name not in own:
            continue
        if field.name not in documented:
            problems.append(f"{field.name}: not described in {config_class.__name__}'s docstring")
        elif ast.literal_eval(documented[field.name].default) != field_default(field):
            problems.append(
                f"{field.name}: the docstring says it defaults to {documented[field.name].default}, the field to "
                f"{field_default(field)!r}"
            )
    return problems


def type_name(config_class: type, field: dataclasses.Field) -> str:
    """`int`, `str | None`: as the class annotates the field (a string under `from __future__ import annotations`).
    Read from the annotations, not `field.type`: transformers' `HfArgumentParser` rewrites that in place when it
    parses the class (an `X | None` becomes `X`), so a page generated after a recipe built its parser would differ."""
    annotation = next(inspect.get_annotations(klass)[field.name] for klass in config_class.__mro__
                      if field.name in inspect.get_annotations(klass))  # fmt: skip
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def allowed(name: str) -> str:
    """What a field takes on its own, in words, from the rule tables its checks read ("" where none constrains it)."""
    parts = []
    if name in FIELD_RULES:
        rule = FIELD_RULES[name]
        parts.append(rule.expected_range() + (f" ({rule.hint})" if rule.hint else ""))
    if name in FIELD_CHOICES:
        parts.append(choices_text(FIELD_CHOICES[name]))
    if name in WORDS_OR_NUMBER:
        parts.append(words_or_number_text(name))
    if name in WITH_DYNAMIC_SAMPLING:
        parts.append(f"with dynamic_sampling=True: {choices_text(WITH_DYNAMIC_SAMPLING[name][0])}")
    return "; ".join(parts)


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value: object) -> str:
    return f"`{value!r}`"


class Reference:
    """The page's parts, read once from the installed classes."""

    def __init__(self) -> None:
        self.fields = {f.name: f for f in dataclasses.fields(DAPOConfig)}
        self.trl_defaults = {f.name: field_default(f) for f in dataclasses.fields(GRPOConfig)}
        self.training_arguments = {f.name for f in dataclasses.fields(TrainingArguments)}
        self.documented = documented_fields(DAPOConfig.__doc__ or "")
        problems = docstring_problems(DAPOConfig, self.documented)
        if problems:
            raise ValueError("DAPOConfig's docstring and fields differ; fix the docstring:\n" + "\n".join(problems))
        self.added = [name for name in self.fields if name not in self.trl_defaults]
        self.unhonoured = unhonoured_fields()
        self.changed = [  # inherited and honoured, with DAPO's default or a rule of DAPO's
            name
            for name in self.fields
            if name in self.trl_defaults
            and name not in self.unhonoured
            and (allowed(name) or self._default_differs(name))
        ]
        self.unchanged = [
            name for name in grpo_only_fields() if name not in self.unhonoured and name not in self.changed
        ]

    def _default_differs(self, name: str) -> bool:
        return field_default(self.fields[name]) != self.trl_defaults[name]

    def _name(self, name: str) -> str:
        return f"[`{name}`](#{name})" if name in self.documented else f"`{name}`"

    def _default(self, name: str) -> str:
        text = _code(field_default(self.fields[name]))
        if name in self.trl_defaults and self._default_differs(name):
            text += f" (GRPOConfig: {_code(self.trl_defaults[name])})"
        return text

    def _row(self, name: str) -> str:
        field = self.fields[name]
        cells = [self._name(name), f"`{type_name(DAPOConfig, field)}`", self._default(name), allowed(name) or "—"]
        return "| " + " | ".join([*map(_cell, cells), _cell(field.metadata.get("help", ""))]) + " |"

    def page(self) -> str:
        inherited_from_trl = [name for name in self.changed if name not in self.training_arguments]
        inherited_from_transformers = [name for name in self.changed if name in self.training_arguments]
        sections = [
            _INTRO.format(command=COMMAND, trl=trl.__version__, trl_docs=TRL_DOCS),
            "## Fields DAPO adds\n",
            _HEADER,
            *map(self._row, self.added),
            "\n## Inherited fields DAPO sets or checks\n",
            "Fields whose default DAPO changes, or whose type and range (or, with dynamic sampling, values) "
            "`DAPOConfig` checks. The help is DAPO's where it changes the default, else TRL's or transformers'.\n",
            "### From `GRPOConfig`\n",
            _HEADER,
            *map(self._row, inherited_from_trl),
            "\n### From `TrainingArguments`\n",
            _HEADER,
            *map(self._row, inherited_from_transformers),
            "\n## `GRPOConfig` fields DAPOTrainer does not honour\n",
            "Each must stay at its default: set to anything else, it is a `ValueError` naming it, its default and "
            "why, when the config is built (as is any field a later TRL adds, until it is reviewed).\n",
            "| fields (the default each must keep) | why |\n|---|---|",
            *self._unhonoured_rows(),
            "\n## Other fields\n",
            f"Honoured as [TRL documents them]({TRL_DOCS}), with TRL's defaults: "
            + ", ".join(f"`{name}`" for name in self.unchanged)
            + ". Every other field is one of the Hugging Face Trainer's `TrainingArguments` ([transformers' "
            f"reference]({TRAINING_ARGUMENTS_DOCS})), which DAPOTrainer runs unchanged; `GRPOConfig` gives some of "
            "them defaults of its own (TRL's reference lists them). Any of these fields typed as a number must hold "
            "one of its type, finite (`save_total_limit`, `label_smoothing_factor`...).\n",
            "## Details\n",
            "The description of each field DAPO adds or gives its own default, from `DAPOConfig`'s docstring.\n",
            *self._details([*self.added, *self.changed, *self.unhonoured]),
        ]
        return "\n".join(sections)

    def _unhonoured_rows(self) -> list[str]:
        """One row per reason, naming the fields it rejects."""
        by_reason: dict[str, list[str]] = {}
        for name in self.unhonoured:
            by_reason.setdefault(REASONS.get(name, GENERIC_REASON), []).append(
                f"{self._name(name)} = {self._default(name)}"
            )
        return [f"| {_cell(', '.join(names))} | {_cell(reason)} |" for reason, names in by_reason.items()]

    def _details(self, names: list[str]) -> list[str]:
        return [f"### `{name}`\n\n{self.documented[name].description}\n" for name in names if name in self.documented]


_HEADER = "| field | type | default | takes | help |\n|---|---|---|---|---|"
_INTRO = """# `DAPOConfig` reference

<!-- Generated from trl_dapo/trainer/configuration/ by `{command}`: do not edit by hand. -->

`DAPOConfig` is TRL {trl}'s [`GRPOConfig`][GRPOConfig] with the DAPO paper's defaults and the fields DAPO adds. It
checks its fields when it is built, before any model loads: a value of the wrong type (such as `"3"` from a notebook
widget) is a `TypeError` naming the field and the type it takes, and a value outside what the field *takes*, or a
`GRPOConfig` field DAPOTrainer would ignore, is a `ValueError` naming the field and the fix. Settings that only work
together are checked there too (for example stream mode and partial rollouts need the paged engine, FP8 rollouts a
recomputed old policy and a rollout correction, `epsilon_high` is at least `epsilon`, and a generation batch holds
whole groups); each field's [details](#details) say what it needs.

[GRPOConfig]: {trl_docs}
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DAPOConfig's reference page (Markdown), from its fields and rules.")
    parser.add_argument("--output", type=Path, help="the file to write it to (default: print it)")
    output = parser.parse_args(argv).output
    page = Reference().page()
    if output is None:
        print(page, end="")
    else:
        output.write_text(page)


if __name__ == "__main__":
    main()
