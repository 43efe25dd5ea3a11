"""Rows of a dataset column that hold nothing: null, a string of spaces, an empty list, messages with no text, or a
number that is not finite (NaN is how pandas and `Dataset.from_dict` keep a missing number; as text it would become
the ground truth `'nan'`).

Computed on the Arrow column, not on Python objects: DAPO-Math-17k's hub copy has 1.79 million rows, whose prompts as
Python lists of messages would take gigabytes; a column of another kind (a list, a torch dataset) is read row by row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset


def is_blank(value: Any) -> bool:
    """None, a string of spaces, a list (of messages) with no message holding text, or a number that is not finite."""
    if isinstance(value, numbers.Real):
        return not math.isfinite(value)
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(not isinstance(item, dict) or is_blank(item.get("content")) for item in value)
    return value is None


def _blank_strings(column: pa.Array) -> np.ndarray:
    text = pc.utf8_trim_whitespace(column)
    return pc.or_kleene(pc.is_null(column), pc.equal(text, "")).fill_null(True).to_numpy(zero_copy_only=False)


def _blank_arrow(column: pa.Array) -> np.ndarray | None:
    """`is_blank` of each row of an Arrow column, or None for a type this does not read."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return _blank_strings(column)
    if pa.types.is_list(column.type) and pa.types.is_struct(column.type.value_type):
        messages = pc.list_flatten(column)
        if messages.type.get_field_index("content") < 0:
            return None
        content = pc.struct_field(messages, "content")
        if not pa.types.is_string(content.type):
            return None
        holding_text = ~_blank_strings(content)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        texts = np.bincount(parents[holding_text], minlength=len(column))
        return texts == 0
    if pa.types.is_integer(column.type):
        return pc.is_null(column).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(column.type):
        return pc.invert(pc.is_finite(column)).fill_null(True).to_numpy(zero_copy_only=False)
    return None


def blank_rows(dataset: Any, column: str, field: str | None = None) -> list[int]:
    """Indices of the rows whose `column` (its struct `field`, when given) holds nothing."""
    if isinstance(dataset, Dataset):  # its Arrow column (row selections applied), without Python objects
        values = dataset.with_format("arrow")[column]
        values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
        if field is not None:
            values = pc.struct_field(values, field) if pa.types.is_struct(values.type) else None
        blank = _blank_arrow(values) if values is not None else None
        if blank is not None:
            return np.flatnonzero(blank).tolist()
    rows: Sequence[Any] = dataset[column]
    if field is not None:
        rows = [(row or {}).get(field) for row in rows]
    return [index for index, value in enumerate(rows) if is_blank(value)]
