"""Generated task families of graded difficulty for a small pretrained instruct model, each in two prompt styles.

A 135M instruct model gets almost nothing right on competition math, so RL on it has no signal. These families are
easy enough that some samples of some problems are right (`FAMILIES`, easiest first):

- `add1`: one-digit addition (`7 + 5`); 100 distinct problems;
- `add12`: a one-digit and a two-digit number, in either order (`47 + 8`);
- `add2`: two two-digit numbers (`47 + 38`);
- `word2`: a two-step word problem with one-digit numbers (has 7, buys 5 more, gives 3 away).

Prompt styles (`PROMPT_STYLES`): `dapo`, the DAPO recipe's instruction (reason step by step, last line
`Answer: N`), and `oneshot`, a short instruction with one worked example of the answer line. Rows are a one-message
conversation `prompt` and an `answer` string, the layout the math reward (`trl_dapo.rewards.math`) scores, plus the
`family` and a plain-text `problem`. `task_splits` draws held-out problems first and training problems from the rest,
so the two never share a problem.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from datasets import Dataset, DatasetDict

from ..rewards.math import PROMPT_TEMPLATE

Problem = tuple[str, int]  # (problem text, answer)

NAMES = ("Ava", "Ben", "Mia", "Leo", "Zoe", "Sam", "Ivy", "Max")
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils")


def _add1(rng: random.Random) -> Problem:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} + {b}?", a + b


def _add12(rng: random.Random) -> Problem:
    a, b = rng.randrange(10), rng.randrange(10, 100)
    a, b = (a, b) if rng.random() < 0.5 else (b, a)
    return f"What is {a} + {b}?", a + b


def _add2(rng: random.Random) -> Problem:
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    return f"What is {a} + {b}?", a + b


def _word2(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randrange(2, 10), rng.randrange(1, 10)
    c = rng.randrange(1, a + b)
    text = (
        f"{name} has {a} {item}. {name} buys {b} more {item} and then gives {c} {item} away. "
        f"How many {item} does {name} have now?"
    )
    return text, a + b - c


FAMILIES: dict[str, Callable[[random.Random], Problem]] = {
    "add1": _add1,
    "add12": _add12,
    "add2": _add2,
    "word2": _word2,
}
DISTINCT = {"add1": 100}  # families with few distinct problems: the split must leave some for training

ONESHOT_TEMPLATE = (
    "Answer the question. End with a line of the form Answer: N where N is the number.\n\n"
    "Example:\nQuestion: What is 2 + 3?\nAnswer: 5\n\nQuestion: {problem}"
)
PROMPT_STYLES = {"dapo": PROMPT_TEMPLATE, "oneshot": ONESHOT_TEMPLATE}


def _check(family: str, style: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; choose one of {sorted(FAMILIES)}.")
    if style not in PROMPT_STYLES:
        raise ValueError(f"prompt style={style!r} is unknown; choose one of {sorted(PROMPT_STYLES)}.")


def draw_problems(family: str, count: int, seed: int, exclude: set[str] = frozenset()) -> list[Problem]:
    """`count` distinct problems of `family` whose text is not in `exclude`; raises when the family has too few."""
    _check(family, "dapo")
    rng, seen, problems = random.Random(seed), set(exclude), []
    for _ in range(100 * count + 1000):
        if len(problems) == count:
            break
        problem = FAMILIES[family](rng)
        if problem[0] not in seen:
            seen.add(problem[0])
            problems.append(problem)
    if len(problems) < count:
        raise ValueError(
            f"family {family!r}: only {len(problems)} distinct problems outside the {len(exclude)} excluded were "
            f"found for the {count} asked for; ask for fewer (num_train / num_test)."
        )
    return problems


def to_dataset(problems: list[Problem], family: str, style: str) -> Dataset:
    """Columns: `prompt` (one user message in the style), `answer` (string), `problem`, `family`."""
    _check(family, style)
    template = PROMPT_STYLES[style]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": template.format(problem=text)}] for text, _ in problems],
            "answer": [str(answer) for _, answer in problems],
            "problem": [text for text, _ in problems],
            "family": [family] * len(problems),
        }
    )


def task_splits(family: str, style: str, num_train: int, num_test: int, seed: int = 0) -> DatasetDict:
    """`test` (held out, drawn first) and `train` problems of one family in one prompt style, disjoint. A family with
    fewer distinct problems than `num_train + num_test` (`add1`) gets all that are left for training."""
    test = draw_problems(family, num_test, seed)
    room = DISTINCT.get(family, num_train + num_test) - num_test
    if room < 1:
        raise ValueError(
            f"family {family!r} has {DISTINCT[family]} problems: num_test={num_test} leaves none to train."
        )
    train = draw_problems(family, min(num_train, room), seed + 1, exclude={text for text, _ in test})
    return DatasetDict({"train": to_dataset(train, family, style), "test": to_dataset(test, family, style)})
