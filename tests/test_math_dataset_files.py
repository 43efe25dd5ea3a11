"""The math dataset loaders refuse what no training can use, naming the file (or the dataset), the row, the column and
the fix: bytes where text belongs (a parquet `problem` of bytes trained on the text "b'What is 0 + 0?'"), an answer
that is the text of a missing number ("NaN", "inf", which no completion can match), an answer of another kind (`[2]`
was reported as having no value), and a file with no rows (an empty `.jsonl` raised a bare `StopIteration`)."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from trl_dapo.data import load_math_dataset
from trl_dapo.data.math import to_prompt_answer

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.binary())]))


def write_parquet(path, columns: dict[str, pa.Array]):
    pq.write_table(pa.table(columns), path)
    return path


def write_rows(path, rows: list[dict]):
    """`.jsonl`: a row a line; `.json`: one array; `.csv`: a header and a line a row."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("\n".join([",".join(rows[0]), *(",".join(str(v) for v in row.values()) for row in rows)]))
    return path


DECODE = r"decode them to text before loading"
BYTES_CASES = {
    "problem": (
        {"problem": pa.array([b"What is 0 + 0?"]), "answer": pa.array(["0"])},
        r"row 0, column 'problem' holds bytes \(b'What is 0 \+ 0\?'\), not text: " + DECODE,
    ),
    "question, second row": (
        {"question": pa.array([None, b"What is 1 + 1?"], pa.binary()), "answer": pa.array(["2", "2"])},
        r"row 1, column 'question' holds bytes \(b'What is 1 \+ 1\?'\), not text: " + DECODE,
    ),
    "answer": (
        {"problem": pa.array(["What is 0 + 0?"]), "answer": pa.array([b"0"])},
        r"row 0, column 'answer' holds bytes \(b'0'\), not text or a number: " + DECODE,
    ),
    "answer not UTF-8": (
        {"problem": pa.array(["What is 0 + 0?"]), "answer": pa.array([b"\xff\xfe"])},
        r"row 0, column 'answer' holds bytes \(b'\\xff\\xfe'\), not text or a number: they are not UTF-8",
    ),
    "DAPO messages": (
        {
            "prompt": pa.array([[{"role": "user", "content": b"What is 0 + 0?"}]], MESSAGES),
            "reward_model": pa.array([{"ground_truth": "0"}]),
        },
        r"row 0, column 'prompt' holds bytes \(\[\{'role': 'user', 'content': b'What is 0 \+ 0\?'\}\]\), not text or "
        r"messages: " + DECODE,
    ),
    "DAPO ground truth": (
        {"prompt": pa.array(["What is 0 + 0?"]), "reward_model": pa.array([{"ground_truth": b"0"}])},
        r"row 0, column 'reward_model.ground_truth' holds bytes \(b'0'\), not text or a number: " + DECODE,
    ),
}


@pytest.mark.parametrize("case", BYTES_CASES)
def test_bytes_where_text_belongs_are_refused_in_a_file_and_in_a_dataset(tmp_path, case):
    columns, message = BYTES_CASES[case]
    path = write_parquet(tmp_path / "bytes.parquet", columns)
    with pytest.raises(ValueError, match=rf"math dataset file {re.escape(str(path))}: {message}"):
        load_math_dataset(str(path))
    with pytest.raises(ValueError, match=rf"^math dataset: {message}"):
        to_prompt_answer(Dataset(pa.table(columns)))


