"""DAPO's math reward: +1 when the final `Answer: ...` line equals the ground truth, -1 otherwise.

As the reference recipe: only the last 300 characters are searched, and the last `Answer:` match counts. Equality is
an exact match of normalised strings or math-verify's (symbolic: `1/2` = `\\frac{1}{2}` = `0.5`). A completion that
cannot be scored gets -1 and is counted, never raised; a missing ground truth (None, empty, NaN or an infinite number:
what a dataset holds for a missing number) matches nothing.

Model output is untrusted text, so math-verify's time is bounded, the same in any thread: an answer too costly to
evaluate (`safe_expression.py`) is string-matched only; any other gets math-verify for at most `ANSWER_TIMEOUT`
seconds (`equivalence.py`); one call of the reward spends at most `batch_time_limit(n)` seconds in math-verify, and
the answers left past it are string-matched, with a warning. `math/undecided_ratio` counts the string-matched ones.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .equivalence import EquivalenceWorker
from .safe_expression import why_costly

logger = logging.getLogger(__name__)

ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
TAIL_CHARS = 300
CORRECT, INCORRECT = 1.0, -1.0
ANSWER_TIMEOUT = 1.0  # seconds of math-verify per completion
BATCH_SECONDS, BATCH_SECONDS_PER_COMPLETION = 10.0, 0.1  # seconds of math-verify per call of the reward
_WORKER = EquivalenceWorker()
PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def extract_answer(text: str) -> str | None:
    """The text after the last `Answer:` in the completion's tail, or None."""
    matches = ANSWER_PATTERN.findall(text[-TAIL_CHARS:])
    return matches[-1].strip() if matches else None


def normalize(answer: str) -> str:
    """Strict-match form: no `$`, `\\boxed{}`, `\\text{}`, spaces, trailing period or thousands commas."""
    answer = answer.strip().strip("$").rstrip(".")
    answer = re.sub(r"\\boxed\{(.*)\}", r"\1", answer)
    answer = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
    answer = re.sub(r"(\d),(\d{3})", r"\1\2", answer)
    return re.sub(r"\s+", "", answer.split("=")[-1])


def is_equivalent(answer: str, ground_truth: str, timeout: float = ANSWER_TIMEOUT) -> tuple[bool, bool]:
    """(equal, decided): an exact match of normalised strings, else math-verify's equivalence within `timeout`
    seconds in any thread (`equivalence.py`); `decided` is False when math-verify did not decide (an answer too costly
    to evaluate, `safe_expression.py`, or out of time), and only the string match counted."""
    if normalize(answer) == normalize(ground_truth):
        return True, True
    if timeout <= 0 or why_costly(answer) is not None:
        return False, False
    verdict = _WORKER.equivalent(answer, ground_truth, timeout)
    return bool(verdict), verdict is not None


def _text(completion: Any) -> str:
    """Plain text of a completion, conversational (`[{"role", "content"}]`) or not."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def is_missing(ground_truth: Any) -> bool:
    """No ground truth (None, nothing left once normalised, or NaN, an infinite number, or the text `nan`): no answer
    can match it, `Answer: None` and `Answer: nan` included."""
    if isinstance(ground_truth, numbers.Real) and not math.isfinite(ground_truth):
        return True
    return ground_truth is None or normalize(str(ground_truth)).lower() in ("", "nan")


class Score(NamedTuple):
    reward: float
    parsed: bool  # an `Answer:` line was found
    decided: bool  # math-verify decided (or the strings matched); else only the string match counted


def score_answer(completion: Any, ground_truth: str | None, timeout: float = ANSWER_TIMEOUT) -> Score:
    """+1/-1 (always -1 against a missing ground truth, `is_missing`), with math-verify given at most `timeout`
    seconds."""
    answer = extract_answer(_text(completion))
    if answer is None:
        return Score(INCORRECT, False, True)
    if is_missing(ground_truth):
        return Score(INCORRECT, True, True)
    equal, decided = is_equivalent(answer, str(ground_truth), timeout)
    return Score(CORRECT if equal else INCORRECT, True, decided)


def batch_time_limit(count: int) -> float:
    """Seconds math-verify may take over one call of the reward on `count` completions."""
    return BATCH_SECONDS + BATCH_SECONDS_PER_COMPLETION * count


def dapo_math_reward(
    completions: Sequence[Any],
    answer: Sequence[str],
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: reads the `answer` column; logs accuracy, the share of completions with no `Answer:` and
    the share whose equivalence math-verify did not decide. Each completion gets math-verify for at most
    `ANSWER_TIMEOUT` seconds and the call for at most `batch_time_limit` seconds; past that, the string match."""
    _WORKER.start()  # its start-up (seconds) is spent before the batch's time starts
    deadline = time.monotonic() + batch_time_limit(len(completions))
    scored, late = [], 0
    for completion, truth in zip(completions, answer, strict=True):
        timeout = min(ANSWER_TIMEOUT, deadline - time.monotonic())
        late += timeout <= 0
        scored.append(score_answer(completion, truth, timeout))
    if late:
        logger.warning(
            "math reward: math-verify's %.0f s for these %d completions ran out; the last %d were string-matched.",
            batch_time_limit(len(completions)), len(completions), late,
        )  # fmt: skip
    undecided = sum(not score.decided for score in scored)
    if log_metric is not None:
        count = max(len(scored), 1)
        log_metric("math/accuracy", sum(score.reward == CORRECT for score in scored) / count)
        log_metric("math/unparsable_ratio", sum(not score.parsed for score in scored) / count)
        log_metric("math/undecided_ratio", undecided / count)
    return [score.reward for score in scored]
