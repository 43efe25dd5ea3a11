"""Where trl-dapo's log lines go, as `transformers.logging` does it for transformers.

Its modules log to loggers under `trl_dapo` and add no handler when imported, so a script's own set-up
(`logging.basicConfig`, a notebook's) receives their records once, and without one Python prints WARNING and above.
`set_verbosity_info()` shows the INFO lines too (the generation path and the training passes chosen on the CPU, each
extra dynamic-sampling round): it sets the level and adds one handler that prints to stderr only while the root
logger has none, so records are never printed twice, whenever the script configures logging.
"""

from __future__ import annotations

import logging

LIBRARY_LOGGER = "trl_dapo"


class _StderrUnlessConfigured(logging.StreamHandler):
    """stderr while the root logger has no handler; once it has one, the records reach it by propagation alone."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def set_verbosity(level: int | str) -> None:
    """Show trl-dapo's records at `level` and above (`logging.INFO`, `"DEBUG"`, ...)."""
    logger = logging.getLogger(LIBRARY_LOGGER)
    logger.setLevel(level)
    if not any(isinstance(handler, _StderrUnlessConfigured) for handler in logger.handlers):
        handler = _StderrUnlessConfigured()
        handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        logger.addHandler(handler)


def set_verbosity_info() -> None:
    set_verbosity(logging.INFO)
