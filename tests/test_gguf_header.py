"""A GGUF file's header is checked before a model is built from it: a hostile or corrupt one is an error naming the
path and the field. Small files are written here with the `gguf` package's writer (a two-layer Llama of zeros), then
edited: a field set to a size the tensors contradict, the file cut short, a count patched past the file's end."""

import re
import struct

import numpy as np
import pytest

from helpers import alternating_reward, arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.gguf import load_gguf_tokenizer
from trl_dapo.gguf_header import Array, check_gguf_file

gguf = pytest.importorskip("gguf")

# width 8, 2 heads of 4 (1 KV head), feed-forward 16, 16 tokens, 2 layers
FIELDS = {
    "block_count": 2,
    "context_length": 64,
    "embedding_length": 8,
    "feed_forward_length": 16,
    "attention.head_count": 2,
    "attention.head_count_kv": 1,
    "rope.dimension_count": 4,
    "vocab_size": 16,
}
LAYER_SHAPES = {  # numpy order: (outputs, inputs); GGUF stores the reverse
    "attn_norm.weight": (8,),
    "attn_q.weight": (8, 8),
    "attn_k.weight": (4, 8),
    "attn_v.weight": (4, 8),
    "attn_output.weight": (8, 8),
    "ffn_norm.weight": (8,),
    "ffn_gate.weight": (16, 8),
    "ffn_up.weight": (16, 8),
    "ffn_down.weight": (8, 16),
}


def write_gguf(path, **overrides):
    """The small Llama file, its `llama.*` fields overridden (None: left out)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in {**FIELDS, **overrides}.items():
        if value is not None:
            (writer.add_uint32 if value < 2**32 else writer.add_uint64)(f"llama.{name}", value)
    writer.add_array("tokenizer.ggml.token_type", [1] * 16)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    for layer in range(2):
        for kind, shape in LAYER_SHAPES.items():
            writer.add_tensor(f"blk.{layer}.{kind}", np.zeros(shape, np.float32))
    writer.add_tensor("output_norm.weight", np.zeros(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_honest_file_passes_with_its_fields_and_tensors(tmp_path):
    header = check_gguf_file(write_gguf(tmp_path / "small.gguf"))
    assert header.fields["general.architecture"] == "llama" and header.fields["llama.block_count"] == 2
    assert header.fields["tokenizer.ggml.token_type"] == Array(16)
    assert len(header.tensors) == 1 + 2 * len(LAYER_SHAPES) + 1
    assert header.tensors["blk.0.ffn_up.weight"].shape == (8, 16)  # GGUF order: the row length first
    last = max(tensor.end for tensor in header.tensors.values())
    assert last == (tmp_path / "small.gguf").stat().st_size  # float32 bytes, computed from shape and type


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("block_count", 2**31, r"the file's tensors hold 2 layers \(blk.0 to blk.1\)"),  # the 5.5 GB header
        ("block_count", 3, r"the file's tensors hold 2 layers"),
        ("block_count", None, r"the file's tensors hold 2 layers"),
        ("embedding_length", 2**20, r"token_embd.weight is 8 wide"),
        ("vocab_size", 2**30, r"token_embd.weight has 16 rows"),
        ("feed_forward_length", 2**30, r"blk.0.ffn_up.weight has 16 there"),
        ("attention.head_count", 2**20, r"blk.0.attn_q.weight's 8 outputs are not whole heads"),
        ("attention.head_count_kv", 2**10, r"blk.0.attn_k.weight holds 4 outputs \(1 heads of 4\)"),
        ("rope.dimension_count", 2**20, r"beyond blk.0.attn_q.weight's heads of 4"),
        ("context_length", 2**40, r"beyond 16777216 positions"),
    ],
)
def test_a_size_the_tensors_contradict_is_named(tmp_path, field, value, reason):
    path = write_gguf(tmp_path / "edited.gguf", **{field: value})
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}: the GGUF header's llama\.{field} (is|holds) .*{reason}"
    ):
        check_gguf_file(path)


def cut(path, size):
    path.write_bytes(path.read_bytes()[:size])
    return path


def patch_count(path, key: str, count: int, skip: int = 4):
    """Write `count` over the 8-byte count that follows `key` and `skip` bytes (its type, an array's item type)."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + skip
    data[at : at + 8] = struct.pack("<Q", count)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("corrupt", "detail"),
    [
        (lambda path: cut(path, 0), "the file is empty"),
        (lambda path: cut(path, 10), "the file ends inside GGUF.tensor_count"),
        (lambda path: cut(path, path.read_bytes().index(b"llama.rope") + 3), "the file ends inside a key after"),
        (
            lambda path: cut(path, path.stat().st_size - 4),
            r"tensor output_norm.weight's data \(bytes \d+ to \d+\) runs",
        ),
        (lambda path: patch_count(path, "GGUF", 2**40, skip=12), r"GGUF.kv_count = 1099511627776 \(at least 13 bytes"),
        (
            lambda path: patch_count(path, "tokenizer.ggml.token_type", 2**40, skip=8),
            r"the length of tokenizer.ggml.token_type = 1099511627776",  # the gguf reader loops over such a length
        ),
        (lambda path: path.write_bytes(b"GGUG" + path.read_bytes()[4:]), "not the GGUF magic"),
    ],
    ids=["empty", "in the counts", "in a key", "in the tensor data", "key count", "array length", "magic"],
)
def test_a_truncated_or_corrupt_file_is_named_with_its_path(tmp_path, corrupt, detail):
    path = write_gguf(tmp_path / "broken.gguf")
    corrupt(path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: truncated or corrupt GGUF: .*{detail}"):
        check_gguf_file(path)


def trainer(model, output_dir):
    args = dapo_args(output_dir, num_generations=2, per_device_train_batch_size=4, max_completion_length=8)
    return DAPOTrainer(model=model, reward_funcs=alternating_reward, args=args, train_dataset=arithmetic_prompts(8))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda path: write_gguf(path, block_count=2**31), r"llama\.block_count is 2147483648, but"),
        (lambda path: write_gguf(path, block_count=3), r"llama\.block_count is 3, but"),
        (lambda path: cut(write_gguf(path), 300), "truncated or corrupt GGUF: the file ends inside"),
        (lambda path: cut(write_gguf(path), path.stat().st_size - 4), "truncated or corrupt GGUF: tensor output_norm"),
    ],
    ids=["2**31 layers", "3 layers", "cut in the header", "cut in the tensors"],
)
def test_the_trainer_and_the_tokenizer_check_the_header_before_building(tmp_path, edit, message):
    """`DAPOTrainer(model="x.gguf")` with `llama.block_count = 2**31` grew past 5.5 GB in 300 s with no error; a
    truncated file failed with `struct.error` or "cannot reshape", naming neither the file nor its fault."""
    path = tmp_path / "model.gguf"
    edit(path)
    named = rf"{re.escape(str(path))}: .*{message}"
    with pytest.raises(ValueError, match=named):
        trainer(str(path), tmp_path / "out")
    with pytest.raises(ValueError, match=named):
        load_gguf_tokenizer(str(tmp_path), "model.gguf")
