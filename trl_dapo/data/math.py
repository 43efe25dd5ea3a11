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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, Value, load_dataset

from ..rewards.math import PROMPT_TEMPLATE, is_missing
from .blank import blank_rows
from .kinds import MESSAGES, NUMBER, TEXT, arrow_kind, check_kind, column_type

DAPO_MATH_17K = "BytedTsinghua-SIA/DAPO-Math-17k"
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
PROBLEM_COLUMNS = ("problem", "question")
NO_ROWS = "an empty file, a JSON `[]`, a CSV header alone and a parquet file of 0 rows have no rows to train on"


def _holds_only_whitespace(path: Path) -> bool:
    with path.open("rb") as file:
        return not any(block.strip() for block in iter(lambda: file.read(1 << 16), b""))


def _load_file(path: Path) -> Dataset:
    """A local file's rows; an empty or unreadable file is a `ValueError` naming it, the format and the fix."""
    name, kind = f"math dataset file {path}", LOCAL_FORMATS[path.suffix]
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist.")
    if _holds_only_whitespace(path):
        raise ValueError(f"{name} is empty: {NO_ROWS}. Check that the file was written whole.")
    try:
        empty = kind == "parquet" and pq.read_metadata(path).num_rows == 0  # its loader fails with "BatchSize"
        dataset = None if empty else load_dataset(kind, data_files=str(path), split="train")
    except Exception as error:  # the loaders' own errors name neither the file nor an empty one's cause
        cause = error.__cause__ or error
        raise ValueError(
            f"{name} could not be read as {kind} ({type(cause).__name__}: {cause}): {NO_ROWS}; otherwise fix the "
            "file where the error points."
        ) from error
    if dataset is None or len(dataset) == 0:
        raise ValueError(f"{name} has no rows: {NO_ROWS}.")
    return dataset


def _load_raw(source: str, split: str) -> tuple[Dataset, str]:
    """The rows of a local file or a hub dataset, and how errors name them."""
    path = Path(source)
    if path.suffix in LOCAL_FORMATS:
        return _load_file(path), f"math dataset file {path}"
    return load_dataset(source, split=split), f"math dataset {source} (split {split!r})"


def _missing(name: str, columns: list[str], need: str) -> ValueError:
    return ValueError(
        f"{name}: required column {need} is missing; columns found: {columns}. Expected either the DAPO layout "
        "(`prompt` messages + `reward_model.ground_truth`) or the plain layout (`problem` or `question` + `answer`)."
    )


def _missing_number_texts(dataset: Dataset, column: str, field: str | None) -> list[int]:
    """Rows of a text column holding the text of a missing number (`is_missing`: 'NaN', 'inf', '-Infinity'), which
    no answer can match; only rows without a digit are read as Python strings."""
    kind = column_type(dataset, column, field)
    if kind is None or arrow_kind(kind) != TEXT:
        return []
    values = dataset.with_format("arrow")[column]
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    values = pc.struct_field(values, field) if field is not None else values
    rows = np.flatnonzero(pc.invert(pc.match_substring_regex(values, r"\d")).fill_null(False))
    return [int(row) for row, text in zip(rows, values.take(rows).to_pylist(), strict=True) if is_missing(text)]


def _check_rows(dataset: Dataset, name: str, column: str, field: str | None = None) -> None:
    """Every row holds a value in `column` (its `field`): a null question would become the text "None", a null answer
    a ground truth no completion can match, a NaN one the text "nan" (nor can an answer's text `NaN` or `inf`)."""
    blank = set(blank_rows(dataset, column, field))
    if column != "prompt" and column not in PROBLEM_COLUMNS:
        blank |= set(_missing_number_texts(dataset, column, field))
    if blank:
        first, rest, label = min(blank), sorted(blank)[1:], column if field is None else f"{column}.{field}"
        value = dataset[first][column]
        value = value.get(field) if field is not None and isinstance(value, dict) else value
        more = f" (and {len(rest)} more: rows {rest[:5]}{'...' if len(rest) > 5 else ''})" if rest else ""
        raise ValueError(
            f"{name}: row {first}{more} has no value in column {label!r} (null, empty, NaN or infinite): it holds "
            f"{value!r}; drop such rows before loading (e.g. `dataset.filter(...)`) or fill them in."
        )


def _check_dataset(dataset: object, name: str) -> None:
    if isinstance(dataset, Dataset):
        return
    fix = "pass one split, e.g. `dataset['train']`" if isinstance(dataset, DatasetDict) else "load it as a Dataset"
    raise TypeError(
        f"{name}: a `datasets.Dataset` is read here (each row checked before training), got "
        f"{type(dataset).__name__}: {fix}."
    )


def to_prompt_answer(dataset: Dataset, template: str = PROMPT_TEMPLATE, name: str = "math dataset") -> Dataset:
    """Map either layout to `prompt` (conversation) + `answer` (string), dropping other columns; a row without a
    question or an answer, or with a value of another kind (bytes, a list for an answer), is an error naming `name`
    (the dataset, its file), the row and the column."""
    _check_dataset(dataset, name)
    columns = list(dataset.column_names)
    if "reward_model" in columns:
        if "prompt" not in columns:
            raise _missing(name, columns, "`prompt`")
        check_kind(dataset, name, "prompt", (TEXT, MESSAGES))
        check_kind(dataset, name, "reward_model", (TEXT, NUMBER), field="ground_truth")
        _check_rows(dataset, name, "prompt")
        _check_rows(dataset, name, "reward_model", "ground_truth")

        def from_dapo(row):
            truth = row["reward_model"]["ground_truth"]
            prompt = row["prompt"]
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return {"prompt": messages, "answer": str(truth)}

        return dataset.map(from_dapo, remove_columns=columns)
    problem = next((column for column in PROBLEM_COLUMNS if column in columns), None)
    if problem is None:
        raise _missing(name, columns, "`problem` (or `question`)")
    if "answer" not in columns:
        raise _missing(name, columns, "`answer`")
    check_kind(dataset, name, problem, (TEXT,))
    check_kind(dataset, name, "answer", (TEXT, NUMBER))
    _check_rows(dataset, name, problem)
    _check_rows(dataset, name, "answer")

    dataset = dataset.cast_column("answer", Value("string"))  # numeric answers compare as text

    def from_plain(row):
        content = template.format(problem=row[problem])
        return {"prompt": [{"role": "user", "content": content}], "answer": row["answer"]}

    return dataset.map(from_plain, remove_columns=columns)


def load_math_dataset(source: str, split: str = "train", template: str = PROMPT_TEMPLATE) -> Dataset:
    """A hub id (`split` is used) or a local .json/.jsonl/.parquet/.csv file, in either layout; errors name the file
    (or the hub id and split), the row and the column."""
    dataset, name = _load_raw(source, split)
    return to_prompt_answer(dataset, template, name)


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
