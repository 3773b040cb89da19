"""What every HTTP request passes before the app sees it (one ASGI middleware), and the HTTP
protocol's header timeout.

In order: the ``Host`` (and ``Origin``) must be an allowed host (a loopback server allows
only loopback names, so a DNS-rebinding page gets a 400); ``/v1`` routes, ``/tokenize`` and
``/detokenize`` need the API key when one is set (``/health``, ``/metrics`` and ``/version``
stay open, as in vLLM, which leaves its tokenizer routes open too); the body must fit
``max_request_bytes`` (413, before anything parses it) and arrive within
``body_timeout`` seconds (408).  The body is read here and handed on whole.

Half-sent headers never reach an ASGI app: :func:`timed_protocol` closes a connection whose
request headers are not complete ``header_timeout`` seconds after it opened (or after its
last response), so slow clients cannot hold connections, and file descriptors, forever.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import time
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The hosts a server bound to ``bind_host`` answers by default: loopback names when it
    is bound to a loopback address, else any (None)."""
    return sorted({*LOOPBACK_NAMES, bind_host}) if is_loopback(bind_host) else None


def _hostname(authority: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


def error_body(message: str, type: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


async def send_error(send, status: int, message: str, type: str, code: str | None = None,
                     close: bool = False) -> None:
    body = error_body(message, type, code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the request was never read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# the routes that need the API key: every one that runs the model or its tokenizer
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")


class RequestGuard:
    """ASGI middleware: host allow-list, API key, body size and body read time."""

    def __init__(self, app, *, max_request_bytes: int, body_timeout: float,
                 api_key: str | None = None, allowed_hosts: list[str] | None = None):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.allowed_hosts = (None if allowed_hosts is None or "*" in allowed_hosts
                              else {h.lower().strip("[]") for h in allowed_hosts})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), value)
        if self.allowed_hosts is not None:
            for name in (b"host", b"origin"):
                value = headers.get(name)
                if value is None:
                    continue
                text = value.decode("latin-1")
                host = _hostname(text if name == b"host" else urlsplit(text).netloc)
                if host not in self.allowed_hosts:
                    return await send_error(send, 400, f"{name.decode()} {text!r} is not an "
                                            "allowed host of this server (--allowed-hosts)",
                                            "invalid_request_error", close=True)
        if (self._expected is not None and scope["path"].startswith(KEYED_PATHS)
                and scope["method"] != "OPTIONS"):
            given = headers.get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                return await send_error(send, 401, "Incorrect API key provided: pass it as "
                                        "'Authorization: Bearer <key>'",
                                        "invalid_request_error", "invalid_api_key", close=True)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            return await self._too_large(send)
        body, error = await self._read_body(receive)
        if error is not None:
            return await error(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect is left

        await self.app(scope, replay, send)

    async def _read_body(self, receive):
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return None, self._timed_out
            if message["type"] == "http.disconnect":
                return None, _nothing
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None, self._too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _too_large(self, send):
        await send_error(send, 413, f"the request body is larger than this server's limit of "
                         f"{self.max_request_bytes} bytes (--max-request-bytes)",
                         "invalid_request_error", "request_too_large", close=True)

    async def _timed_out(self, send):
        await send_error(send, 408, f"the request body did not arrive within "
                         f"{self.body_timeout:g} s", "invalid_request_error", "timeout",
                         close=True)


async def _nothing(send) -> None:  # the client went away: nobody to answer
    return None


def timed_protocol(base: type, header_timeout: float) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that closes a connection whose
    request headers are not complete ``header_timeout`` seconds after it opened or after its
    last response (slowloris)."""

    class TimedProtocol(base):
        _header_timer = None

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            # a request whose headers are complete has a cycle whose response is pending
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

    TimedProtocol.__name__ = f"Timed{base.__name__}"
    return TimedProtocol
