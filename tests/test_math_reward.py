"""The DAPO math reward on real cases, and the dataset loaders on local files."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from datasets import Dataset

from trl_dapo.data import arithmetic_dataset, load_math_dataset
from trl_dapo.data.blank import is_blank
from trl_dapo.data.math import to_prompt_answer
from trl_dapo.rewards import math as math_reward
from trl_dapo.rewards.equivalence import EquivalenceWorker
from trl_dapo.rewards.math import dapo_math_reward, extract_answer, score_answer
from trl_dapo.rewards.safe_expression import why_costly

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
    # nor is a truth that is not a finite number (a dataset's missing number), whatever the answer
    ("Answer: nan", float("nan"), -1.0),
    ("Answer: NaN", "nan", -1.0),
    ("Answer: inf", float("inf"), -1.0),
    ("Answer: -inf", float("-inf"), -1.0),
    # nor is such a number's text, which an exact string match would have scored +1
    ("Answer: inf", "inf", -1.0),
    ("Answer: -Infinity", "-Infinity", -1.0),
    ("Answer: $NaN$", "$NaN$", -1.0),
    ("Answer: 2", 2.0, 1.0),
]


@pytest.mark.parametrize(("completion", "truth", "reward"), CASES)
def test_reward_cases(completion, truth, reward):
    assert score_answer(completion, truth)[0] == reward


def test_a_nan_truth_never_scores_through_the_reward():
    assert dapo_math_reward(["Answer: nan", "Answer: inf"], [float("nan"), float("inf")]) == [-1.0, -1.0]


def test_conversational_completions_and_logged_metrics():
    logged = {}
    completions = [[{"role": "assistant", "content": "Answer: 7"}], [{"role": "assistant", "content": "no idea"}]]
    rewards = dapo_math_reward(completions, answer=["7", "7"], log_metric=logged.__setitem__)
    assert rewards == [1.0, -1.0]
    assert logged == {"math/accuracy": 0.5, "math/unparsable_ratio": 0.5, "math/undecided_ratio": 0.0}


def test_a_completion_of_another_shape_is_named_with_the_shapes_accepted():
    """A list of lists of strings (not of message dicts) raised `AttributeError: 'str' object has no attribute 'get'`."""
    expected = (
        r"completion 1 is list \['Answer: 5'\]; a completion is a string \(a standard dataset\) or a list of message "
        r"dicts \(a conversational one, as TRL passes it: \[\{'role': 'assistant', 'content': 'Answer: 5'\}\]"
    )
    with pytest.raises(TypeError, match=expected):
        dapo_math_reward([[{"role": "assistant", "content": "Answer: 5"}], ["Answer: 5"]], answer=["5", "5"])
    with pytest.raises(TypeError, match=r"completion 0 is NoneType None; a completion is a string"):
        dapo_math_reward([None], answer=["5"])
    # what TRL passes for a conversational dataset, a tool's message with no content among them
    turns = [{"role": "assistant", "content": "Let me check.", "tool_calls": []}, {"role": "tool", "content": None}]
    completions = [[*turns, {"role": "assistant", "content": "\nAnswer: 5"}], "Answer: 5"]
    assert dapo_math_reward(completions, answer=["5", "5"]) == [1.0, 1.0]


SYMBOLIC = [("Answer: 0.5", "1/2", 1.0), ("Answer: \\frac{1}{2}", "0.5", 1.0), ("Answer: 1/3", "1/2", -1.0)]


def test_equivalence_is_the_same_in_a_thread_pool():
    """math-verify's own timeout is signal.alarm, which raises off the main thread: 0.5 against 1/2 scored -1 there."""
    on_main = [score_answer(completion, truth).reward for completion, truth, _ in SYMBOLIC]
    with ThreadPoolExecutor(max_workers=3) as pool:
        in_threads = list(pool.map(lambda case: score_answer(case[0], case[1]).reward, SYMBOLIC * 2))
    assert on_main == [reward for _, _, reward in SYMBOLIC]
    assert in_threads == on_main * 2


