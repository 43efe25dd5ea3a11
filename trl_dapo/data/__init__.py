"""Math datasets in the layout the DAPO recipe trains on (a `prompt` and an `answer` string)."""

from .math import DAPO_MATH_17K, arithmetic_dataset, load_math_dataset

__all__ = ["DAPO_MATH_17K", "arithmetic_dataset", "load_math_dataset"]
