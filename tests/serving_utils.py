"""A real cbatch server on 127.0.0.1 for tests: uvicorn on a free port in a background thread,
stopped (and its engine shut down) when the ``with`` block ends."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no healthy server at {base_url} within {timeout} s")


@contextlib.contextmanager
def running_server(model: str = "random:tiny", name: str = "tiny", max_waiting: int = 1024,
                   app_kwargs: dict | None = None, server_kwargs: dict | None = None,
                   sndbuf: int | None = None, **engine_kwargs):
    """Yields (base_url, AsyncEngine).  ``app_kwargs`` go to ``build_app`` (limits, API key,
    allowed hosts), ``server_kwargs`` to ``uvicorn_config`` (timeouts).  ``sndbuf``: the
    kernel's send buffer of each connection, in bytes (a small one fills after little: the
    kernel otherwise buffers megabytes for a client that reads nothing)."""
    import uvicorn

    from cbatch.entrypoints.openai.api_server import build_app, build_engine
    from cbatch.entrypoints.openai.uvicorn_server import uvicorn_config

    engine, metrics = build_engine(model, max_waiting, name, **engine_kwargs)
    app = build_app(engine, metrics, name, **(app_kwargs or {}))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning",
                                           **(server_kwargs or {})))
    sockets = None
    if sndbuf is not None:  # accepted connections inherit the listening socket's buffer
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(("127.0.0.1", port))
        sockets = [sock]
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=sockets), daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url)
        yield base_url, engine
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop within 60 s"
