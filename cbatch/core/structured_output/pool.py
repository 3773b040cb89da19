"""A bounded pool of grammar-compile worker processes, whose jobs can be stopped.

Each worker (:mod:`~cbatch.core.structured_output.worker`) runs one job at a time: a compile
against a vocabulary, or a parse.  One dispatcher thread per process hands queued jobs to idle workers,
starting workers as jobs wait, up to ``max_workers``; it reads their replies and turns a
compiled grammar's JSON back into a ``CompiledGrammar``.  A worker is killed, and a new one
started when a job needs it, when its job runs past the job's time budget (the job fails),
when its job is cancelled (nobody waits for it any more), or when it dies.  So a compile takes
one core at most and never outlives its budget or its last request, and a slow one holds up
only its own worker: the others compile on.

One pool serves every engine of a process (:func:`shared_pool`): a worker takes a moment to
start (it loads xgrammar, and torch with it), and keeps the vocabularies it was sent.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from cbatch.core.structured_output.grammar import Refused, trim_memory, xgrammar
from cbatch.logger import init_logger

logger = init_logger(__name__)

# how long a worker may take to start (load xgrammar and torch) before it is given up on
START_TIMEOUT_S = 120.0


class Vocab:
    """A vocabulary as workers get it: an xgrammar ``TokenizerInfo`` (``make_info()``'s, made
    on the pool's thread when a job first needs it: it imports xgrammar and reads every
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
    result or the error (:class:`Refused` for the constraint's own fault)."""

    def __init__(self, op: str, args: tuple, vocab: Vocab | None, timeout: float):
        self.op, self.args, self.vocab, self.timeout = op, args, vocab, timeout
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()  # only the pool ends it
        self.cancelled = False
        self.started: float | None = None  # when a worker took it (time.monotonic)

    def _end(self, result=None, error: BaseException | None = None) -> None:
        try:  # (a cancel on another thread may have ended it first)
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass


class _Worker:
    def __init__(self):
        root = str(Path(__file__).resolve().parents[3])  # the directory that holds cbatch
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        to_worker, from_worker = os.pipe(), os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "cbatch.core.structured_output.worker"],
                                     stdin=to_worker[0], stdout=from_worker[1], env=env)
        os.close(to_worker[0])
        os.close(from_worker[1])
        self.send = Connection(to_worker[1], readable=False)
        self.recv = Connection(from_worker[0], writable=False)
        self.ready = False
        self.vocabs: set[str] = set()
        self.job: CompileJob | None = None
        self.deadline: float | None = time.monotonic() + START_TIMEOUT_S

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