HOSTILE = [
    "9^{9^{9^{9}}}",
    "99999999!",
    "10^{10^{10}}",
    "9^9^9",
    "2**2**100",
    "9^{123456789}",
    "(10^{5})!",
    "(9!)!",
    "1" * 201,
]


@pytest.mark.parametrize("answer", HOSTILE)
def test_answers_too_costly_to_evaluate_are_rejected_before_evaluation(answer):
    assert why_costly(answer) is not None


@pytest.mark.parametrize("answer", ["x^2 + y^2", "2^{10}", "5!", "\\frac{1}{2}", "(2n)!", "3^{1000}", "e^{i\\pi}"])
def test_ordinary_answers_are_evaluated(answer):
    assert why_costly(answer) is None


def test_hostile_answers_are_string_matched_and_counted():
    logged = {}
    completions = [f"Answer: {answer}" for answer in HOSTILE] + ["Answer: 0.5"]
    rewards = dapo_math_reward(completions, answer=["3"] * len(HOSTILE) + ["1/2"], log_metric=logged.__setitem__)
    assert rewards == [-1.0] * len(HOSTILE) + [1.0]
    assert logged["math/undecided_ratio"] == pytest.approx(len(HOSTILE) / (len(HOSTILE) + 1))


def test_past_the_batch_bound_answers_are_string_matched_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(math_reward, "BATCH_SECONDS", 0.0)
    monkeypatch.setattr(math_reward, "BATCH_SECONDS_PER_COMPLETION", 0.0)
    logged = {}
    with caplog.at_level(logging.WARNING):
        rewards = dapo_math_reward(
            ["Answer: 0.5", "Answer: 1/2"], answer=["1/2", "1/2"], log_metric=logged.__setitem__
        )
    assert rewards == [-1.0, 1.0]  # the string match alone: 0.5 is not decided equal to 1/2
    assert logged["math/undecided_ratio"] == 0.5
    assert "(waiting for the worker included) ran out; 2 were string-matched" in caplog.text


def test_a_worker_out_of_time_gives_no_verdict_and_the_next_one_answers():
    worker = EquivalenceWorker()
    try:
        assert worker.equivalent("0.5", "1/2", timeout=0.0) is None
        assert worker.equivalent("0.5", "1/2", timeout=30.0) is True
        assert worker.equivalent("0.4", "1/2", timeout=30.0) is False
    finally:
        worker.close()


def test_the_worker_runs_nothing_from_the_current_folder(tmp_path, monkeypatch):
    """`python -c` put the current folder first on the worker's path: a `json.py` there ran in the worker."""
    marker = tmp_path / "ran"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('json.py ran')\n")
    monkeypatch.chdir(tmp_path)
    worker = EquivalenceWorker()
    try:
        assert worker.equivalent("0.5", "1/2", timeout=60.0) is True
    finally:
        worker.close()
    assert not marker.exists()


ROOT = Path(__file__).resolve().parent.parent
PROBE = """
from trl_dapo.rewards.equivalence import EquivalenceWorker

worker = EquivalenceWorker()
print(worker.equivalent("0.5", "1/2", timeout=60.0))
worker.close()
"""


