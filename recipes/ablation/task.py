"""The study's task: multi-digit addition with a column-by-column scratchpad, an exact verifier and a difficulty
knob, and how its held-out completions are scored (`evaluate_held_out`).

A problem `a+b` is written as the prompt `"347+85\\n"`; its worked solution adds the columns right to left, writing
the carry in, then the answer line the reference math reward reads:

    7+5+0=12
    4+8+1=13
    3+0+1=4
    Answer: 432

Difficulty is the digit count of the longer operand: each extra column is one more step to get right, so a model
trained briefly on the worked solutions is nearly always right on short problems and mostly wrong on long ones, and
the per-prompt pass rates of a spread of lengths cover 0 to 1 (the regime where dynamic sampling matters).

A worked solution may also *recheck*: write its column block again, verbatim, before the answer line
(`AdditionProblem.worked`). Rechecks are still right, only longer; a warm start taught some of them has a verbose
habit that sometimes runs past a length limit, which is what gives overlong filtering and the soft overlong
punishment something to act on. `excess_columns` measures the habit in a completion.
Everything is drawn from `random.Random(seed)`: the same seed gives the same problems.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datasets import Dataset, DatasetDict

from trl_dapo.evaluation import EvalSettings, evaluate
from trl_dapo.rewards.math import extract_answer

Bucket = tuple[int, int]  # inclusive range of difficulties (digits of the longer operand)
COLUMN_LINE = re.compile(r"^\d\+\d\+\d=\d{1,2}$", re.MULTILINE)  # one scratchpad column, e.g. "7+5+0=12"


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def digits(self) -> int:
        """Difficulty: digits of the longer operand (the number of scratchpad columns)."""
        return max(len(str(self.a)), len(str(self.b)))

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}\n"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def solution(self) -> str:
        """The worked scratchpad and the answer line (no end-of-sequence token)."""
        return self.worked(rechecks=0)

    def worked(self, rechecks: int) -> str:
        """The scratchpad with its column block written `1 + rechecks` times, then the answer line."""
        lines, carry = [], 0
        for column in range(self.digits):
            x, y = (value // 10**column % 10 for value in (self.a, self.b))
            lines.append(f"{x}+{y}+{carry}={x + y + carry}")
            carry = (x + y + carry) // 10
        return "\n".join([*lines * (1 + rechecks), f"Answer: {self.answer}"])


def draw_rechecks(rng: random.Random, probability: float) -> int:
    """How many times a worked solution rechecks: geometric, each further recheck with `probability`. Draws nothing
    when `probability` is 0, so solutions without rechecks leave the random stream as it was."""
    if not 0.0 <= probability < 1.0:
        raise ValueError(f"recheck probability {probability} must be in [0, 1).")
    rechecks = 0
    while probability and rng.random() < probability:
        rechecks += 1
    return rechecks


def excess_columns(completion: str, digits: int) -> int:
    """Scratchpad column lines beyond the problem's `digits` columns: rechecks (or a column written twice)."""
    return max(0, len(COLUMN_LINE.findall(completion)) - digits)


def verify(completion: str, answer: str) -> bool:
    """Exact: the last `Answer:` line (as the reference math reward finds it) is the sum's decimal digits."""
    found = extract_answer(completion)
    return found is not None and found == answer


def bucket_label(bucket: Bucket) -> str:
    low, high = bucket
    return str(low) if low == high else f"{low}-{high}"


def check_buckets(buckets: Sequence[Bucket], min_digits: int, max_digits: int) -> None:
    """Buckets must tile `min_digits..max_digits` in order, without gaps or overlaps, so every problem has one."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits: need 1 <= min_digits ({min_digits}) <= max_digits ({max_digits}).")
    expected = min_digits
    for low, high in buckets:
        if low != expected or high < low:
            raise ValueError(
                f"buckets={list(buckets)}: each bucket (low, high) must start right after the previous one, from "
                f"min_digits={min_digits}; ({low}, {high}) should start at {expected}."
            )
        expected = high + 1
    if expected != max_digits + 1:
        raise ValueError(f"buckets={list(buckets)} must end at max_digits={max_digits}.")


def bucket_of(digits: int, buckets: Sequence[Bucket]) -> str:
    for bucket in buckets:
        if bucket[0] <= digits <= bucket[1]:
            return bucket_label(bucket)
    raise ValueError(f"difficulty {digits} falls in none of the buckets {list(buckets)}.")


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def draw_problem(rng: random.Random, low: int, high: int) -> AdditionProblem:
    """Longer operand of `low..high` digits (uniform), the other of 1 up to as many, in either order."""
    digits = rng.randint(low, high)
    longer, shorter = _operand(rng, digits), _operand(rng, rng.randint(1, digits))
    return AdditionProblem(longer, shorter) if rng.random() < 0.5 else AdditionProblem(shorter, longer)


def draw_unique(
    rng: random.Random, count: int, low: int, high: int, exclude: Iterable[AdditionProblem] = ()
) -> list[AdditionProblem]:
    """`count` distinct problems not in `exclude`; raises when the difficulty range has too few of them."""
    seen, problems = set(exclude), []
    for _ in range(50 * count + 1000):
        if len(problems) == count:
            return problems
        problem = draw_problem(rng, low, high)
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    if len(problems) == count:
        return problems
    raise ValueError(
        f"only {len(problems)} distinct problems of {low}..{high} digits were found for the {count} asked for; "
        "ask for fewer or widen the digit range."
    )


def to_dataset(problems: Sequence[AdditionProblem], buckets: Sequence[Bucket]) -> Dataset:
    """Columns: `prompt` (plain text), `answer`, `solution` (worked scratchpad), `digits`, `bucket` (its label)."""
    return Dataset.from_dict(
        {
            "prompt": [p.prompt for p in problems],
            "answer": [p.answer for p in problems],
            "solution": [p.solution for p in problems],
            "digits": [p.digits for p in problems],
            "bucket": [bucket_of(p.digits, buckets) for p in problems],
        }
    )


def addition_splits(
    num_train: int,
    test_per_bucket: int,
    buckets: Sequence[Bucket] = ((1, 2), (3, 4), (5, 6), (7, 8)),
    seed: int = 0,
) -> DatasetDict:
    """A held-out `test` split with `test_per_bucket` problems of each bucket, and a disjoint `train` split of
    `num_train` problems whose difficulty is uniform over the buckets' whole range."""
    min_digits, max_digits = buckets[0][0], buckets[-1][1]
    check_buckets(buckets, min_digits, max_digits)
    rng = random.Random(seed)
    test = [p for low, high in buckets for p in draw_unique(rng, test_per_bucket, low, high)]
    train = draw_unique(rng, num_train, min_digits, max_digits, exclude=test)
    return DatasetDict({"train": to_dataset(train, buckets), "test": to_dataset(test, buckets)})


def _correct(completion: str, problem: Mapping[str, Any]) -> bool:
    return verify(completion, problem["answer"])


def _rechecks(completion: str, problem: Mapping[str, Any]) -> bool:
    return excess_columns(completion, problem["digits"]) > 0


def evaluate_held_out(model, tokenizer, dataset: Dataset, settings: EvalSettings) -> dict[str, Any]:
    """The package's evaluator on this task: exact answers, accuracy per difficulty bucket, and beside the mechanism
    metrics the share of sampled completions that recheck (`rechecked`)."""
    return evaluate(model, tokenizer, dataset, settings, _correct, group="bucket", flags={"rechecked": _rechecks})
