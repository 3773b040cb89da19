"""What every HTTP request passes before the app sees it (one ASGI middleware), and the HTTP
protocol's header and write timeouts.

In order: an HTTP/1.1 request must have a ``Host`` header, and the ``Host`` and ``Origin``
headers must be well formed (``host[:port]``; an Origin ``scheme://host[:port]`` or
``null``), else a 400, and the host an allowed one (a server bound to a loopback address
allows only loopback names, so a DNS-rebinding page gets a 400); ``/v1`` routes,
``/tokenize`` and ``/detokenize`` need the API key when one is set (``/health``,
``/metrics`` and ``/version`` stay open, as in vLLM, which leaves its tokenizer routes open
too); then the request waits for one of ``limit_concurrency`` slots (at most
``max_queued_requests`` wait, each at most ``queue_timeout`` seconds; a 503 beyond), and its
body must fit ``max_request_bytes`` (413, before anything parses it), arrive within
``body_timeout`` seconds (408) and hold at most :data:`MAX_BODY_VALUES` JSON values and
:data:`MAX_BODY_CONTAINERS` lists and objects (400: parsing and validating a body runs on the
event loop, so its cost is bounded here, before it starts).  The body is read here and
handed on whole.

Half-sent headers and unread responses never hold a connection: :func:`timed_protocol`
closes a connection whose request headers are not complete ``header_timeout`` seconds after
it opened (or after its last response), and one whose client has read nothing of a pending
response for ``write_timeout`` seconds, so slow clients cannot hold connections, slots and
file descriptors forever.
"""

from __future__ import annotations

import asyncio
import collections
import json
import secrets
import time

from cbatch.entrypoints.openai.hosts import check_allowed_hosts, parse_host, parse_origin

# A JSON body's cost to parse and validate grows with its values (list items, fields), not its
# bytes: this bound keeps it to tens of milliseconds on the event loop, where a 16 MiB body of
# small values would take seconds (benchmarks/NOTES.md, "What a request body costs the event
# loop").  A 128k-token prompt of token ids still fits.
MAX_BODY_VALUES = 1 << 17
MAX_BODY_CONTAINERS = 1 << 14  # lists and objects: the costliest values (prompts, messages)

def body_values(body: bytes) -> tuple[int, int]:
    """(values, containers) of a JSON body, counted from its separators without parsing it:
    values = the commas outside strings + the lists and objects, containers = the lists and
    objects, as the parse would make them (within one per list or object).  Fast
    (``bytes.count``): a few ms for 16 MiB."""
    containers = body.count(b"[") + body.count(b"{")
    values = body.count(b",") + containers
    if values <= MAX_BODY_VALUES and containers <= MAX_BODY_CONTAINERS:
        return values, containers
    # the quick count included what strings hold: count outside them (escapes dropped first)
    stripped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    num_strings = stripped.count(b'"') // 2  # each one a value or a field's name
    if num_strings > MAX_BODY_VALUES:
        return num_strings, containers
    outside = b"".join(stripped.split(b'"')[::2])
    containers = outside.count(b"[") + outside.count(b"{")
    return outside.count(b",") + containers, containers


def error_body(message: str, type: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None,
                                 "code": code}}).encode()