@pytest.mark.parametrize("run_as", ["-m", "-c", "script"])
def test_the_worker_imports_nothing_from_the_callers_folders(tmp_path, run_as):
    """`python -m` put the working folder on the caller's path as an absolute entry, `python script.py` the script's
    folder: a module there named like one math-verify imports ran in the worker."""
    marker = tmp_path / "ran"
    for name in ("math_verify", "latex2sympy2_extended"):
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r})\nraise SystemExit('the planted {name}.py ran')\n"
        )
    (tmp_path / "probe.py").write_text(PROBE)
    command = {"-m": ["-m", "probe"], "-c": ["-c", PROBE], "script": [str(tmp_path / "probe.py")]}[run_as]
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this package: the worker must find math-verify all the same
    result = subprocess.run([sys.executable, *command], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert not marker.exists(), result.stderr[-2000:]
    assert result.returncode == 0 and result.stdout.split() == ["True"], result.stderr[-2000:]


def test_concurrent_calls_each_return_within_the_bound(monkeypatch):
    """Threads each scoring one slow answer: the call's clock started after its wait for the worker, and calls took up
    to 38.9 s against a bound of 10.1 s. Each call now returns within the bound, its waits included (the slack: ending
    the timed-out worker and starting its replacement, which the call does not wait for)."""
    monkeypatch.setattr(math_reward, "why_costly", lambda answer: None)  # 9^{123456789} reaches math-verify
    monkeypatch.setattr(math_reward, "BATCH_SECONDS", 3.0)
    monkeypatch.setattr(math_reward, "BATCH_SECONDS_PER_COMPLETION", 0.0)
    math_reward._WORKER.start()

    def timed_call(_) -> tuple[float, list[float]]:
        started = time.monotonic()
        rewards = dapo_math_reward(["Answer: 9^{123456789}"], answer=["1"])
        return time.monotonic() - started, rewards

    with ThreadPoolExecutor(max_workers=6) as pool:
        calls = list(pool.map(timed_call, range(6)))
    assert [rewards for _, rewards in calls] == [[-1.0]] * 6
    bound = math_reward.batch_time_limit(1)
    assert bound == 3.0
    assert max(seconds for seconds, _ in calls) < bound + 2 * math_reward.ANSWER_TIMEOUT, calls
    assert (
        math_reward.score_answer("Answer: 0.5", "1/2").reward == 1.0
    )  # the replacement answers, unbounded calls wait


def wait_for_exit(pid: int, seconds: float) -> int | None:
    """The exit code of child `pid`, or None (the child killed) when it is still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_while_another_thread_waits_on_the_worker_gets_its_own():
    """A fork while a thread waits on the worker copied its lock held: the child's first call blocked forever."""
    worker = EquivalenceWorker()
    worker.start()
    # math-verify computes 9^123456789 for longer than the 10 s this thread waits, holding the worker's lock
    busy = threading.Thread(target=worker.equivalent, args=("9^{123456789}", "1", 10.0))
    busy.start()
    time.sleep(1.0)
    assert busy.is_alive()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its own worker answers
        code = 1
        try:
            code = 0 if worker.equivalent("0.5", "1/2", timeout=30.0) is True else 1
        finally:
            os._exit(code)
    try:
        assert wait_for_exit(pid, 60.0) == 0
        busy.join()
        assert worker.equivalent("0.4", "1/2", timeout=60.0) is False
    finally:
        busy.join()
        worker.close()


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


@pytest.mark.parametrize("truth", [float("nan"), float("inf"), float("-inf")])
def test_rows_whose_answer_is_not_a_finite_number_are_named(truth):
    """`Dataset.from_dict` keeps a NaN, which the string cast would turn into the ground truth 'nan'."""
    plain = Dataset.from_dict({"problem": ["a", "b", "c"], "answer": [1.0, 2.5, truth]})
    with pytest.raises(ValueError, match=r"row 2 has no value in column 'answer' \(null, empty, NaN or infinite\)"):
        to_prompt_answer(plain)
    prompt = [{"role": "user", "content": "1+1?"}]
    dapo = Dataset.from_dict(
        {"prompt": [prompt, prompt], "reward_model": [{"ground_truth": truth}, {"ground_truth": 2.0}]}
    )
    with pytest.raises(ValueError, match=r"row 0 has no value in column 'reward_model.ground_truth'"):
        to_prompt_answer(dapo)
    assert is_blank(truth) and not is_blank(2.5)


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