@pytest.mark.parametrize(
    ("name", "answers", "row", "held"),
    [
        ("nan.jsonl", ["1", "NaN"], 1, "'NaN'"),
        ("inf.json", ["inf", "2"], 0, "'inf'"),
        ("signed.jsonl", ["1", "2", " -Infinity "], 2, "' -Infinity '"),
        ("latex.jsonl", ["$nan$", "2"], 0, "'\\$nan\\$'"),
        ("spaces.json", ["1", "   "], 1, "'   '"),
        ("nan.csv", ["1", "NaN"], 1, "None"),  # the CSV reader keeps it as a null number
    ],
)
def test_an_answer_that_is_the_text_of_a_missing_number_is_refused(tmp_path, name, answers, row, held):
    """No completion can match such an answer: the reward treats it as missing (`is_missing`)."""
    path = write_rows(tmp_path / name, [{"problem": f"Find x{i}.", "answer": a} for i, a in enumerate(answers)])
    expected = rf"{re.escape(str(path))}: row {row} has no value in column 'answer' \(null, empty, NaN or infinite\)"
    with pytest.raises(ValueError, match=rf"{expected}: it holds {held}; drop such rows"):
        load_math_dataset(str(path))


def test_a_dapo_ground_truth_that_is_the_text_of_a_missing_number_is_refused(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Find x{i}."}], "reward_model": {"ground_truth": t}} for i, t in
            enumerate(["3", "-inf", "Infinity"])]  # fmt: skip
    path = write_rows(tmp_path / "dapo.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 1 \(and 1 more: rows \[2\]\) has no value in column 'reward_model"):
        load_math_dataset(str(path))


def test_answers_holding_digits_or_words_are_kept(tmp_path):
    answers = ["12", "1/2", "\\infty", "None", "x = 5", "inf + 1"]
    path = write_rows(tmp_path / "fine.jsonl", [{"problem": "Find x.", "answer": a} for a in answers])
    assert load_math_dataset(str(path))["answer"] == answers


def test_an_answer_of_another_kind_is_named_with_the_fix(tmp_path):
    path = write_rows(tmp_path / "lists.jsonl", [{"problem": "Find x.", "answer": [2]}])
    with pytest.raises(ValueError, match=r"row 0, column 'answer' holds a list \(\[2\]\), not text or a number: an "):
        load_math_dataset(str(path))
    path = write_rows(tmp_path / "flags.jsonl", [{"problem": "Find x.", "answer": True}])
    with pytest.raises(ValueError, match=r"column 'answer' holds a boolean \(True\), not text or a number: answer"):
        load_math_dataset(str(path))
    path = write_rows(tmp_path / "dapo.jsonl", [{"prompt": "Find x.", "reward_model": "2"}])
    with pytest.raises(ValueError, match=r"column 'reward_model' holds text, not a dict with 'ground_truth'"):
        load_math_dataset(str(path))


def write_empty(path):
    """A file of no rows in each format."""
    if path.suffix == ".parquet":
        write_parquet(path, {"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())})
    else:
        path.write_text({".jsonl": "", ".json": "[]", ".csv": "problem,answer\n", ".txt": " \n\n"}[path.suffix])
    return path


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("empty.jsonl", "is empty"),
        ("blank.jsonl", "is empty"),
        ("empty.json", r"could not be read as json \(ValueError: .*\)"),
        ("empty.csv", r"could not be read as csv \(ValueError: .*\)"),
        ("empty.parquet", "has no rows"),
    ],
)
def test_a_file_with_no_rows_is_named(tmp_path, name, how):
    path = tmp_path / name
    write_empty(path) if name != "blank.jsonl" else path.write_text(" \n\n")
    with pytest.raises(ValueError, match=rf"math dataset file {re.escape(str(path))} {how}: an empty file, a JSON"):
        load_math_dataset(str(path))


def test_a_corrupt_file_is_named_with_its_format(tmp_path):
    path = tmp_path / "cut.parquet"
    path.write_bytes(b"PAR1 not a parquet file")
    with pytest.raises(ValueError, match=rf"file {re.escape(str(path))} could not be read as parquet \(\w+: "):
        load_math_dataset(str(path))


def test_a_dataset_dict_is_refused_with_the_split_to_pass():
    splits = DatasetDict({"train": Dataset.from_dict({"problem": ["Find x."], "answer": ["1"]})})
    with pytest.raises(TypeError, match=r"got DatasetDict: pass one split, e.g. `dataset\['train'\]`"):
        to_prompt_answer(splits)
    assert to_prompt_answer(splits["train"])["answer"] == ["1"]
