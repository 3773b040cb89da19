"""The grammar workers' processes: ``python -m cbatch.core.structured_output.worker`` is the
*zygote*, a template that imports xgrammar once, builds a compiler for each vocabulary it is
sent, and forks a worker whenever the pool asks: a worker is ready in milliseconds, with
xgrammar and the vocabularies loaded (their memory shared with the zygote), however long
xgrammar (and torch with it) takes to import.

A worker parses and compiles constraints (:mod:`~cbatch.core.structured_output.grammar`),
one job at a time, for the pool (:class:`~cbatch.core.structured_output.pool.CompilePool`),
which kills it when its job runs past its time budget, is stopped for a quicker one, or has
nobody waiting for it any more (xgrammar's compile cannot be interrupted).  These processes
import nothing of cbatch but this package's grammar module, and xgrammar.  Both speak pickled
tuples over pipes (their stdout proper is sent to stderr, so that nothing printed corrupts a
pipe).  The zygote, over the socket that is its stdin:

    <- ("ready",)                                          once, when xgrammar is loaded
    -> ("vocab", vocab_id, tokenizer_info_json)           a compiler for later forks
    -> ("fork",), then two file descriptors (SCM_RIGHTS)  a worker on these pipes

A worker, over the two pipes it was given (jobs in, replies out):

    <- ("ready", pid)                                      once, at its start
    -> ("vocab", vocab_id, tokenizer_info_json)           a vocabulary for later jobs
    -> ("compile", vocab_id, kind, value, max_bytes)
    <- ("ok", compiled_grammar_json) | ("error", problem)
    -> ("parse", [(kind, value), ...])
    <- ("ok", None) | ("error", (index, problem))          the first that does not parse

A ``problem`` is :class:`~cbatch.core.structured_output.grammar.Refused`'s: the parent
names the field.  :class:`Zygote` and :class:`Worker` are the pool's handles on the two.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from cbatch.core.structured_output.grammar import (Refused, compile_grammar, parse_grammar,
                                                  trim_memory, xgrammar)

if TYPE_CHECKING:
    from cbatch.core.structured_output.jobs import CompileJob, Vocab


def main() -> None:
    """The zygote's loop (see the module), until the engine's process closes its socket."""
    _die_with_parent()
    os.dup2(2, 1)  # print() and C++ writes to stdout go to stderr
    sys.stdout = sys.stderr
    sock = socket.socket(fileno=0)  # the file descriptors come over it
    control = Connection(os.dup(0))  # and the messages
    xgr = xgrammar()
    compilers = {}  # vocab id -> GrammarCompiler, inherited by every later fork
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the system reaps the workers that end
    control.send(("ready",))
    zygote = os.getpid()
    while True:
        try:
            message = control.recv()
        except EOFError:  # the engine's process is gone, or let the pool go
            return
        if message[0] == "vocab":
            compilers[message[1]] = _compiler(xgr, message[2])
            continue
        _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        if os.fork() == 0:
            status = 0
            try:
                control.close()
                sock.close()
                _die_with_parent()
                if os.getppid() == zygote:  # (else the zygote ended before the line above)
                    _serve_jobs(Connection(fds[0], writable=False),
                                Connection(fds[1], readable=False), xgr, compilers)
            except BaseException:
                import traceback

                traceback.print_exc()
                status = 1
            finally:
                os._exit(status)  # none of the zygote's clean-up: it is the zygote's
        for fd in fds:
            os.close(fd)


def _compiler(xgr, info_json: str):
    # one thread: the pool's size is the number of cores compiles take; the engine caches
    # compiled grammars itself
    return xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                               cache_enabled=False)


def _serve_jobs(reader: Connection, writer: Connection, xgr, compilers: dict) -> None:
    """A worker's loop (see the module): one job at a time, until its job pipe closes."""
    writer.send(("ready", os.getpid()))
    while True:
        try:
            message = reader.recv()
        except EOFError:  # the pool let this worker go
            return
        op, args = message[0], message[1:]
        if op == "vocab":
            compilers[args[0]] = _compiler(xgr, args[1])
            continue
        try:
            if op == "compile":
                vocab_id, kind, value, max_bytes = args
                reply = ("ok", compile_grammar(compilers[vocab_id], kind, value,
                                               max_bytes).serialize_json())
            else:  # parse
                for index, (kind, value) in enumerate(args[0]):
                    try:
                        parse_grammar(kind, value)
                    except Refused as exc:
                        raise Refused((index, exc.problem)) from None
                reply = ("ok", None)
        except Refused as exc:
            reply = ("error", exc.problem)
        writer.send(reply)
        del reply
        trim_memory()


# ---------------------------------------------- the pool's side: its handles on them

# how long the zygote may take to start (import xgrammar, and torch with it), and a fork
START_TIMEOUT_S = 120.0
FORK_TIMEOUT_S = 30.0


def _popen_zygote(sock: socket.socket) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[3])  # the directory that holds cbatch
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "cbatch.core.structured_output.worker"],
                            stdin=sock.fileno(), env=env)


class Zygote:
    """The template process workers are forked from (see the module)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        try:
            self.proc = _popen_zygote(theirs)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours  # file descriptors go over it
        self.conn = Connection(os.dup(ours.fileno()))  # and messages
        self.ready = False
        self.vocabs: set[str] = set()
        self.deadline: float | None = time.monotonic() + START_TIMEOUT_S

    def fork(self, job_read: int, reply_write: int) -> None:
        self.conn.send(("fork",))
        socket.send_fds(self.sock, [b"f"], [job_read, reply_write])

    def add_vocab(self, vocab: Vocab) -> None:
        self.conn.send(("vocab", vocab.id, vocab.json))
        self.vocabs.add(vocab.id)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()
        self.sock.close()


class Worker:
    """A worker forked from ``zygote``: its pipes, and its pid once it says it is ready."""

    def __init__(self, zygote: Zygote):
        to_worker, from_worker = os.pipe(), os.pipe()
        try:
            zygote.fork(to_worker[0], from_worker[1])
        except OSError:
            for fd in (*to_worker, *from_worker):
                os.close(fd)
            raise
        os.close(to_worker[0])
        os.close(from_worker[1])
        self.send = Connection(to_worker[1], readable=False)
        self.recv = Connection(from_worker[0], writable=False)
        self.pid: int | None = None
        self.vocabs = set(zygote.vocabs)  # (the zygote reads its messages in order)
        self.job: CompileJob | None = None
        self.deadline: float | None = time.monotonic() + FORK_TIMEOUT_S

    @property
    def ready(self) -> bool:
        return self.pid is not None

    def kill(self) -> None:
        if self.pid is not None:  # (one not yet started ends when it reads its closed pipe)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.send.close()
        self.recv.close()


def _die_with_parent() -> None:
    """Linux: this process is killed when the thread that started it ends (the engine's
    process is gone, for the zygote; the zygote, for a worker), even in a compile."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
