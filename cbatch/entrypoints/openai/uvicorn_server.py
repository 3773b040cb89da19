"""uvicorn as ``cbatch serve`` runs it: its settings (the HTTP protocol's header and write
timeouts, a bounded graceful shutdown), the open-files limit raised for its connections, and
a server class whose signals also shut the engine down (:func:`server_class`)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading

from fastapi import FastAPI

from cbatch.core.async_engine import AsyncEngine
from cbatch.entrypoints.openai.guard import timed_protocol
from cbatch.logger import init_logger

logger = init_logger("cbatch.server")


def uvicorn_config(app: FastAPI, host: str, port: int, shutdown_timeout: float = 0.0,
                   header_timeout: float = 10.0, write_timeout: float = 30.0,
                   log_level: str = "info"):
    """uvicorn's settings for ``app``: half-sent headers and unread responses time out, and
    a graceful shutdown that waits at most a second longer than the engine gives running
    requests.  (The concurrency limit is the app's own, :class:`RequestGuard`'s: uvicorn's
    would refuse every request, not the excess, with a 503 in plain text.)"""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # uvicorn's own choice without httptools
        base = H11Protocol
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=timed_protocol(base, header_timeout, write_timeout),
                          timeout_graceful_shutdown=math.ceil(shutdown_timeout) + 1)


def raise_open_files_limit() -> None:
    """Raise this process's limit of open files to its hard limit (as vLLM does): every
    connection, queued ones included, holds a file descriptor, and a common default of 1024
    is fewer than the concurrency limit and its queue."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft,
                           target, e)


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, whose first signal (SIGINT, SIGTERM, or SIGHUP as well: a
        closed terminal) also starts the engine's bounded shutdown and whose second exits at
        once; :meth:`engine_failed` makes it exit as well."""

        engine: AsyncEngine
        shutdown_timeout: float
        failed = False

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():  # SIGINT and SIGTERM
                hangup = None  # SIGHUP too, unless it is ignored (nohup): then it stays so
                if (hasattr(signal, "SIGHUP")
                        and threading.current_thread() is threading.main_thread()
                        and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN):
                    hangup = signal.signal(signal.SIGHUP, self.handle_exit)
                try:
                    yield
                finally:  # restored before uvicorn raises the signal again to exit by it
                    if hangup is not None:
                        signal.signal(signal.SIGHUP, hangup)

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                print(f"cbatch: signal {sig} again: exiting now", file=sys.stderr, flush=True)
                os._exit(128 + sig)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            # (here, not in the signal handler, which may interrupt the engine's own locks)
            self.engine.stop(self.shutdown_timeout)
            await super().shutdown(sockets)

        def engine_failed(self, exc: BaseException) -> None:
            logger.critical("the engine failed (%s: %s); the server exits so that its "
                            "supervisor can restart it", type(exc).__name__, exc)
            self.failed = True
            self.should_exit = True
            # should a graceful exit hang, the process still ends
            timer = threading.Timer(self.shutdown_timeout + 10, os._exit, (1,))
            timer.daemon = True
            timer.start()

    return Server
