"""An engine's grammars (the compiled stage of :mod:`cbatch.core.structured_output`):
:class:`StructuredOutputs` checks a request's constraint, has it compiled by the process's
pool of grammar workers, keeps compiled grammars by their text within
``grammar_cache_bytes``, and holds the requests whose grammar is still compiling."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import importlib.util
import json
import threading
from typing import TYPE_CHECKING

from cbatch.core.structured_output.grammar import Refused, parse_grammar, xgrammar
from cbatch.core.structured_output.matcher import (CompiledConstraint, ConstraintError,
                                                  SequenceGrammar, check_request, field_of)
from cbatch.core.structured_output.jobs import CompileJob, Vocab
from cbatch.core.structured_output.pool import shared_pool

from cbatch.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from cbatch.config import EngineConfig
    from cbatch.core.sequence import Sequence
    from cbatch.tokenizer import Tokenizer


# How deep lists and objects may nest in a constraint given as data (a JSON schema as a dict,
# a choice): deeper ones are refused before anything walks them recursively (their JSON
# text, pickling: Python's recursion stops near a thousand levels); a schema's grammar grows
# with the square of its depth
MAX_CONSTRAINT_DEPTH = 512


def nesting_depth(value) -> int:
    """How deep lists and dicts nest in ``value`` (0: neither is), found without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            depth = max(depth, level)
            stack.extend((child, level + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return depth


def constraint_text(params: StructuredOutputsParams, sort_keys: bool = True) -> str:
    """A constraint's text: its value as given, a schema dict as JSON (its keys sorted, for a
    key; in their order, for a compile: a schema's properties are written in it), a choice
    as its JSON list ("" for json_object); a :class:`ConstraintError` for one nested deeper
    than :data:`MAX_CONSTRAINT_DEPTH`."""
    value = getattr(params, params.kind)
    if params.kind == "json_object":
        return ""
    if isinstance(value, str):
        return value
    depth = nesting_depth(value)
    if depth > MAX_CONSTRAINT_DEPTH:
        raise ConstraintError(field_of(params), f"nests lists and objects {depth} deep; this "
                              f"server takes at most {MAX_CONSTRAINT_DEPTH}")
    try:
        return json.dumps(value, sort_keys=sort_keys)
    except RecursionError:  # (a caller deep in its own stack)
        raise ConstraintError(field_of(params), "is nested too deeply") from None


def _job_value(params: StructuredOutputsParams):
    """What a worker gets of a constraint: a JSON schema as its text (flat to pickle)."""
    if params.kind == "json":
        return constraint_text(params, sort_keys=False)
    return getattr(params, params.kind)


def constraint_key(params: StructuredOutputsParams) -> str:
    """What a constraint is cached by: a digest of its kind and its text."""
    if params.kind == "json_object":
        return params.kind
    text = f"{params.kind}:{constraint_text(params)}"
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the engine's vocabulary: ``vocab_size`` ids (the logits' width),
    the ids past the tokenizer's vocabulary never allowed.  The byte-level tokenizer of a
    ``random:`` model: ids 0-255 are their bytes, every other id a special token (never
    allowed, but the stop tokens at the grammar's end)."""
    from cbatch.tokenizer import ByteTokenizer

    xgr = xgrammar()
    if isinstance(tokenizer, ByteTokenizer):
        vocab = [bytes([b]) for b in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids or None)


class _Compile:
    """A constraint being compiled (or compiled, while requests still hold it): its job,
    and the future of its :class:`CompiledConstraint` (or :class:`ConstraintError`)."""

    def __init__(self, key: str, job: CompileJob | None):
        self.key, self.job = key, job
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.num_holders = 0


class Ticket:
    """A hold on a constraint's compile (:meth:`StructuredOutputs.compile`): ``future`` has
    its :class:`CompiledConstraint`; :meth:`StructuredOutputs.release` lets go."""

    def __init__(self, compile_: _Compile):
        self._compile = compile_
        self.future = compile_.future
        self.released = False


class StructuredOutputs:
    """An engine's grammars: checks constraints, has them compiled by the process's
    :class:`~cbatch.core.structured_output.pool.CompilePool` (cached by their text, within
    ``config.grammar_cache_bytes``), and holds the requests whose grammar is still
    compiling.

    ``tokenizer`` and ``vocab_size`` (the logits' width) are the engine's; ``eos_token_id``
    the model's end token(s), which end a grammar.  Safe to use from any thread.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_id: int | tuple[int, ...] | None, config: EngineConfig):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(eos_token_id if isinstance(eos_token_id, tuple)
                                   else () if eos_token_id is None else (eos_token_id,))
        self.timeout = config.grammar_compile_timeout
        self.max_bytes = config.max_grammar_bytes
        self.cache_bytes = config.grammar_cache_bytes
        self.num_workers = config.grammar_compile_workers
        self._lock = threading.Lock()
        self._vocab = Vocab(lambda: tokenizer_info(tokenizer, vocab_size, self.stop_token_ids))
        self._compiles: dict[str, _Compile] = {}  # compiling, or held
        self._cache: collections.OrderedDict[str, CompiledConstraint] = (
            collections.OrderedDict())
        self._cached_bytes = 0
        self.held: list[tuple[Sequence, Ticket]] = []  # still compiling

    @property
    def pool(self):
        return shared_pool(self.num_workers)

    def warm_up(self) -> bool:
        """Start the process's grammar workers now, with this engine's vocabulary loaded in
        them (a server's start-up: its first constraint then waits for no process to start
        and no vocabulary to load); whether it did (not without xgrammar)."""
        if importlib.util.find_spec("xgrammar") is None:
            return False
        self.pool.start(self._vocab)
        return True

    def check(self, params: SamplingParams) -> None:
        """Check a request's constraint: parse a new one here (:class:`ConstraintError` if it
        is invalid) and start compiling it; a compiled one is checked against the request's
        other rules (:func:`check_request`).  The caller's thread parses: the server's
        requests come compiled already."""
        constraint = params.structured_outputs
        bad = [t for t in constraint.reasoning_end or () if t >= self.vocab_size]
        if bad:  # (it could never be written: the constraint would never apply)
            raise ValueError(f"structured_outputs.reasoning_end has token ids outside the "
                             f"vocabulary [0, {self.vocab_size}): {bad[:5]}")
        key = constraint_key(constraint)
        with self._lock:
            known = self._compiles.get(key)
            done = (known.future if known is not None else None)
            cached = self._cache.get(key)
        if cached is None and done is not None and done.done() and done.exception() is None:
            cached = done.result()
        if cached is not None:
            return check_request(cached, params)
        if known is not None:
            if done.done():
                raise done.exception()
            return  # checked when it is compiled (ready())
        try:
            parse_grammar(constraint.kind, getattr(constraint, constraint.kind))
        except Refused as exc:
            raise ConstraintError(field_of(constraint), exc.problem) from None
        with self._lock:
            if key not in self._compiles and key not in self._cache:
                self._start(key, constraint)

    def compile(self, constraint: StructuredOutputsParams) -> Ticket:
        """A hold on ``constraint``'s compile, started unless it is cached or under way
        (parsed in the worker: a bad one fails the ticket's future with a
        :class:`ConstraintError`); a compile whose holders all :meth:`release` it before it
        ends is stopped."""
        key = constraint_key(constraint)
        with self._lock:
            entry = self._compiles.get(key)
            if entry is None:
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    entry = _Compile(key, None)
                    entry.future.set_result(cached)
                    return Ticket(entry)
                entry = self._start(key, constraint)
            entry.num_holders += 1
            return Ticket(entry)

    def release(self, ticket: Ticket) -> None:
        """Let go of a :meth:`compile` hold (again: nothing)."""
        entry = ticket._compile
        with self._lock:
            if ticket.released or entry.job is None:
                ticket.released = True
                return
            ticket.released = True
            entry.num_holders -= 1
            if entry.num_holders > 0:
                return
            if self._compiles.get(entry.key) is entry:
                del self._compiles[entry.key]
            cancel = not entry.future.done()
        if cancel:  # nobody waits for it: its worker is stopped
            self.pool.cancel(entry.job)
            _end(entry.future, error=concurrent.futures.CancelledError())

    def first_invalid(self, constraints: list[StructuredOutputsParams]
                      ) -> concurrent.futures.Future:
        """Parse ``constraints`` in a grammar worker (none is compiled): the future's
        result is None when all of them parse, else it fails with the
        :class:`~cbatch.core.structured_output.grammar.Refused` of the first that does not, whose
        ``index`` says which."""
        job = CompileJob("parse", ([(c.kind, _job_value(c)) for c in constraints],),
                         None, self.timeout, sum(len(constraint_text(c)) for c in constraints))
        self.pool.submit(job)
        return job.future

    def _start(self, key: str, constraint: StructuredOutputsParams) -> _Compile:
        """(Under the lock.)  Queue ``constraint``'s compile."""
        job = CompileJob("compile", (constraint.kind, _job_value(constraint), self.max_bytes),
                         self._vocab, self.timeout, len(constraint_text(constraint)))
        entry = self._compiles[key] = _Compile(key, job)
        field = field_of(constraint)
        job.future.add_done_callback(lambda f: self._compiled(entry, f, field))
        self.pool.submit(job)
        return entry

    def _compiled(self, entry: _Compile, job_future, field: str) -> None:
        """(On the pool's thread.)  A compile ended: its result cached, its future set."""
        error = job_future.exception()
        if isinstance(error, concurrent.futures.CancelledError):
            return _end(entry.future, error=error)
        if isinstance(error, Refused):
            return _end(entry.future, error=ConstraintError(field, error.problem))
        if error is not None:
            return _end(entry.future, error=error)
        grammar = job_future.result()
        try:
            first = xgrammar().allocate_token_bitmask(1, self.vocab_size)
            xgrammar().GrammarMatcher(grammar).fill_next_token_bitmask(first)
        except Exception as exc:
            return _end(entry.future, error=exc)
        result = CompiledConstraint(grammar, grammar.memory_size_bytes + first.numel() * 4,
                                    first)
        with self._lock:
            if result.num_bytes <= self.cache_bytes:
                self._cache[entry.key] = result
                self._cached_bytes += result.num_bytes
                while self._cached_bytes > self.cache_bytes:
                    self._cached_bytes -= self._cache.popitem(last=False)[1].num_bytes
            if entry.num_holders == 0 and self._compiles.get(entry.key) is entry:
                del self._compiles[entry.key]
        _end(entry.future, result)

    def hold(self, seq: Sequence) -> None:
        """Keep ``seq`` until its grammar is compiled (:meth:`ready` releases it)."""
        self.held.append((seq, self.compile(seq.params.structured_outputs)))

    def remove(self, seq: Sequence) -> None:
        """Forget a held sequence (aborted before its grammar was ready): a compile that no
        other request waits for is stopped."""
        for s, ticket in self.held:
            if s is seq:
                self.release(ticket)
        self.held = [(s, t) for s, t in self.held if s is not seq]

    def ready(self) -> list[tuple[Sequence, Exception | None]]:
        """The held sequences whose grammar is ready, each with its matcher
        (``seq.grammar``) and None, or with the error that its grammar's compilation
        raised or :func:`check_request` found; they are no longer held."""
        done, self.held = ([h for h in self.held if h[1].future.done()],
                           [h for h in self.held if not h[1].future.done()])
        out = []
        for seq, ticket in done:
            self.release(ticket)
            error = ticket.future.exception()
            if error is None:
                try:
                    check_request(ticket.future.result(), seq.params)
                    constraint = seq.params.structured_outputs
                    seq.grammar = SequenceGrammar(ticket.future.result(), self.vocab_size,
                                                  self.stop_token_ids, field_of(constraint),
                                                  constraint.reasoning_end)
                except ValueError as exc:
                    error = exc
            out.append((seq, error))
        return out

    def wait(self, timeout: float) -> None:
        """Block until a held sequence's grammar is ready, at most ``timeout`` seconds (an
        engine with nothing else to run)."""
        if self.held:
            concurrent.futures.wait([t.future for _, t in self.held], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def cached_bytes(self) -> int:
        """The bytes of the compiled grammars kept for reuse."""
        return self._cached_bytes


def _end(future: concurrent.futures.Future, result=None, error=None) -> None:
    try:  # (a release on another thread may have ended it first)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
