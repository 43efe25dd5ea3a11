"""DAPO's math reward: +1 when the final `Answer: ...` line equals the ground truth, -1 otherwise.

As the reference recipe: only the last 300 characters are searched, and the last `Answer:` match counts. Equality is
math-verify's (symbolic: `1/2` = `\\frac{1}{2}` = `0.5`), with an exact match of normalised strings as the fallback
when math-verify cannot parse one side. A completion that cannot be scored gets -1 and is counted, never raised; a
missing ground truth (None, empty) matches nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from math_verify import parse, verify

ANSWER_PATTERN = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
TAIL_CHARS = 300
CORRECT, INCORRECT = 1.0, -1.0
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


def _as_latex(answer: str) -> str:
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """math-verify equivalence, falling back to an exact match of normalised strings."""
    try:
        gold, guess = parse(_as_latex(ground_truth)), parse(_as_latex(answer))
        if gold and guess and verify(gold, guess):
            return True
    except Exception:  # math-verify raises on pathological inputs; the strict match still decides
        pass
    return normalize(answer) == normalize(ground_truth)


def _text(completion: Any) -> str:
    """Plain text of a completion, conversational (`[{"role", "content"}]`) or not."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def is_missing(ground_truth: Any) -> bool:
    """No ground truth (None, or nothing left once normalised): no answer can match it, `Answer: None` included."""
    return ground_truth is None or normalize(str(ground_truth)) == ""


def score_answer(completion: Any, ground_truth: str | None) -> tuple[float, bool]:
    """(reward, parsed): +1/-1 (always -1 against a missing ground truth), and whether an `Answer:` line was found."""
    answer = extract_answer(_text(completion))
    if answer is None:
        return INCORRECT, False
    if is_missing(ground_truth):
        return INCORRECT, True
    return (CORRECT if is_equivalent(answer, str(ground_truth)) else INCORRECT), True


def dapo_math_reward(
    completions: Sequence[Any],
    answer: Sequence[str],
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: reads the `answer` column; logs accuracy and the share of completions with no `Answer:`."""
    scored = [score_answer(completion, truth) for completion, truth in zip(completions, answer, strict=True)]
    if log_metric is not None:
        count = max(len(scored), 1)
        log_metric("math/accuracy", sum(reward == CORRECT for reward, _ in scored) / count)
        log_metric("math/unparsable_ratio", sum(not parsed for _, parsed in scored) / count)
    return [reward for reward, _ in scored]
