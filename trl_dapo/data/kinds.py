"""What a dataset column holds, read from its Arrow type, so that a value of the wrong kind is named before a template
or a string cast turns it into other text.

A parquet column of bytes became the question `b'What is 0 + 0?'` (the template formats the bytes' repr), a bytes
answer that is not UTF-8 failed inside Arrow's string cast (`ArrowInvalid`), and an answer `[2]` (a list) was reported
as having no value. `check_kind` names the column, the first row holding such a value, the value and the fix.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset

TEXT, NUMBER, MESSAGES, BYTES, LIST, NULL = "text", "a number", "messages", "bytes", "a list", "null"


def arrow_kind(kind: pa.DataType) -> str:
    """`TEXT`, `NUMBER`, `MESSAGES` (a list of dicts with a text `content`), `BYTES` (bytes, or messages whose content
    is bytes), `LIST`, `NULL` (every row null), or another kind's name."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return TEXT
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return NUMBER
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        return BYTES
    if pa.types.is_null(kind):
        return NULL
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        item = kind.value_type
        if pa.types.is_struct(item) and item.get_field_index("content") >= 0:
            content = arrow_kind(item.field("content").type)
            return MESSAGES if content in (TEXT, NULL) else content if content == BYTES else f"messages of {content}"
        return LIST
    if pa.types.is_struct(kind):
        return "a dict"
    if pa.types.is_boolean(kind):
        return "a boolean"
    return str(kind)


def column_type(dataset: Dataset, column: str, field: str | None = None) -> pa.DataType | None:
    """The Arrow type of `column` (of its struct `field`, when given: None when the column is no struct holding it)."""
    kind = dataset.data.schema.field(column).type
    if field is None or pa.types.is_null(kind):
        return kind
    if not pa.types.is_struct(kind) or kind.get_field_index(field) < 0:
        return None
    return kind.field(field).type


def _first_held(dataset: Dataset, column: str, field: str | None) -> int | None:
    """The first row whose `column` (its `field`) is not null."""
    values = dataset.with_format("arrow")[column]
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if field is not None and pa.types.is_struct(values.type) and values.type.get_field_index(field) >= 0:
        values = pc.struct_field(values, field)
    held = pc.is_valid(values).to_numpy(zero_copy_only=False).nonzero()[0]
    return int(held[0]) if len(held) else None


def _value(dataset: Dataset, row: int, column: str, field: str | None) -> Any:
    value = dataset[row][column]
    return value.get(field) if field is not None and isinstance(value, dict) else value


def _bytes_in(value: Any) -> bytes:
    """The bytes of a value of kind `BYTES`: itself, or its messages' first bytes content."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return next((m["content"] for m in value or [] if isinstance(m.get("content"), bytes)), b"")


def _fix(kind: str, value: Any, label: str, expected: str) -> str:
    if kind == BYTES:
        try:
            _bytes_in(value).decode("utf-8")
        except UnicodeDecodeError:
            return "they are not UTF-8: find the encoding they were written in, and store the column as text"
        example = f" (e.g. `dataset.map(lambda row: {{{label!r}: row[{label!r}].decode('utf-8')}})`)"
        flat = isinstance(value, bytes | bytearray) and "." not in label
        return f"decode them to text before loading{example if flat else ''}, or write the column as text (strings)"
    if kind == LIST and expected != TEXT:
        return "an answer is one string or number per row (e.g. '2'); join several into the form the model answers in"
    return f"{label} must hold {expected} in every row"


def check_kind(dataset: Dataset, name: str, column: str, accepted: tuple[str, ...], field: str | None = None) -> None:
    """`column` (its struct `field`) holds one of the `accepted` kinds, or only nulls (which the row checks name);
    else a `ValueError` naming `name` (the dataset, its file), the column, its first row holding a value, and the fix."""
    kind = column_type(dataset, column, field)
    if kind is None:
        held = arrow_kind(dataset.data.schema.field(column).type)
        raise ValueError(
            f"{name}: column {column!r} holds {held}, not a dict with {field!r} (the DAPO layout: "
            f"{{{column!r}: {{{field!r}: ...}}}} in every row)."
        )
    kind = arrow_kind(kind)
    if kind in accepted or kind == NULL:
        return
    row = _first_held(dataset, column, field)
    if row is None:
        return  # every row null: no value of the wrong kind, and the row checks name the first
    label = column if field is None else f"{column}.{field}"
    value = _value(dataset, row, column, field)
    expected = " or ".join(accepted)
    raise ValueError(
        f"{name}: row {row}, column {label!r} holds {kind} ({value!r:.60}), not {expected}: "
        f"{_fix(kind, value, label, expected)}."
    )
