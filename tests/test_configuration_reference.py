"""`docs/configuration.md` is the page `trl_dapo.trainer.configuration.reference` builds from `DAPOConfig` (its fields'
types, defaults and help, its docstring) and the rule tables its checks read: a field, a default, a help string or a
rule changed without the page fails here, with the command that regenerates it. What the page says a field takes is
what the config refuses: the choice tables are the checks' own."""

import difflib
from pathlib import Path

import pytest

from helpers import dapo_args
from trl_dapo.trainer.configuration.choices import FIELD_CHOICES, WITH_DYNAMIC_SAMPLING, WORDS_OR_NUMBER
from trl_dapo.trainer.configuration.config import DAPOConfig
from trl_dapo.trainer.configuration.grpo_fields import grpo_only_fields
from trl_dapo.trainer.configuration.reference import (
    COMMAND,
    Reference,
    allowed,
    docstring_problems,
    documented_fields,
)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_committed_page_is_the_generated_one():
    committed, generated = PAGE.read_text(), Reference().page()
    if committed != generated:
        diff = difflib.unified_diff(
            committed.splitlines(), generated.splitlines(), "docs/configuration.md", "generated", lineterm=""
        )
        pytest.fail(f"docs/configuration.md is out of date; regenerate it with\n    {COMMAND}\n" + "\n".join(diff))


def test_the_page_is_the_same_after_a_recipe_parsed_the_config():
    """transformers' HfArgumentParser rewrites each Optional field's `type` in place (`int | None` becomes `int`): a
    page generated in the same process after a recipe built its parser lost every `| None`."""
    from transformers import HfArgumentParser

    before = Reference().page()
    HfArgumentParser(DAPOConfig)
    assert Reference().page() == before
    assert "`int \\| None`" in before  # the type column keeps Optional (a table cell escapes the bar)


def test_every_field_dapo_adds_or_grpo_adds_is_on_the_page_once():
    """Each field DAPO adds has a row and its details; each field `GRPOConfig` adds to `TrainingArguments` is in one
    place: checked or with DAPO's default, rejected, or honoured as TRL documents it."""
    reference = Reference()
    assert reference.added and all(name in reference.documented for name in reference.added)
    placed = [*reference.changed, *reference.unhonoured, *reference.unchanged]
    assert sorted(name for name in placed if name in grpo_only_fields()) == sorted(grpo_only_fields())
    assert len(set(placed)) == len(placed)
    page = reference.page()
    for name in reference.added:
        assert page.count(f"| [`{name}`](#{name}) |") == 1
        assert page.count(f"### `{name}`\n") == 1


def test_what_a_field_takes_is_read_from_the_rule_tables():
    assert allowed("temperature") == "a finite number > 0"
    assert allowed("num_generations") == "an integer >= 2 (group advantages need at least 2 samples per prompt)"
    assert allowed("padding_free") == "a bool (True or False) or None"
    assert allowed("rollout_correction") == (
        "one of ('token_truncate', 'token_mask', 'sequence_truncate', 'sequence_mask') or None"
    )
    assert allowed("dynamic_sampling_oversample") == "'auto' or a finite number >= 1"
    assert allowed("multi_objective_aggregation") == "with dynamic_sampling=True: one of ('sum_then_normalize',)"
    assert allowed("dynamic_sampling_metric") == ""  # a reward function's name: checked when the trainer is built


@pytest.mark.parametrize("name", sorted(FIELD_CHOICES))
def test_a_value_outside_a_fields_choices_is_refused_naming_them(tmp_path, name):
    with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}='bogus' is invalid: use one of \("):
        dapo_args(tmp_path, **{name: "bogus"})


def test_the_narrowed_grpo_fields_and_the_words_or_number_are_checked_from_their_tables(tmp_path):
    for name, (choices, _) in WITH_DYNAMIC_SAMPLING.items():
        with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}='bogus' is invalid"):
            dapo_args(tmp_path, **{name: "bogus"})
        dapo_args(tmp_path, **{name: choices[0]})
    for name, (words, _) in WORDS_OR_NUMBER.items():
        with pytest.raises(ValueError, match=rf"^DAPOConfig\.{name}='0.5' is invalid: use 'auto' or a finite number"):
            dapo_args(tmp_path, **{name: "0.5"})
        assert getattr(dapo_args(tmp_path, **{name: words[0]}), name) == words[0]


def test_the_docstring_describes_each_field_dapo_declares_with_its_default():
    assert docstring_problems(DAPOConfig, documented_fields(DAPOConfig.__doc__)) == []
    made_up = """
    Parameters:
        clip_ratio_c (`float`, *optional*, defaults to `5.0`):
            Dual clip,
            on two lines.
    """
    documented = documented_fields(made_up)
    assert documented["clip_ratio_c"].description == "Dual clip, on two lines."
    problems = docstring_problems(DAPOConfig, documented)
    assert "clip_ratio_c: the docstring says it defaults to 5.0, the field to 10.0" in problems
    assert "dynamic_sampling: not described in DAPOConfig's docstring" in problems
