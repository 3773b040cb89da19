"""A bounded pool of grammar-compile worker processes: kept warm, their jobs stoppable, and
ordered so that a small constraint does not wait behind heavy ones, whoever sent them.

Processes.  Workers are forked from a template process (the zygote of
:mod:`~cbatch.core.structured_output.worker`), which has imported xgrammar and built a
compiler for each vocabulary: a new worker is ready in milliseconds, however long xgrammar
takes to import.  From its start (:meth:`CompilePool.start`: a server's start-up, else the
first job) the pool keeps ``max_workers`` workers alive, and forks a new one at once for
each that is killed or dies.  A worker runs one job at a time: a compile against a
vocabulary, or a parse; it takes one core at most.

Budgets.  A job's time budget (``grammar_compile_timeout``) counts from its submission, its
wait for a worker included: no request waits longer than that for its grammar.  A job still
running at its deadline is stopped (its worker killed) and refused; a job still waiting fails
with :class:`WorkersBusy` (the server's 503), or is refused if it had run before (below).  A
job nobody waits for any more is stopped.

Order.  A job is *fresh* until it has run :data:`QUICK_COMPILE_S` seconds; then it is
*long*.  Fresh jobs go first, the shortest constraint text first; long ones in their order
of arrival.  While a fresh job waits and every worker runs a long job, the long job that
started last is stopped and queued again (it loses that much work, and runs again when no
fresh job waits): one worker turns to fresh jobs within QUICK_COMPILE_S, so a 3-character
regex never waits for a schema that takes seconds, from the same client or another.

One dispatcher thread hands jobs to workers and reads their replies (a compiled grammar's
JSON is read back beside it, in a thread pool).  One pool serves every engine of a process
(:func:`shared_pool`): its workers keep the vocabularies they were sent.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import threading
import time
from multiprocessing.connection import wait

from cbatch.core.structured_output.grammar import Refused
from cbatch.core.structured_output.jobs import CompileJob, Vocab, WorkersBusy
from cbatch.core.structured_output.worker import START_TIMEOUT_S, Worker, Zygote
from cbatch.logger import init_logger

logger = init_logger(__name__)

# how long a job runs before it may be stopped for a fresh one (a compile of an ordinary
# schema takes well under this; one that takes more waits while smaller ones go first)
QUICK_COMPILE_S = 1.0


class CompilePool:
    """``max_workers`` worker processes, kept warm (see the module)."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._queue: list[CompileJob] = []
        self._workers: list[Worker] = []
        self._zygote: Zygote | None = None
        self._wanted = False  # whether the zygote should run (not after it failed to start)
        self._vocabs: list[Vocab] = []  # loaded in every worker ahead of jobs (start())
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the dispatcher already
        self._thread: threading.Thread | None = None
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_jobs = 0  # submitted
        self.num_killed = 0  # workers killed for a job past its budget or cancelled
        self.num_stopped = 0  # long jobs stopped for fresh ones (and queued again)
        self.num_forked = 0  # workers started

    def start(self, vocab: Vocab | None = None) -> None:
        """Start the workers now, not at the first job (a server calls it at start-up), with
        ``vocab`` loaded in them ahead of the jobs that need it."""
        with self._lock:
            if vocab is not None and vocab not in self._vocabs:
                self._vocabs.append(vocab)
            self._run_dispatcher()
        self._wake()

    def is_warm(self) -> bool:
        """Whether ``max_workers`` workers are up with every vocabulary of :meth:`start`."""
        with self._lock:
            wanted = {v.id for v in self._vocabs}
            workers = [w for w in self._workers if w.ready and wanted <= w.vocabs]
            return None not in wanted and len(workers) >= self.max_workers

    def wait_warm(self, timeout: float) -> bool:
        """Wait until :meth:`is_warm` (True), the workers fail to start, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.is_warm():
            if not self._wanted or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def submit(self, job: CompileJob) -> None:
        with self._lock:
            self._queue.append(job)
            self.num_jobs += 1
            self._run_dispatcher()
        self._wake()

    def cancel(self, job: CompileJob) -> None:
        """Stop ``job``: dropped from the queue, or its worker killed; its future fails."""
        with self._lock:
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
        job.end(error=concurrent.futures.CancelledError())
        self._wake()

    def busy_pids(self) -> list[int]:
        """The process ids of the workers running a job now."""
        with self._lock:
            return [w.pid for w in self._workers if w.job is not None and w.ready]

    def worker_pids(self) -> list[int]:
        """The process ids of the workers that are up."""
        with self._lock:
            return [w.pid for w in self._workers if w.ready]

    def _run_dispatcher(self) -> None:
        """(Under the lock.)"""
        self._wanted = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cbatch-grammar",
                                            daemon=True)
            self._thread.start()

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
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            for w in [w for w in self._workers if w.job is not None and w.job.cancelled]:
                self._drop(w)
            self._stop_for_fresh(now)
            missing = self._keep_warm()
            assigned = self._assign()
        self._fork(missing)
        self._load_vocabs()
        for w, job in assigned:
            self._send(w, job)
        with self._lock:
            conns = {w.recv: w for w in self._workers}
            if self._zygote is not None:
                conns[self._zygote.conn] = self._zygote
            timeout = self._next_event(time.monotonic())
        for conn in wait([*conns, self._wake_r], timeout):
            if conn == self._wake_r:
                os.read(self._wake_r, 1 << 16)
            elif isinstance(conns[conn], Zygote):
                self._zygote_says(conns[conn])
            else:
                self._receive(conns[conn])
        self._past_deadlines(time.monotonic())

    def _next_event(self, now: float) -> float | None:
        """(Under the lock.)  Seconds until the next deadline, or a long job to stop."""
        times = [w.deadline for w in self._workers if w.deadline is not None]
        times += [j.deadline for j in self._queue]
        if self._zygote is not None and self._zygote.deadline is not None:
            times.append(self._zygote.deadline)
        if any(not j.long for j in self._queue):  # when a running job turns long
            times += [t for w in self._workers if w.job is not None and not w.job.long
                      and w.job.started is not None
                      and (t := w.job.started + QUICK_COMPILE_S) > now]
        return None if not times else max(0.0, min(times) - now)

    def _expire(self, now: float) -> None:
        """(Under the lock.)  Fail the queued jobs whose budget ran out."""
        for job in [j for j in self._queue if j.deadline <= now]:
            self._queue.remove(job)
            if job.long:
                job.end(error=Refused(
                    f"takes longer than this engine's limit of {job.timeout:g} s to compile "
                    "(grammar_compile_timeout; it was stopped once for smaller constraints, "
                    "its wait counts); give a simpler constraint"))
            else:
                job.end(error=WorkersBusy(
                    f"no grammar compile worker was free within this engine's limit of "
                    f"{job.timeout:g} s (grammar_compile_timeout): the server is compiling "
                    "other constraints; retry later"))

    def _stop_for_fresh(self, now: float) -> None:
        """(Under the lock.)  A fresh job waits and every worker runs a long job: stop the
        one that started last, and queue it again as long."""
        if not any(not j.long for j in self._queue) or len(self._workers) < self.max_workers:
            return
        running = [w for w in self._workers if w.job is not None and w.job.started is not None]
        if len(running) < len(self._workers) or any(
                not w.job.long and now - w.job.started < QUICK_COMPILE_S for w in running):
            return  # a worker is free, starting, or running a job that may still end soon
        w = max(running, key=lambda w: w.job.started)
        job, w.job = w.job, None
        job.long, job.started = True, None
        self._queue.append(job)
        self._drop(w)
        self.num_stopped += 1

    def _keep_warm(self) -> int:
        """(Under the lock.)  Start the zygote; how many workers to fork for ``max_workers``
        (forked outside the lock: only this thread adds workers, and a zygote busy with a
        vocabulary may be slow to read)."""
        if self._zygote is None and self._wanted:
            try:
                self._zygote = Zygote()
            except OSError as exc:
                self._give_up(RuntimeError(f"cannot start a grammar compile worker: {exc}"))
        if self._zygote is None or not self._zygote.ready:
            return 0
        return max(0, self.max_workers - len(self._workers))

    def _fork(self, count: int) -> None:
        for _ in range(count):
            try:
                worker = Worker(self._zygote)
            except OSError as exc:  # the zygote is gone: its end is read next
                logger.warning("could not fork a grammar compile worker: %s", exc)
                return
            with self._lock:
                self._workers.append(worker)
                self.num_forked += 1

    def _load_vocabs(self) -> None:
        """The vocabularies of :meth:`start`, made (slow: every token is read) and sent to
        the zygote, for the workers forked from now on, and to the idle workers (outside
        the lock: a vocabulary is megabytes)."""
        zygote = self._zygote
        if zygote is None or not zygote.ready:
            return
        for vocab in list(self._vocabs):
            try:
                vocab.load()
                if vocab.id not in zygote.vocabs:
                    zygote.add_vocab(vocab)
                with self._lock:
                    idle = [w for w in self._workers
                            if w.ready and w.job is None and vocab.id not in w.vocabs]
                for w in idle:
                    w.send.send(("vocab", vocab.id, vocab.json))
                    w.vocabs.add(vocab.id)
            except OSError:  # a process that died: its end is read next
                pass
            except Exception as exc:  # it cannot be made (no xgrammar?): jobs will say so
                logger.warning("could not load a vocabulary into the grammar workers: %s", exc)
                with self._lock:
                    self._vocabs.remove(vocab)

    def _send(self, w: Worker, job: CompileJob) -> None:
        """Send ``job`` to ``w`` (and its vocabulary, the first time)."""
        try:
            if job.vocab is not None and job.vocab.load().id not in w.vocabs:
                w.send.send(("vocab", job.vocab.id, job.vocab.json))
                w.vocabs.add(job.vocab.id)
            w.send.send((job.op, job.vocab.id, *job.args) if job.op == "compile"
                        else (job.op, *job.args))
        except OSError:  # the worker died before it read the job: the next turn sees it
            pass
        except Exception as exc:  # the vocabulary could not be made (no xgrammar?)
            job.end(error=exc)
            with self._lock:
                w.job = None
            return
        with self._lock:
            if w.job is job:
                job.started = time.monotonic()
                w.deadline = job.deadline

    def _assign(self) -> list[tuple[Worker, CompileJob]]:
        """(Under the lock.)  Give queued jobs to idle workers: fresh ones first, shortest
        first, then long ones in order of arrival.  The pairs to send."""
        idle = [w for w in self._workers if w.ready and w.job is None]
        order = sorted(self._queue, key=lambda j: (j.long, 0 if j.long else j.size,
                                                   j.submitted))
        assigned = list(zip(idle, order))
        for w, job in assigned:
            self._queue.remove(job)
            w.job = job
        return assigned

    def _zygote_says(self, zygote: Zygote) -> None:
        try:
            zygote.conn.recv()  # ("ready",)
        except (EOFError, OSError):  # it died: its workers die with it
            with self._lock:
                if not zygote.ready:
                    self._give_up(RuntimeError(
                        "the grammar compile worker failed to start (exit status "
                        f"{zygote.proc.wait()}); see the log"))
                else:
                    logger.warning("the grammar workers' zygote ended (exit status %s); "
                                   "starting another", zygote.proc.wait())
                    zygote.kill()
                    self._zygote = None
            return
        with self._lock:
            zygote.ready, zygote.deadline = True, None

    def _receive(self, w: Worker) -> None:
        try:
            reply = w.recv.recv()
        except (EOFError, OSError):  # it died: a crash of xgrammar's, or killed from outside
            with self._lock:
                job = w.job
                if w in self._workers:
                    self._drop(w, killed=False)
            if job is not None and not job.cancelled:
                logger.warning("a grammar compile worker died on a %s", job.op)
                job.end(error=Refused("made the grammar compiler fail (its process ended); "
                                       "give a simpler constraint"))
            return
        if reply[0] == "ready":
            with self._lock:
                w.pid, w.deadline = reply[1], None
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
            job.end(error=error)
        elif status == "error":
            job.end(error=Refused(value))
        elif job.op == "compile":  # read back beside this thread, which serves the others
            if self._loader is None:
                self._loader = concurrent.futures.ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="cbatch-grammar-load")
            self._loader.submit(job.end_with_json, value)
        else:
            job.end(None)

    def _past_deadlines(self, now: float) -> None:
        with self._lock:
            zygote = self._zygote
            if zygote is not None and zygote.deadline is not None and zygote.deadline < now:
                zygote.kill()
                self._zygote = None
                self._give_up(RuntimeError(f"the grammar compile worker did not start within "
                                           f"{START_TIMEOUT_S:g} s"))
            for w in [w for w in self._workers if w.deadline is not None and w.deadline < now]:
                if w.job is not None:
                    w.job.end(error=Refused(
                        f"takes longer than this engine's limit of {w.job.timeout:g} s to "
                        "compile (grammar_compile_timeout); give a simpler constraint"))
                self._drop(w)

    def _drop(self, w: Worker, killed: bool = True) -> None:
        """(Under the lock.)  Kill ``w`` and forget it; the next turn forks another."""
        w.kill()
        self._workers.remove(w)
        self.num_killed += killed and w.job is not None

    def _give_up(self, error: Exception) -> None:
        """(Under the lock.)  The workers cannot start: fail the queue; start again only for
        a new job."""
        self._wanted = False
        for job in self._queue:
            job.end(error=error)
        self._queue.clear()


def prestart(num_workers: int = 1) -> None:
    """Start this process's grammar workers now, before any engine exists (a server, while
    its model loads: the zygote imports xgrammar meanwhile); nothing without xgrammar."""
    if importlib.util.find_spec("xgrammar") is not None:
        shared_pool(num_workers).start()


_shared: CompilePool | None = None
_shared_lock = threading.Lock()


def shared_pool(max_workers: int) -> CompilePool:
    """This process's pool, with at least ``max_workers`` workers."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CompilePool(max_workers)
        _shared.max_workers = max(_shared.max_workers, max_workers)
        return _shared
