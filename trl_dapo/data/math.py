"""Load math problems from the hub or local files, or generate arithmetic ones offline.

Two layouts are read:
- DAPO (DAPO-Math-17k, the DAPO AIME-2024 set): `prompt` (chat messages, template applied) and
  `reward_model.ground_truth`.
- Plain (most AIME/MATH copies): `problem` (or `question`) and `answer`; the DAPO prompt template is applied here.
Both come out as `prompt` (a one-message conversation) and `answer` (a string).
"""

from __future__ import annotations

import random
from pathlib import Path

from datasets import Dataset, DatasetDict, Value, load_dataset

from ..rewards.math import PROMPT_TEMPLATE
from .blank import blank_rows

DAPO_MATH_17K = "BytedTsinghua-SIA/DAPO-Math-17k"
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PROBLEM_COLUMNS = ("problem", "question")


def _load_raw(source: str, split: str) -> Dataset:
    path = Path(source)
    if path.suffix in LOCAL_FORMATS:
        if not path.exists():
            raise FileNotFoundError(f"dataset file {source} does not exist.")
        return load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    return load_dataset(source, split=split)


def _missing(columns: list[str], need: str) -> ValueError:
    return ValueError(
        f"math dataset: required column {need} is missing; columns found: {columns}. Expected either the DAPO "
        "layout (`prompt` messages + `reward_model.ground_truth`) or the plain layout (`problem` or `question` + "
        "`answer`)."
    )


def _check_rows(dataset: Dataset, column: str, field: str | None = None) -> None:
    """Every row holds a value in `column` (its `field`): a null question would become the text "None", a null answer
    a ground truth no completion can match, a NaN one the text "nan"."""
    blank = blank_rows(dataset, column, field)
    if blank:
        name = column if field is None else f"{column}.{field}"
        more = f" (and {len(blank) - 1} more: rows {blank[1:6]}{'...' if len(blank) > 6 else ''})" if blank[1:] else ""
        raise ValueError(
            f"math dataset: row {blank[0]}{more} has no value in column {name!r} (null, empty, NaN or infinite); drop "
            "such rows before loading (e.g. `dataset.filter(...)`) or fill them in."
        )


def to_prompt_answer(dataset: Dataset, template: str = PROMPT_TEMPLATE) -> Dataset:
    """Map either layout to `prompt` (conversation) + `answer` (string), dropping other columns; a row without a
    question or an answer is an error naming it."""
    columns = list(dataset.column_names)
    if "reward_model" in columns:
        if "prompt" not in columns:
            raise _missing(columns, "`prompt`")
        _check_rows(dataset, "prompt")
        _check_rows(dataset, "reward_model", "ground_truth")

        def from_dapo(row):
            truth = row["reward_model"]["ground_truth"]
            prompt = row["prompt"]
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            return {"prompt": messages, "answer": str(truth)}

        return dataset.map(from_dapo, remove_columns=columns)
    problem = next((name for name in PROBLEM_COLUMNS if name in columns), None)
    if problem is None:
        raise _missing(columns, "`problem` (or `question`)")
    if "answer" not in columns:
        raise _missing(columns, "`answer`")
    _check_rows(dataset, problem)
    _check_rows(dataset, "answer")

    dataset = dataset.cast_column("answer", Value("string"))  # numeric answers compare as text

    def from_plain(row):
        content = template.format(problem=row[problem])
        return {"prompt": [{"role": "user", "content": content}], "answer": row["answer"]}

    return dataset.map(from_plain, remove_columns=columns)


def load_math_dataset(source: str, split: str = "train", template: str = PROMPT_TEMPLATE) -> Dataset:
    """A hub id (`split` is used) or a local .json/.jsonl/.parquet/.csv file, in either layout."""
    return to_prompt_answer(_load_raw(source, split), template)


def arithmetic_dataset(
    num_train: int = 200, num_test: int = 50, max_operand: int = 9, seed: int = 0, template: str = "{problem}"
) -> DatasetDict:
    """Deterministic `What is a + b?` problems with exact answers, split into train and test sets (disjoint while
    `num_train + num_test` does not exceed the `(max_operand + 1) ** 2` distinct problems)."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    chosen = [pairs[i % len(pairs)] for i in range(num_train + num_test)]

    def split(rows: list[tuple[int, int]]) -> Dataset:
        columns = {"problem": [f"What is {a} + {b}?" for a, b in rows], "answer": [str(a + b) for a, b in rows]}
        return to_prompt_answer(Dataset.from_dict(columns), template)

    return DatasetDict({"train": split(chosen[:num_train]), "test": split(chosen[num_train:])})
