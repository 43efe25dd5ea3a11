"""The DAPO math reward on real cases, and the dataset loaders on local files."""

import json

import pytest

from trl_dapo.data import arithmetic_dataset, load_math_dataset
from trl_dapo.rewards.math import dapo_math_reward, extract_answer, score_answer

CASES = [
    ("Let me think.\nAnswer: 34", "34", 1.0),
    ("answer : 34", "34", 1.0),  # case-insensitive, spaces around the colon
    ("Answer: \\boxed{34}", "34", 1.0),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", 1.0),
    ("Answer: 1/2", "\\frac{1}{2}", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", 1.0),
    ("Answer: 1,000", "1000", 1.0),
    ("Answer: x = 5", "5", 1.0),
    ("Answer: 3\nWait, no.\nAnswer: 4", "4", 1.0),  # the last Answer line counts
    ("Answer: 3\nWait, no.\nAnswer: 4", "3", -1.0),
    ("Answer: 35", "34", -1.0),
    ("The answer is 34.", "34", -1.0),  # no Answer: line
    ("", "34", -1.0),
    ("Answer: 34" + " filler" * 100, "34", -1.0),  # the Answer: line is not in the last 300 characters
    ("x" * 100_000 + "\nAnswer: 7", "7", 1.0),  # huge completion: only the tail is read
    ("Answer: \ufffd\ufffd\x00\x07}}{{\\frac{", "34", -1.0),  # garbage never raises
    # a missing ground truth is never matched
    ("Answer: None", None, -1.0),
    ("Answer: $$", "", -1.0),
    ("Answer: $ $", "  ", -1.0),
]


@pytest.mark.parametrize(("completion", "truth", "reward"), CASES)
def test_reward_cases(completion, truth, reward):
    assert score_answer(completion, truth)[0] == reward


def test_conversational_completions_and_logged_metrics():
    logged = {}
    completions = [[{"role": "assistant", "content": "Answer: 7"}], [{"role": "assistant", "content": "no idea"}]]
    rewards = dapo_math_reward(completions, answer=["7", "7"], log_metric=logged.__setitem__)
    assert rewards == [1.0, -1.0]
    assert logged == {"math/accuracy": 0.5, "math/unparsable_ratio": 0.5}


def test_extract_answer_takes_the_last_line_value():
    assert extract_answer("Answer: 1\nAnswer: 2 apples\n") == "2 apples"
    assert extract_answer("nothing here") is None


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


def test_load_dapo_layout(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": "2"}, "x": 1}]
    dataset = load_math_dataset(write_jsonl(tmp_path / "dapo.jsonl", rows))
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset[0] == {"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}


def test_load_plain_layout_applies_the_template(tmp_path):
    dataset = load_math_dataset(write_jsonl(tmp_path / "aime.jsonl", [{"question": "Find x.", "answer": 12}]))
    content = dataset[0]["prompt"][0]["content"]
    assert "Find x." in content and content.startswith("Solve the following math problem")
    assert dataset[0]["answer"] == "12"


@pytest.mark.parametrize(
    ("row", "missing"),
    [
        ({"problem": "Find x.", "solution": "12"}, "`answer`"),
        ({"text": "Find x.", "answer": "12"}, "`problem` \\(or `question`\\)"),
        ({"reward_model": {"ground_truth": "1"}, "q": "?"}, "`prompt`"),
    ],
)
def test_missing_columns_are_named_with_the_columns_found(tmp_path, row, missing):
    with pytest.raises(ValueError, match=f"required column {missing} is missing; columns found: \\["):
        load_math_dataset(write_jsonl(tmp_path / "bad.jsonl", [row]))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"question": "Find x.", "answer": "1"}, {"question": "Find y.", "answer": None}],
            r"row 1 has no value in column 'answer'",
        ),
        (
            [
                {"problem": "Find x.", "answer": "1"},
                {"problem": "Find y.", "answer": "2"},
                {"problem": None, "answer": "3"},
            ],
            r"row 2 has no value in column 'problem'",
        ),
        ([{"question": "Find x.", "answer": " "}], r"row 0 has no value in column 'answer'"),
        (
            [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": None}}],
            r"row 0 has no value in column 'reward_model.ground_truth'",
        ),
        ([{"prompt": None, "reward_model": {"ground_truth": "2"}}], r"row 0 has no value in column 'prompt'"),
    ],
)
def test_rows_without_a_question_or_an_answer_are_named(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_math_dataset(write_jsonl(tmp_path / "gaps.jsonl", rows))


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_math_dataset(str(tmp_path / "absent.parquet"))


def test_arithmetic_dataset_is_deterministic_and_correct():
    first, second = arithmetic_dataset(20, 5, seed=1), arithmetic_dataset(20, 5, seed=1)
    assert first["train"]["prompt"] == second["train"]["prompt"]
    for row in first["train"]:
        a, b = (int(t) for t in row["prompt"][0]["content"][len("What is ") : -1].split(" + "))
        assert row["answer"] == str(a + b)
    train = {r[0]["content"] for r in first["train"]["prompt"]}
    test = {r[0]["content"] for r in first["test"]["prompt"]}
    assert not train & test
