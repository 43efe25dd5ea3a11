"""DAPO's math reward: +1 when the final `Answer: ...` line equals the ground truth, -1 otherwise.

As the reference recipe: only the last 300 characters are searched, and the last `Answer:` match counts. Equality is
an exact match of normalised strings or math-verify's (symbolic: `1/2` = `\\frac{1}{2}` = `0.5`). A completion that
cannot be scored gets -1 and is counted, never raised; a missing ground truth (None, empty, NaN or an infinite number,
or their text: `nan`, `inf`, `-Infinity`: what a dataset holds for a missing number) matches nothing. A completion is
a string or, from a conversational dataset, a list of message dicts; anything else is a `TypeError` naming it.

Model output is untrusted text, so math-verify's time is bounded, the same in any thread: an answer too costly to
evaluate (`safe_expression.py`) is string-matched only; any other gets math-verify for at most `ANSWER_TIMEOUT`
seconds (`equivalence.py`). One call of the reward returns within `batch_time_limit(n)` seconds of math-verify time,
counted from its start and including its waits for the worker while other threads' calls use it (only the worker's
first start in a process, importing math-verify once, is not counted); the answers left past it are string-matched,
with a warning. `math/undecided_ratio` counts the string-matched ones.
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
# how a missing (NaN) or an infinite number reads as text: a ground truth no answer can match
MISSING_NUMBER_TEXTS = frozenset(f"{sign}{word}" for sign in ("", "+", "-") for word in ("nan", "inf", "infinity"))
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


def is_equivalent(
    answer: str, ground_truth: str, timeout: float = ANSWER_TIMEOUT, deadline: float | None = None
) -> tuple[bool, bool]:
    """(equal, decided): an exact match of normalised strings, else math-verify's equivalence within `timeout`
    seconds of its time, in any thread, and by `deadline` (`time.monotonic()`) where one is given, the waits for the
    worker included (`equivalence.py`); `decided` is False when math-verify did not decide (an answer too costly to
    evaluate, `safe_expression.py`, or out of time), and only the string match counted."""
    if normalize(answer) == normalize(ground_truth):
        return True, True
    if timeout <= 0 or why_costly(answer) is not None:
        return False, False
    verdict = _WORKER.equivalent(answer, ground_truth, timeout, deadline)
    return bool(verdict), verdict is not None


def completion_text(completion: Any, position: int | None = None) -> str:
    """The text of a completion: a string, or (a conversational dataset's) a list of message dicts, their contents
    joined; anything else is a `TypeError` naming the completion and the two shapes."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(message, dict) for message in completion):
        return "".join(str(message.get("content") or "") for message in completion)
    named = "a completion" if position is None else f"completion {position}"
    raise TypeError(
        f"math reward: {named} is {type(completion).__name__} {completion!r:.80}; a completion is a string (a "
        "standard dataset) or a list of message dicts (a conversational one, as TRL passes it: "
        "[{'role': 'assistant', 'content': 'Answer: 5'}] for each completion)."
    )


def is_missing(ground_truth: Any) -> bool:
    """No ground truth (None, nothing left once normalised, NaN or an infinite number, or their text: `nan`, `inf`,
    `-Infinity`): no answer can match it, `Answer: None` and `Answer: nan` included."""
    if isinstance(ground_truth, numbers.Real) and not math.isfinite(ground_truth):
        return True
    if ground_truth is None:
        return True
    text = normalize(str(ground_truth)).lower()
    return not text or text in MISSING_NUMBER_TEXTS


class Score(NamedTuple):
    reward: float
    parsed: bool  # an `Answer:` line was found
    decided: bool  # math-verify decided (or the strings matched); else only the string match counted


def score_answer(
    completion: Any, ground_truth: str | None, timeout: float = ANSWER_TIMEOUT, deadline: float | None = None
) -> Score:
    """+1/-1 (always -1 against a missing ground truth, `is_missing`), with math-verify given at most `timeout`
    seconds, and done by `deadline` (`is_equivalent`)."""
    answer = extract_answer(completion_text(completion))
    if answer is None:
        return Score(INCORRECT, False, True)
    if is_missing(ground_truth):
        return Score(INCORRECT, True, True)
    equal, decided = is_equivalent(answer, str(ground_truth), timeout, deadline)
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
    `ANSWER_TIMEOUT` seconds, and the call returns within `batch_time_limit` seconds of its start, its waits for the
    worker included (module docstring); past that, the string match."""
    texts = [completion_text(completion, position) for position, completion in enumerate(completions)]
    _WORKER.start()  # the worker's first start in this process (seconds, once) is counted against no call
    deadline = time.monotonic() + batch_time_limit(len(texts))
    scored, late = [], 0
    for text, truth in zip(texts, answer, strict=True):
        timeout = min(ANSWER_TIMEOUT, deadline - time.monotonic())
        score = score_answer(text, truth, timeout, deadline)
        late += timeout <= 0 or (not score.decided and time.monotonic() >= deadline)
        scored.append(score)
    if late:
        logger.warning(
            "math reward: math-verify's %.1f s for these %d completions (waiting for the worker included) ran out; %d "
            "were string-matched.", batch_time_limit(len(texts)), len(texts), late,
        )  # fmt: skip
    undecided = sum(not score.decided for score in scored)
    if log_metric is not None:
        count = max(len(scored), 1)
        log_metric("math/accuracy", sum(score.reward == CORRECT for score in scored) / count)
        log_metric("math/unparsable_ratio", sum(not score.parsed for score in scored) / count)
        log_metric("math/undecided_ratio", undecided / count)
    return [score.reward for score in scored]
