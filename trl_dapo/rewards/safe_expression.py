"""A guard against answers that cost too much to evaluate: model output is untrusted text.

math-verify evaluates what it parses with sympy, so `9^{9^{9^{9}}}`, `99999999!` or `10^{10^{10}}` would be computed
(until a timeout, 5 s each by default). `why_costly` rejects them before any evaluation, from the text alone; the math
reward scores a rejected answer by exact string match only. The time bound of the evaluation itself is
`equivalence.py`'s; this guard keeps hostile answers from spending it.
"""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 200
MAX_EXPONENT_DIGITS = 4  # 9^{9999} has 9,543 digits: cheap; 9^{99999999} has 95 million
MAX_FACTORIAL_DIGITS = 3  # 999! has 2,565 digits: cheap; 99999999! is not
_POWER = re.compile(r"\^|\*\*")
_NUMBER = re.compile(r"\d+")
_CLOSING = {"{": "}", "(": ")", "[": "]"}


def _group_after(text: str, start: int) -> tuple[str, int]:
    """The operand starting at `start` (a bracketed group, balanced, else a run of word characters and dots), and
    where it ends."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start < len(text) and text[start] in _CLOSING:
        opening, closing, depth = text[start], _CLOSING[text[start]], 0
        for end in range(start, len(text)):
            depth += (text[end] == opening) - (text[end] == closing)
            if depth == 0:
                return text[start + 1 : end], end + 1
        return text[start + 1 :], len(text)
    match = re.match(r"[\w.\\]*", text[start:])
    return match.group(0), start + match.end()


def _group_before(text: str, end: int) -> str:
    """The operand ending just before `end`: a bracketed group (balanced), else a run of word characters."""
    end -= 1
    while end >= 0 and text[end] == " ":
        end -= 1
    openings = {closing: opening for opening, closing in _CLOSING.items()}
    if end >= 0 and text[end] in openings:
        closing, opening, depth = text[end], openings[text[end]], 0
        for start in range(end, -1, -1):
            depth += (text[start] == closing) - (text[start] == opening)
            if depth == 0:
                return text[start + 1 : end]
        return text[:end]
    match = re.search(r"[\w.]*$", text[: end + 1])
    return match.group(0)


def _longest_number(text: str) -> int:
    return max((len(number) for number in _NUMBER.findall(text)), default=0)


def why_costly(answer: str) -> str | None:
    """Why evaluating `answer` could take long (a nested or huge exponent, a factorial of a big number, a very long
    expression), or None when it is cheap."""
    if len(answer) > MAX_ANSWER_CHARS:
        return f"longer than {MAX_ANSWER_CHARS} characters"
    for power in _POWER.finditer(answer):
        exponent, end = _group_after(answer, power.end())
        if _POWER.search(exponent) or _POWER.match(answer[end:].lstrip()):  # 9^{9^9}, or 9^9^9: a tower either way
            return "a nested exponent"
        if _longest_number(exponent) > MAX_EXPONENT_DIGITS:
            return f"an exponent of more than {MAX_EXPONENT_DIGITS} digits"
    for factorial in re.finditer("!", answer):
        operand = _group_before(answer, factorial.start())
        if _POWER.search(operand) or "!" in operand:  # (10^{5})!, (9!)!
            return "a factorial of a power or of a factorial"
        if _longest_number(operand) > MAX_FACTORIAL_DIGITS:
            return f"a factorial of a number of more than {MAX_FACTORIAL_DIGITS} digits"
    return None
