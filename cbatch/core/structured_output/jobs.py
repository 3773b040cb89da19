"""The jobs of the grammar workers' pool (:mod:`~cbatch.core.structured_output.pool`): a
compile or a parse, its budget counted from its submission, and the vocabulary a compile is
made against."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time

from cbatch.core.structured_output.grammar import trim_memory, xgrammar


class WorkersBusy(RuntimeError):
    """No worker was free for a job within its budget: the workers were busy with other
    constraints (the server's load, not this constraint's fault)."""


class Vocab:
    """A vocabulary as workers get it: an xgrammar ``TokenizerInfo`` (``make_info()``'s, made
    on the pool's thread when it is first needed: it imports xgrammar and reads every
    token), its JSON, and an id."""

    def __init__(self, make_info):
        self._make_info = make_info
        self._lock = threading.Lock()
        self.info = self.json = self.id = None

    def load(self) -> Vocab:
        with self._lock:
            if self.info is None:
                info = self._make_info()
                self.json = info.serialize_json()
                self.id = hashlib.sha256(self.json.encode()).hexdigest()
                self.info = info
        return self


class CompileJob:
    """One job: ``op`` "compile" (``args``: kind, value, max_bytes; the result a
    ``CompiledGrammar``) or "parse" (``args``: a list of (kind, value); the result None, or
    :class:`Refused` with ``index``, the first that does not parse).  ``future`` holds the
    result or the error (:class:`Refused` for the constraint's own fault).  ``size``: the
    length of its constraint's text (fresh jobs go shortest first)."""

    def __init__(self, op: str, args: tuple, vocab: Vocab | None, timeout: float,
                 size: int = 0):
        self.op, self.args, self.vocab, self.timeout, self.size = op, args, vocab, timeout, size
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()  # only the pool ends it
        self.cancelled = False
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout  # the wait for a worker counts
        self.started: float | None = None  # when a worker took it (this run)
        self.long = False  # it ran QUICK_COMPILE_S once and was stopped for a fresh job

    def end_with_json(self, grammar_json: str) -> None:
        """End a compile with the ``CompiledGrammar`` of its worker's JSON."""
        try:  # (xgrammar lets go of the GIL here, as in compiles)
            self.end(xgrammar().CompiledGrammar.deserialize_json(grammar_json,
                                                                  self.vocab.info))
        except Exception as exc:
            self.end(error=exc)
        if len(grammar_json) > 1 << 20:
            # reading it back takes many times the grammar's size for a moment: give that
            # back to the system (glibc would keep it for this process)
            trim_memory()

    def end(self, result=None, error: BaseException | None = None) -> None:
        try:  # (a cancel on another thread may have ended it first)
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
