"""Math datasets in the layout the DAPO recipe trains on (a `prompt` and an `answer` string), and scratchpad addition
with difficulty buckets (`addition.py`)."""

from .addition import addition_splits
from .math import DAPO_MATH_17K, arithmetic_dataset, load_math_dataset

__all__ = ["DAPO_MATH_17K", "addition_splits", "arithmetic_dataset", "load_math_dataset"]