class CompilePool:
    """Worker processes, at most ``max_workers``, started as jobs need them."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the dispatcher already
        self._thread: threading.Thread | None = None
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_jobs = 0  # submitted
        self.num_killed = 0  # workers killed for a job past its budget or cancelled

    def submit(self, job: CompileJob) -> None:
        with self._lock:
            self._queue.append(job)
            self.num_jobs += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cbatch-grammar",
                                                daemon=True)
                self._thread.start()
        self._wake()

    def cancel(self, job: CompileJob) -> None:
        """Stop ``job``: dropped from the queue, or its worker killed; its future fails."""
        with self._lock:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
        job._end(error=concurrent.futures.CancelledError())
        self._wake()

    def busy_pids(self) -> list[int]:
        """The process ids of the workers running a job now."""
        with self._lock:
            return [w.proc.pid for w in self._workers if w.job is not None]

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    # -------------------------------------------------------------- the dispatcher thread

    def _run(self) -> None:
        while True:
            try:
                self._turn()
            except Exception:  # a bug here must not leave every job waiting forever
                logger.exception("the grammar compile pool failed a turn")
                time.sleep(0.1)

    def _turn(self) -> None:
        with self._lock:
            for w in [w for w in self._workers if w.job is not None and w.job.cancelled]:
                self._drop(w)
            assigned = self._assign()
        for w, job in assigned:
            self._send(w, job)
        with self._lock:
            workers = {w.recv: w for w in self._workers}
            deadlines = [w.deadline for w in self._workers if w.deadline is not None]
        timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        for conn in wait([*workers, self._wake_r], timeout):
            if conn == self._wake_r:
                os.read(self._wake_r, 1 << 16)
            else:
                self._receive(workers[conn])
        now = time.monotonic()
        with self._lock:
            for w in [w for w in self._workers if w.deadline is not None and w.deadline < now]:
                if w.job is None:
                    self._fail_queue(RuntimeError(
                        f"the grammar compile worker did not start within {START_TIMEOUT_S:g} s"))
                else:
                    w.job._end(error=Refused(
                        f"takes longer than this engine's limit of {w.job.timeout:g} s to "
                        "compile (grammar_compile_timeout); give a simpler constraint"))
                self._drop(w)

    def _send(self, w: _Worker, job: CompileJob) -> None:
        """Send ``job`` to ``w`` (and its vocabulary, the first time); its time starts then."""
        try:
            if job.vocab is not None and job.vocab.load().id not in w.vocabs:
                w.send.send(("vocab", job.vocab.id, job.vocab.json))
                w.vocabs.add(job.vocab.id)
            w.send.send((job.op, job.vocab.id, *job.args) if job.op == "compile"
                        else (job.op, *job.args))
        except OSError:  # the worker died before it read the job: the next turn sees it
            pass
        except Exception as exc:  # the vocabulary could not be made (no xgrammar?)
            job._end(error=exc)
            with self._lock:
                w.job = None
            return
        with self._lock:
            if w.job is job:
                job.started = time.monotonic()
                w.deadline = job.started + job.timeout

    def _assign(self) -> list[tuple[_Worker, CompileJob]]:
        """Give queued jobs to idle workers, and start workers for the jobs left (under the
        lock); the pairs to send."""
        assigned = []
        for w in self._workers:
            if w.ready and w.job is None and self._queue:
                w.job = self._queue.popleft()
                assigned.append((w, w.job))
        starting = sum(not w.ready for w in self._workers)
        while len(self._queue) > starting and len(self._workers) < self.max_workers:
            try:
                self._workers.append(_Worker())
            except OSError as exc:
                self._fail_queue(RuntimeError(f"cannot start a grammar compile worker: {exc}"))
                break
            starting += 1
        return assigned

    def _receive(self, w: _Worker) -> None:
        try:
            reply = w.recv.recv()
        except (EOFError, OSError):  # it died: a crash of xgrammar's, or killed from outside
            with self._lock:
                job = w.job
                if job is None and not w.ready:
                    self._fail_queue(RuntimeError("the grammar compile worker failed to start "
                                                  f"(exit status {w.proc.poll()}); see the log"))
                self._drop(w, killed=False)
            if job is not None and not job.cancelled:
                logger.warning("the grammar compile worker died (exit status %s) on a %s",
                               w.proc.returncode, job.op)
                job._end(error=Refused("made the grammar compiler fail (its process ended); "
                                       "give a simpler constraint"))
            return
        if reply[0] == "ready":
            with self._lock:
                w.ready, w.deadline = True, None
            return
        with self._lock:
            job, w.job, w.deadline = w.job, None, None
        if job is None or job.cancelled:
            return
        status, value = reply
        if status == "error" and job.op == "parse":
            index, problem = value
            error = Refused(problem)
            error.index = index
            job._end(error=error)
        elif status == "error":
            job._end(error=Refused(value))
        elif job.op == "compile":  # read back beside this thread, which serves the others
            if self._loader is None:
                self._loader = concurrent.futures.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="cbatch-grammar-load")
            self._loader.submit(_load, job, value)
        else:
            job._end(None)

    def _drop(self, w: _Worker, killed: bool = True) -> None:
        """Kill ``w`` and forget it (under the lock)."""
        w.kill()
        self._workers.remove(w)
        self.num_killed += killed and w.job is not None

    def _fail_queue(self, error: Exception) -> None:
        while self._queue:
            self._queue.popleft()._end(error=error)


def _load(job: CompileJob, grammar_json: str) -> None:
    """End ``job`` with the ``CompiledGrammar`` of its worker's JSON."""
    try:  # (xgrammar lets go of the GIL here, as in compiles)
        job._end(xgrammar().CompiledGrammar.deserialize_json(grammar_json, job.vocab.info))
    except Exception as exc:
        job._end(error=exc)
    if len(grammar_json) > 1 << 20:
        # reading it back takes many times the grammar's size for a moment: give that back
        # to the system (glibc would keep it for this process)
        trim_memory()


_shared: CompilePool | None = None
_shared_lock = threading.Lock()


def shared_pool(max_workers: int) -> CompilePool:
    """This process's pool, with at least ``max_workers`` workers allowed."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompilePool(max_workers)
        _shared.max_workers = max(_shared.max_workers, max_workers)
        return _shared
