"""The engine for asyncio callers: one background thread runs ``Engine.step()`` in a loop, and
every request is an async iterator of its outputs.

Callers (coroutines on any event loop) never touch the engine: they post commands (add,
abort) to a queue that the engine thread drains between steps, and the engine thread hands
each step's outputs to the callers' loops in one ``call_soon_threadsafe`` per loop.  So the
event loop never waits for a step, and the engine, its scheduler and each request's
detokenizer are only ever used from one thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from cbatch.config import DEFAULT_MODEL
from cbatch.core.engine import Engine
from cbatch.core.request_stream import RequestStream
from cbatch.core.stats import EngineStats
from cbatch.logger import init_logger
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams, check_prompt_logprob_entries
from cbatch.tokenizer import check_text_fits, tokenize_bad_words, truncate_prompt

logger = init_logger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the request was refused (retry later)."""


class EngineDeadError(RuntimeError):
    """The engine is shutting down or its loop failed; it takes no more requests."""


class AsyncEngine:
    """An :class:`~cbatch.Engine` stepped by a background thread.

    ``max_waiting`` bounds the requests admitted but not yet running: one more is refused
    with :class:`QueueFullError` instead of piling up.  ``on_finished(output)`` is called on
    the engine thread for every finished request (metrics).  Other keywords are those of
    :class:`cbatch.config.EngineConfig`.

    Faults, as in vLLM v1: an error that belongs to one request (its detokenization, stop
    strings, logprobs) ends that request alone, with ``finish_reason="error"``; an error of
    the step itself kills the loop: every caller gets :class:`EngineDeadError`, and
    ``on_dead(exc)`` is called on the engine thread (a server exits, so that its supervisor
    restarts it).

    >>> async def main():
    ...     engine = AsyncEngine("random:tiny", max_num_seqs=4)
    ...     async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
    ...         pass
    ...     engine.shutdown()
    ...     return out.finish_reason
    >>> asyncio.run(main())
    'length'
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, max_waiting: int = 1024,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[BaseException], None] | None = None, **engine_kwargs):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self.on_dead = on_dead
        self._commands: collections.deque = collections.deque()  # appended from any thread
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._deadline = float("inf")  # shutdown aborts what is still running after this
        self.error: BaseException | None = None  # what killed the engine loop, if it died
        # The engine is built on the thread that steps it, and every torch call of the engine
        # runs there: OpenMP gives each thread that opens a parallel region a team of its own,
        # and with two teams on two cores its workers stop spinning between regions, which
        # slowed every step (benchmarks/NOTES.md, "Thread policy on a busy CPU").
        self.engine: Engine  # set by the engine thread before `ready`
        failed: list[BaseException] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._build_and_loop, name="cbatch-engine",
                                        args=(model, engine_kwargs, failed, ready), daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            raise failed[0]
        # what a server reads of the engine (never the engine itself), fixed once it is built
        e = self.engine
        self.tokenizer, self.config, self.max_model_len = e.tokenizer, e.config, e.max_model_len
        self.vocab_size, self.architecture = e.model.config.vocab_size, type(e.model).__name__

    # -------------------------------------------------------------- callers' side

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self.error is None

    def memory_report(self) -> str:
        """The KV pool's one line, for sequences of :attr:`max_model_len`."""
        return self.engine.worker.memory_report(self.max_model_len)

    def describe(self) -> dict[str, str]:
        """The fast paths this engine's runner takes (a CPU engine's; empty elsewhere)."""
        return self.engine.worker.describe()

    def warm_up_grammars(self, timeout: float) -> bool:
        """Start the grammar workers with this engine's vocabulary loaded in them
        (``StructuredOutputs.warm_up``) and wait for them, at most ``timeout`` seconds:
        whether they are ready (True without xgrammar: there are none to start)."""
        structured = self.engine.structured
        return not structured.warm_up() or structured.pool.wait_warm(timeout)

    def first_invalid(self, constraints: list) -> concurrent.futures.Future:
        """Which of ``constraints`` does not parse (``StructuredOutputs.first_invalid``)."""
        return self.engine.structured.first_invalid(constraints)

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          stream: bool = True) -> RequestStream:
        """Admit a request; returns its stream (``stream=False``: of its final output only).
        Raises what :meth:`Engine.add_request`
        raises for a bad request, :class:`QueueFullError` when the waiting queue is full and
        :class:`EngineDeadError` when the engine is not running."""
        request_ids = None if request_id is None else [request_id]
        return (await self.add_requests([prompt], [params], request_ids, priority, stream))[0]

    async def add_requests(self, prompts: list[str | list[int]],
                           params: list[SamplingParams | None],
                           request_ids: list[str] | None = None, priority: int = 0,
                           stream: bool = True) -> list[RequestStream]:
        """Admit several requests as one, all or none (a prompt list of one API call): they
        join the waiting queue together, or not at all when they do not all fit under
        ``max_waiting`` (:class:`QueueFullError`; a ValueError when they never could) or
        one of them is refused (what :meth:`Engine.add_request` raises, naming the prompt).
        One round trip to the engine thread whatever their number; cancelling the call
        (the client went away) aborts every one of them."""
        if len(prompts) != len(params):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if len(prompts) > self.max_waiting:
            raise ValueError(f"{len(prompts)} prompts (choices included) are more than this "
                             f"engine ever admits at once (max_waiting={self.max_waiting}); "
                             "send fewer per request")
        if not self.is_running:
            raise EngineDeadError("the engine is shut down" if self.error is None else
                                  f"the engine loop failed: {self.error!r}")
        request_ids = ([uuid.uuid4().hex for _ in prompts] if request_ids is None
                       else [str(r) for r in request_ids])
        # grammars are parsed and compiled in the grammar workers, and the requests admitted
        # once they are (a refused one raises its ConstraintError here); a call cancelled
        # meanwhile lets go of its compiles, which stop if no other request holds them
        structured = self.engine.structured
        tickets = []
        posted = False
        try:
            for constraint in {id(p.structured_outputs): p.structured_outputs for p in params
                               if p is not None and p.structured_outputs is not None}.values():
                tickets.append(structured.compile(constraint))
            if any(isinstance(p, str) for p in prompts) or any(
                    p is not None and p.bad_words for p in params):
                # tokenised here, in a worker: long prompts stall no step and no event loop,
                # and the bad words of a request's choices (one list) are tokenised once
                prompts, bad_words = await asyncio.to_thread(self._encode_all, prompts, params)
            else:
                bad_words = [None] * len(prompts)
            self._check_logprobs(prompts, params)
            for ticket in tickets:
                await asyncio.shield(asyncio.wrap_future(ticket.future))
            posted = True
            return await self._admit(prompts, params, bad_words, request_ids, priority, stream)
        finally:
            if posted:  # let go on the engine thread, once the requests hold their own
                self._post(("release", tickets))
            else:
                for ticket in tickets:
                    structured.release(ticket)

    async def _admit(self, prompts: list, params: list, bad_words: list,
                     request_ids: list[str], priority: int, stream: bool
                     ) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in prompts]
        self._post(("add", list(zip(request_ids, prompts, params, bad_words)), priority, stream,
                    loop, queues))
        try:
            admitted = await queues[0].get()  # None, or the reason they were refused
        except BaseException:  # cancelled while waiting: do not leave them running unheard
            for request_id in request_ids:
                self.abort(request_id)
            raise
        if admitted is not None:
            raise admitted
        return [RequestStream(self.abort, r, q) for r, q in zip(request_ids, queues)]

    def _encode_all(self, prompts: list, params: list[SamplingParams | None]
                    ) -> tuple[list, list]:
        """The prompts' token ids (strings encoded) and each request's bad words as token ids
        (None without any; one list for the choices that share their ``bad_words``)."""
        encoded, bad_words, by_list = [], [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                if isinstance(prompt, str) and (p is None or p.truncate_prompt_tokens is None):
                    check_text_fits(prompt, self.tokenizer, self.engine.max_model_len)
                encoded.append(self.tokenizer.encode(prompt) if isinstance(prompt, str)
                               else prompt)
            except ValueError as e:
                raise ValueError(f"{_which(i, len(prompts))}{e}") from None
            words = None if p is None or not p.bad_words else p.bad_words
            if words is not None and id(words) not in by_list:
                by_list[id(words)] = tokenize_bad_words(words, self.tokenizer)
            bad_words.append(None if words is None else by_list[id(words)])
        return encoded, bad_words

    def _check_logprobs(self, prompts: list, params: list[SamplingParams | None]) -> None:
        """Each request's logprobs as the engine checks them, then the prompt logprobs of
        them all together (every prompt and choice of one API call): a ValueError."""
        cfg, entries = self.engine.config, 0
        vocab_size = self.engine.model.config.vocab_size
        for ids, p in zip(prompts, params):
            if p is None or not isinstance(ids, list):
                continue
            kept = len(truncate_prompt(ids, self.engine.max_model_len, p.max_tokens,
                                       p.truncate_prompt_tokens))
            p.check_logprobs(kept, vocab_size, cfg.max_logprobs, cfg.max_prompt_logprobs)
            entries += p.prompt_logprob_entries(kept)
        check_prompt_logprob_entries(entries)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it runs; the last one is finished."""
        stream = await self.add_request(prompt, params, request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it has finished); its stream ends with an output of
        reason "abort"."""
        self._post(("abort", str(request_id)))

    def stop(self, timeout: float = 0.0) -> None:
        """Begin :meth:`shutdown` without waiting for it: refuse new requests now, abort the
        running ones ``timeout`` seconds from now (an earlier deadline stands)."""
        self._deadline = min(self._deadline, time.monotonic() + timeout)
        self._stopping = True
        self._wakeup.set()

    def shutdown(self, timeout: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to ``timeout`` seconds, abort
        the rest (their streams end with reason "abort"), and stop the engine thread.  Every
        KV block is free afterwards.  Blocks the calling thread: from a coroutine use
        ``await asyncio.to_thread(engine.shutdown, timeout)``."""
        self.stop(timeout)
        self._thread.join()
        if self.error is None:
            self.engine.block_manager.check_whole()

    def _post(self, command: tuple) -> None:
        self._commands.append(command)
        self._wakeup.set()

    # -------------------------------------------------------------- the engine thread

    def _build_and_loop(self, model: str, engine_kwargs: dict, failed: list,
                        ready: threading.Event) -> None:
        try:
            self.engine = Engine(model, **engine_kwargs)
            self.engine.kv_cache.touch()  # a server's first burst does not fault in its pool
            self.stats: EngineStats = self.engine.stats()  # a snapshot after the latest step
        except BaseException as exc:  # AsyncEngine() raises it
            failed.append(exc)
            ready.set()
            return
        ready.set()
        self._loop()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wakeup.clear()
                pending: dict = collections.defaultdict(list)
                self._handle_commands(pending)
                if self._stopping and time.monotonic() >= self._deadline:
                    for request_id in list(self._streams):  # every unfinished request
                        self._abort(request_id)
                if engine.has_unfinished_requests():
                    self._collect(engine.step(), pending)
                    self.stats = engine.stats()
                self._deliver(pending)
                if not engine.has_unfinished_requests() and not self._commands:
                    if self._stopping:
                        break
                    self._wakeup.wait()
        except BaseException as exc:  # the loop is dead: every caller must hear of it
            self.error = exc
            logger.critical("the engine loop failed; the engine takes no more requests",
                            exc_info=exc)
            pending = collections.defaultdict(list)
            for loop, queue in self._streams.values():
                pending[loop].append((queue, EngineDeadError(f"the engine loop failed: {exc!r}")))
            self._streams.clear()
            self._deliver(pending)
            if self.on_dead is not None:
                self.on_dead(exc)
            if not isinstance(exc, Exception):
                raise

    def _abort(self, request_id: str) -> None:
        """Abort a request the engine still runs; its stream stays until the engine reports
        the abort (the stream's last output)."""
        if request_id in self._streams:
            try:
                self.engine.abort(request_id)
            except KeyError:  # already ended; its last output is on its way
                pass

    def _handle_commands(self, pending: dict) -> None:
        engine = self.engine
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self._abort(command[1])
                continue
            if command[0] == "release":  # an add_requests call's hold on its compiles
                for ticket in command[1]:
                    engine.structured.release(ticket)
                continue
            _, requests, priority, stream, loop, queues = command
            added: list[str] = []
            try:
                if self._stopping:
                    raise EngineDeadError("the engine is shutting down")
                if len(engine.scheduler.waiting) + len(requests) > self.max_waiting:
                    raise QueueFullError(f"the waiting queue is full (max_waiting="
                                         f"{self.max_waiting}); retry later")
                for i, (request_id, prompt, params, bad_words) in enumerate(requests):
                    try:
                        engine.add_request(prompt, params, priority, request_id, stream,
                                           bad_words)
                    except (ValueError, TypeError) as e:  # (not type(e): its own arguments)
                        kind = ValueError if isinstance(e, ValueError) else TypeError
                        raise kind(f"{_which(i, len(requests))}{e}") from None
                    added.append(request_id)
            except Exception as exc:  # refused, all of them: the caller raises it
                for request_id in added:
                    engine.abort(request_id, report=False)
                pending[loop].append((queues[0], exc))
                continue
            for request_id, queue in zip(added, queues):
                self._streams[request_id] = (loop, queue)
            pending[loop].append((queues[0], None))

    def _collect(self, outputs: list[RequestOutput], pending: dict) -> None:
        for out in outputs:
            try:
                out.text  # decoded here, on the engine thread that owns the detokenizer
            except Exception as exc:  # this request's own fault: it alone ends
                out = self.engine.fail_output(out, exc)
            if out.finished and self.on_finished is not None:
                try:
                    self.on_finished(out)
                except Exception:
                    logger.exception("on_finished failed for request %s", out.request_id)
            target = (self._streams.pop if out.finished else self._streams.get)(out.request_id,
                                                                                 None)
            if target is not None:
                loop, queue = target
                pending[loop].append((queue, out))

    @staticmethod
    def _deliver(pending: dict) -> None:
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass


def _which(i: int, n: int) -> str:
    """The prefix that names prompt ``i`` of ``n`` in an error ("" for a single prompt)."""
    return f"prompt {i + 1} of {n}: " if n > 1 else ""


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)
