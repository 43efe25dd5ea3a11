"""A GGUF file's header checked before transformers builds a model from it: a model file is input like any other.

transformers sizes the model from the header's fields, then reads the tensors. A header saying
`llama.block_count = 2**31` grew the process past 5.5 GB over 300 s with no error; a truncated file failed with
`struct.error` or "cannot reshape", and a huge key count with "config file ... is not a valid JSON file", naming
neither the file's fault nor its path. (The `gguf` package's reader loops over an array's stated length, even one past
the file's end, so it cannot be the one to read a file it has not checked.)

`check_gguf_file` reads the header with every count bounded by the bytes left in the file (arrays nested at most
`MAX_ARRAY_DEPTH` deep: deeper ones raised `RecursionError`), then checks what a model would be built from against
what the file holds: each tensor's bytes lie within the file, no two overlapping; the layer count against the layers
the tensor names hold (`blk.N.`); the width, the vocabulary, the feed-forward and expert sizes, the attention heads
and the rotary dimensions against the tensor shapes, the key/value heads against the query heads; the context length
against a bound, since it sizes the rotary tables; the tokenizer's arrays are of strings and numbers as their kind
(integer tokens raised `TypeError` inside transformers) and of one length; and, since a size no tensor confirms (or
one transformers fills with its default) still sizes the model, the weights of the model transformers would build
against those the file holds (`gguf_weights.py`). Any fault is a `ValueError` naming the path and the field.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

from .gguf_weights import check_built_weights

MAGIC = b"GGUF"
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MIN_VALUE_BYTES = {STRING: 8, ARRAY: 12} | {kind: struct.calcsize(code) for kind, code in SCALARS.items()}
MIN_KEY_VALUE_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MAX_CONTEXT_LENGTH = 2**24  # 16.8M positions: the longest contexts are 10M; the rotary tables are sized by it
MAX_ARRAY_DEPTH = 8  # arrays of arrays: GGUF files hold flat ones (llama.cpp reads no nested array)
ITEM_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              STRING: "string", ARRAY: "array", 10: "uint64", 11: "int64", 12: "float64"}  # fmt: skip
INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
NUMBERS = INTEGERS | {6, 12}
# the tokenizer's arrays: (what their items are, the GGUF item types that are such)
TOKENIZER_ARRAYS = {
    "tokenizer.ggml.tokens": ("strings (each token's text)", frozenset({STRING})),
    "tokenizer.ggml.merges": ("strings (`a b` pairs)", frozenset({STRING})),
    "tokenizer.ggml.scores": ("numbers", NUMBERS),
    "tokenizer.ggml.token_type": ("integers", INTEGERS),
}
LAYER = re.compile(r"blk\.(\d+)\.")


class _Truncated(Exception):
    """The header's next item does not fit in the bytes left (message: the item)."""


@dataclass(frozen=True)
class Array:
    """An array field's length and item type (`ITEM_NAMES`); its items are not kept: a vocabulary holds 150k
    strings."""

    length: int
    items: int


@dataclass(frozen=True)
class Tensor:
    """A tensor's shape in GGUF order (`shape[0]` is the row length), and where its bytes lie in the file."""

    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    fields: dict[str, Any]
    tensors: dict[str, Tensor]


