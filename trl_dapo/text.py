"""Counts in messages read as English: "1 prompt", "3 prompts"; "completion 4", "completion 4 (and 2 more)"."""

from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, with an `s` unless the count is 1."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def and_more(count: int) -> str:
    """ " (and N more)" after the first of `count` items named, or nothing when it is the only one."""
    return f" (and {count - 1} more)" if count > 1 else ""
