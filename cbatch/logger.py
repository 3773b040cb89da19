"""cbatch's log lines: the ``cbatch`` logger (and its children, ``cbatch.server``, ...) writes
to stderr as ``cbatch: <message>`` (``cbatch: warning: <message>`` from WARNING up), at the
level ``$CBATCH_LOGGING_LEVEL`` names (INFO unless set), as vLLM's ``VLLM_LOGGING_LEVEL`` does.

At INFO a model load says what it loads and when it is ready (two lines).  A library user
silences that with ``CBATCH_LOGGING_LEVEL=WARNING``, or in code with
``logging.getLogger("cbatch").setLevel(logging.WARNING)``; a program that configures logging
itself can remove :data:`HANDLER` from the ``cbatch`` logger (records also propagate to the
root logger's handlers, as any library's do).
"""

from __future__ import annotations

import logging
import sys

from cbatch import envs


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        record.message = record.getMessage()
        text = f"cbatch: {level}{record.message}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes (pytest's capture, a redirect),
    not as it was when cbatch was imported (as logging's own last-resort handler)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


HANDLER = _StderrHandler()
HANDLER.setFormatter(_Formatter())


def _configure() -> None:
    root = logging.getLogger("cbatch")
    if HANDLER not in root.handlers:
        root.addHandler(HANDLER)
    if root.level == logging.NOTSET:  # a level the program set first wins
        root.setLevel(envs.CBATCH_LOGGING_LEVEL)


_configure()


def init_logger(name: str) -> logging.Logger:
    """The logger for module ``name`` (a ``cbatch.`` name: its lines go through ``cbatch``).
    Every module that logs gets its logger here, so the ``cbatch`` logger is set up by the
    first such import (not by ``import cbatch``, which stays light)."""
    return logging.getLogger(name)