class _Reader:
    """Little- or big-endian reads from the file's bytes, each bounded by the bytes left."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0
        self.order = "<"

    def left(self) -> int:
        return len(self.data) - self.at

    def unpack(self, code: str, what: str) -> Any:
        size = struct.calcsize(self.order + code)
        if size > self.left():
            raise _Truncated(what)
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += size
        return value

    def string(self, what: str) -> str:
        length = self.unpack("Q", what)
        if length > self.left():
            raise _Truncated(what)
        self.at += length
        return bytes(self.data[self.at - length : self.at]).decode("utf-8")

    def skip(self, size: int) -> None:
        """Past `size` bytes a count has already bounded."""
        self.at += size

    def count(self, what: str, each: int) -> int:
        """A count of items of at least `each` bytes: no more than the bytes left can hold."""
        count = self.unpack("Q", what)
        if count * each > self.left():
            raise _Truncated(f"{what} = {count} (at least {each} bytes each)")
        return count

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """A field's value: a number, a string, or an `Array` (its items checked to fit, not kept)."""
        if depth > MAX_ARRAY_DEPTH:
            raise ValueError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        if kind in SCALARS:
            return self.unpack(SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise ValueError(f"{what} has the unknown value type {kind}")
        item_kind = self.unpack("I", what)
        if item_kind not in MIN_VALUE_BYTES:
            raise ValueError(f"{what} holds items of the unknown value type {item_kind}")
        length = self.count(f"the length of {what}", MIN_VALUE_BYTES[item_kind])
        if item_kind in SCALARS:
            self.skip(length * MIN_VALUE_BYTES[item_kind])
        elif item_kind == STRING:
            for index in range(length):  # skipped, not decoded
                self.skip(self.count(f"{what}[{index}]", 1))
        else:
            for index in range(length):
                self.value(ARRAY, f"{what}[{index}]", depth + 1)
        return Array(length, item_kind)


def check_gguf_file(path: str | Path) -> Header:
    """The header of the GGUF file at `path`, checked (module docstring); a `ValueError` naming the path and the
    field otherwise."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            if path.stat().st_size == 0:
                raise ValueError("the file is empty")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                header = _read_header(_Reader(data))
    except _Truncated as error:
        raise ValueError(f"{path}: truncated or corrupt GGUF: the file ends inside {error}.") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: truncated or corrupt GGUF: {error}.") from None
    _check_model_sizes(path, header)
    check_built_weights(path, header.fields, [tensor.shape for tensor in header.tensors.values()])
    return header


def _read_header(reader: _Reader) -> Header:
    if bytes(reader.data[:4]) != MAGIC:
        raise ValueError(f"it starts with {bytes(reader.data[:4])!r}, not the GGUF magic {MAGIC!r}")
    reader.at = 4
    version = reader.unpack("I", "the version")
    if version & 0xFFFF == 0:  # a file written on a machine of the other byte order
        reader.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not read here (versions 2 and 3 are)")
    tensor_count = reader.unpack("Q", "GGUF.tensor_count")
    key_count = reader.count("GGUF.kv_count", MIN_KEY_VALUE_BYTES)
    fields = {}
    for _ in range(key_count):
        key = reader.string(f"a key after {len(fields)} of the {key_count} (GGUF.kv_count) keys")
        if key in fields:
            raise ValueError(f"the key {key} appears twice")
        fields[key] = reader.value(reader.unpack("I", key), key)
    if tensor_count * MIN_TENSOR_INFO_BYTES > reader.left():
        raise _Truncated(f"GGUF.tensor_count = {tensor_count} (at least {MIN_TENSOR_INFO_BYTES} bytes each)")
    infos = [_tensor_info(reader) for _ in range(tensor_count)]
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment = {alignment} is not a power of two")
    data_start = -(-reader.at // alignment) * alignment
    return Header(fields, _place_tensors(infos, data_start, len(reader.data)))


def _tensor_info(reader: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    """(name, shape, GGML type, offset from the data's start) of the next tensor."""
    name = reader.string("a tensor's name")
    dims = reader.unpack("I", f"tensor {name}'s dimension count")
    if dims > MAX_DIMS:
        raise ValueError(f"tensor {name} has {dims} dimensions, more than GGML's {MAX_DIMS}")
    shape = tuple(reader.unpack("Q", f"tensor {name}'s shape") for _ in range(dims))
    return name, shape, reader.unpack("I", f"tensor {name}'s type"), reader.unpack("Q", f"tensor {name}'s offset")


def _place_tensors(infos: list, data_start: int, file_size: int) -> dict[str, Tensor]:
    """Each tensor's bytes, from its shape and type, within the file, no two overlapping (so the weights the file
    holds are bounded by its size)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {int(kind): size for kind, size in GGML_QUANT_SIZES.items() if isinstance(kind, GGMLQuantizationType)}
    tensors = {}
    for name, shape, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"the tensor {name} appears twice")
        if kind not in sizes:
            raise ValueError(f"tensor {name} has the unknown GGML type {kind}")
        block, block_bytes = sizes[kind]
        if shape and shape[0] % block:
            raise ValueError(f"tensor {name}'s rows of {shape[0]} are not whole blocks of {block} (its type's)")
        start = data_start + offset
        end = start + math.prod(shape) // block * block_bytes
        if end > file_size:
            raise ValueError(
                f"tensor {name}'s data (bytes {start} to {end}) runs past the end of the file ({file_size} bytes)"
            )
        tensors[name] = Tensor(shape, start, end)
    placed = sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end))
    for (before, first), (name, second) in pairwise(placed):
        if second.start < first.end:
            raise ValueError(
                f"tensor {name}'s data (bytes {second.start} to {second.end}) overlaps tensor {before}'s "
                f"({first.start} to {first.end})"
            )
    return tensors


# (field, the kind of tensor it sizes, the axis of that tensor's shape it equals), checked on the first such tensor
SIZED_BY_TENSORS = (
    ("feed_forward_length", "ffn_up.weight", 1),
    ("expert_feed_forward_length", "ffn_up_exps.weight", 1),
    ("expert_count", "ffn_up_exps.weight", 2),
)


class _ModelSizes:
    """The sizes a model would be built with (the header's `{architecture}.*` fields), each against the tensors that
    hold it; `faults()` yields `(field, what is wrong)`."""

    def __init__(self, header: Header, architecture: str) -> None:
        self.fields, self.tensors, self.arch = header.fields, header.tensors, architecture

    def number(self, field: str) -> int | None:
        value = self.fields.get(f"{self.arch}.{field}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def first(self, kind: str) -> tuple[str, tuple[int, ...]] | None:
        """The name and shape of the first tensor of `kind` (`attn_q.weight` in `blk.0.attn_q.weight`)."""
        return next(((name, t.shape) for name, t in self.tensors.items() if name.endswith(f".{kind}")), None)

    def faults(self) -> Iterator[tuple[str, str]]:
        yield from self._layers()
        yield from self._embedding()
        for field, kind, axis in SIZED_BY_TENSORS:
            found, value = self.first(kind), self.fields.get(f"{self.arch}.{field}")
            if value is not None and found is not None and len(found[1]) > axis and value != found[1][axis]:
                yield f"{self.arch}.{field}", f"is {value}, but {found[0]} has {found[1][axis]} there"
        yield from self._heads()
        context = self.number("context_length")
        if context is not None and not 0 < context <= MAX_CONTEXT_LENGTH:
            reason = f"is {context}, beyond {MAX_CONTEXT_LENGTH} positions (rotary tables are built for all of them)"
            yield f"{self.arch}.context_length", reason

    def _layers(self) -> Iterator[tuple[str, str]]:
        count = self.number("block_count")
        layers = {int(match.group(1)) for name in self.tensors if (match := LAYER.match(name))}
        held = f"the file's tensors hold {len(layers)} layers" + (f" (blk.0 to blk.{max(layers)})" if layers else "")
        if count is None or not 1 <= count <= len(layers) or not all(index in layers for index in range(count)):
            yield f"{self.arch}.block_count", f"is {self.fields.get(f'{self.arch}.block_count')}, but {held}"

    def _embedding(self) -> Iterator[tuple[str, str]]:
        """The width and the vocabulary against the token embedding (`token_embd.weight`: width x vocabulary)."""
        shape = self.tensors["token_embd.weight"].shape if "token_embd.weight" in self.tensors else ()
        if len(shape) != 2:
            yield "token_embd.weight", "is missing or not a matrix: a model needs its token embedding"
            return
        width, rows = shape
        if self.number("embedding_length") != width:
            value = self.fields.get(f"{self.arch}.embedding_length")
            yield f"{self.arch}.embedding_length", f"is {value}, but token_embd.weight is {width} wide"
        key = f"{self.arch}.vocab_size" if f"{self.arch}.vocab_size" in self.fields else "tokenizer.ggml.tokens"
        vocabulary = self.fields.get(key)
        size = vocabulary.length if isinstance(vocabulary, Array) else vocabulary
        if isinstance(size, int) and size > rows:
            yield key, f"holds {size} tokens, but token_embd.weight has {rows} rows"

    def _heads(self) -> Iterator[tuple[str, str]]:
        """The attention heads and their sizes against the first query and key projections (a fused one: skipped)."""
        heads, query = self.number("attention.head_count"), self.first("attn_q.weight")
        if heads is None or query is None or len(query[1]) != 2:
            return
        name, (_, outputs) = query
        if heads < 1 or outputs % heads:
            yield (
                f"{self.arch}.attention.head_count",
                f"is {heads}, but {name}'s {outputs} outputs are not whole heads",
            )
            return
        head_dim = outputs // heads
        key_length, rotary = self.number("attention.key_length"), self.number("rope.dimension_count")
        if key_length is not None and key_length != head_dim:
            yield f"{self.arch}.attention.key_length", f"is {key_length}, but {name} holds heads of {head_dim}"
        if rotary is not None and not 0 < rotary <= head_dim:
            yield f"{self.arch}.rope.dimension_count", f"is {rotary}, beyond {name}'s heads of {head_dim}"
        key_heads, keys = self.number("attention.head_count_kv"), self.first("attn_k.weight")
        if key_heads is not None and keys is not None and len(keys[1]) == 2 and key_heads * head_dim != keys[1][1]:
            held = f"{keys[0]} holds {keys[1][1]} outputs ({keys[1][1] / head_dim:g} heads of {head_dim})"
            yield f"{self.arch}.attention.head_count_kv", f"is {key_heads}, but {held}"
        elif key_heads is not None and not (0 < key_heads <= heads and heads % key_heads == 0):
            reason = f"is {key_heads}, but the {heads} query heads (attention.head_count) are not groups of that many"
            yield f"{self.arch}.attention.head_count_kv", reason


def _tokenizer_faults(fields: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The tokenizer's arrays hold items of their kind (`TOKENIZER_ARRAYS`), one per token."""
    tokens = fields.get("tokenizer.ggml.tokens")
    for key, (kind, types) in TOKENIZER_ARRAYS.items():
        value = fields.get(key)
        if value is None:
            continue
        if not isinstance(value, Array) or value.items not in types:
            held = f"{ITEM_NAMES[value.items]} items" if isinstance(value, Array) else type(value).__name__
            yield key, f"holds {held}, not an array of {kind}"
        elif key != "tokenizer.ggml.merges" and isinstance(tokens, Array) and value.length != tokens.length:
            yield key, f"holds {value.length} items, but tokenizer.ggml.tokens holds {tokens.length} tokens"


def _check_model_sizes(path: Path, header: Header) -> None:
    """The sizes a model would be built with, against the tensors the file holds, and the tokenizer's arrays; the
    first fault named."""
    architecture = header.fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{path}: truncated or corrupt GGUF: no general.architecture names the model's kind.")
    fault = next(chain(_ModelSizes(header, architecture).faults(), _tokenizer_faults(header.fields)), None)
    if fault is not None:
        raise ValueError(
            f"{path}: the GGUF header's {fault[0]} {fault[1]}: the header is corrupt or was edited, and what "
            "transformers built from it would not be what the file holds."
        )