async def send_error(send, status: int, message: str, type: str, code: str | None = None,
                     close: bool = False, retry_after: bool = False) -> None:
    body = error_body(message, type, code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:  # the rest of the request was never read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    if retry_after:  # a 503 of load: worth retrying soon
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# the routes that need the API key: every one that runs the model or its tokenizer
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")


class ConcurrencyLimit:
    """At most ``limit`` requests at once; up to ``max_queued`` more wait for a slot, in order
    of arrival, each at most ``timeout`` seconds.  A burst is served in full, a flood beyond
    the queue is refused at once (and what waits too long is refused then), so the server's
    work and memory stay bounded."""

    def __init__(self, limit: int, max_queued: int, timeout: float):
        if limit < 1 or max_queued < 0 or not timeout > 0:
            raise ValueError(f"a concurrency limit needs limit >= 1, max_queued >= 0 and a "
                             f"timeout > 0, got {limit}, {max_queued}, {timeout}")
        self.limit, self.max_queued, self.timeout = limit, max_queued, timeout
        self.num_running = 0
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> str | None:
        """Take a slot (release it with :meth:`release`): None once taken, else why not."""
        if self.num_running < self.limit and not self._waiting:
            self.num_running += 1
            return None
        if len(self._waiting) >= self.max_queued:
            return (f"the server is at its limit of {self.limit} requests at once with "
                    f"{len(self._waiting)} more waiting (--limit-concurrency, "
                    "--max-queued-requests); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        timer = asyncio.get_running_loop().call_later(self.timeout, self._expire, waiter)
        try:
            if await waiter:  # handed a slot by release()
                return None
        except BaseException:  # cancelled: a slot handed over meanwhile goes on
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release()
            elif waiter in self._waiting:
                self._waiting.remove(waiter)
            raise
        finally:
            timer.cancel()
        return (f"no request slot came free within {self.timeout:g} s (--queue-timeout; "
                f"{self.limit} requests at once, --limit-concurrency); retry later")

    def release(self) -> None:
        """Give a slot back: to the first request waiting, else free."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self.num_running -= 1

    def _expire(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            self._waiting.remove(waiter)
            waiter.set_result(False)


# routes that any client may ask at any time, without a key and without a slot (probes)
OPEN_PATHS = ("/health", "/metrics")


class RequestGuard:
    """ASGI middleware: well-formed and allowed hosts, API key, a slot of the concurrency
    limit, body size, read time and number of values (in that order: the cheap refusals
    first, and no body is read before its request has a slot)."""

    def __init__(self, app, *, max_request_bytes: int, body_timeout: float,
                 api_key: str | None = None, allowed_hosts: list[str] | None = None,
                 limit: ConcurrencyLimit | None = None):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.allowed_hosts = None if allowed_hosts is None else check_allowed_hosts(
            list(allowed_hosts))
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.lower(), []).append(value)
        refusal = self._check_hosts(headers, scope.get("http_version"))
        if refusal is not None:
            return await send_error(send, 400, refusal, "invalid_request_error", close=True)
        if (self._expected is not None and scope["path"].startswith(KEYED_PATHS)
                and scope["method"] != "OPTIONS"):
            given = headers.get(b"authorization", [b""])[0]
            if not secrets.compare_digest(given, self._expected):
                return await send_error(send, 401, "Incorrect API key provided: pass it as "
                                        "'Authorization: Bearer <key>'",
                                        "invalid_request_error", "invalid_api_key", close=True)
        if self.limit is None or scope["path"] in OPEN_PATHS:
            return await self._read_and_run(scope, receive, send, headers)
        refusal = await self.limit.acquire()
        if refusal is not None:
            return await send_error(send, 503, refusal, "server_overloaded", close=True,
                                    retry_after=True)
        try:
            await self._read_and_run(scope, receive, send, headers)
        finally:
            self.limit.release()

    def _check_hosts(self, headers: dict[bytes, list[bytes]], http_version: str | None
                     ) -> str | None:
        """Why the Host and Origin headers are refused (missing from an HTTP/1.1 request,
        malformed, repeated, or not an allowed host), else None.  Checked here, whatever
        HTTP parser uvicorn runs (h11 refuses a missing Host itself, httptools does not)."""
        if b"host" not in headers and http_version == "1.1":
            return "an HTTP/1.1 request must have a Host header (RFC 9112, section 3.2)"
        for name, parse in ((b"host", parse_host), (b"origin", parse_origin)):
            values = headers.get(name)
            if values is None:
                continue
            text = values[0].decode("latin-1")
            if len(values) > 1:
                return f"{name.decode()} is given {len(values)} times; give it once"
            host = parse(text)
            if host is None:
                form = "host[:port]" if name == b"host" else "scheme://host[:port] or null"
                return f"{name.decode()} {text[:200]!r} is not of the form {form}"
            if self.allowed_hosts is not None and host not in self.allowed_hosts:
                return (f"{name.decode()} {text[:200]!r} is not an allowed host of this "
                        "server (--allowed-hosts)")
        return None

    async def _read_and_run(self, scope, receive, send, headers) -> None:
        length = headers.get(b"content-length", [b""])[0]
        if length.isdigit() and int(length) > self.max_request_bytes:
            return await self._too_large(send)
        body, error = await self._read_body(receive)
        if error is not None:
            return await error(send)
        values, containers = body_values(body)  # (microseconds for a small body)
        if values > MAX_BODY_VALUES or containers > MAX_BODY_CONTAINERS:
            return await send_error(
                send, 400, f"the request body holds about {values} JSON values, "
                f"{containers} of them lists or objects; this server takes at most "
                f"{MAX_BODY_VALUES} and {MAX_BODY_CONTAINERS}: split the request",
                "invalid_request_error", "request_too_large")
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


def timed_protocol(base: type, header_timeout: float, write_timeout: float = 30.0) -> type:
    """A subclass of uvicorn's HTTP protocol class ``base`` that closes a connection whose
    request headers are not complete ``header_timeout`` seconds after it opened or after its
    last response (slowloris), and one whose client reads nothing for ``write_timeout``
    seconds while the server has more to send (its write buffer stays full): the request
    then ends as a disconnect does, its engine requests aborted and its slot freed."""

    class TimedProtocol(base):
        _header_timer = None
        _write_timer = None

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            # a request whose headers are complete has a cycle whose response is pending
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def _write_late(self) -> None:
            self._write_timer = None
            self.transport.abort()  # close() would wait for the buffer the client never reads

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_late)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def connection_lost(self, exc) -> None:
            for timer in (self._header_timer, self._write_timer):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

    TimedProtocol.__name__ = f"Timed{base.__name__}"
    return TimedProtocol
