"""Structured outputs: a request's constraint enforced token by token with xgrammar.

A :class:`~cbatch.sampling_params.StructuredOutputsParams` (a JSON schema, any JSON object, a
regex, a choice of strings, an EBNF grammar) goes through three stages:

1. **parsed** into an xgrammar ``Grammar`` when the request is checked
   (``Engine.validate_request``): an invalid schema, regex or grammar is a ValueError naming
   what is wrong, before anything is queued.  Parsing is cheap and needs no vocabulary.
2. **compiled** against the engine's vocabulary (the token masks of the grammar's states) in a
   worker thread, once per constraint text (:class:`StructuredOutputs` caches the result); the
   request waits outside the scheduler until its grammar is ready, so no step waits for it.
3. **matched**: each sequence has its own ``GrammarMatcher`` (:class:`SequenceGrammar`),
   advanced by every token the engine reads (``Engine._resolve``).  Each step, the rows of
   the sequences with a grammar get the matcher's token bitmask (:func:`bitmask`, filled by
   ``ModelRunner.execute`` into ``SamplingBatch.bitmask``), and the sampler sets every token
   the grammar forbids to -inf (:func:`cbatch.ops.sampling.apply_bitmask`) before it samples.

The matcher sees only sampled tokens, so its state follows a sequence through preemption
(recompute keeps the output tokens), prefix caching and chunked prefill unchanged.  A
sequence ends with reason "stop" as soon as its grammar is complete and nothing but an end
token may follow (no end token is sampled then), or when it samples an end token (EOS).

JSON is generated compact (``", "`` and ``": "`` between items, no other whitespace): every
output is still a JSON document that ``json.loads`` reads, and a model cannot run away in
whitespace, which a grammar allowing any whitespace lets random or weak models do.

xgrammar is imported on first use: an engine that never sees a constraint never loads it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import re
import threading
from typing import TYPE_CHECKING

import torch

from cbatch.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from cbatch.core.scheduler import ScheduledSequence
    from cbatch.core.sequence import Sequence
    from cbatch.tokenizer import Tokenizer

# compiled grammars kept (least recently used dropped first): a server sees a few schemas
# many times, and must not grow without bound when each request brings a new one
MAX_CACHED_GRAMMARS = 512


def constraint_key(params: StructuredOutputsParams) -> str:
    """The text a constraint is cached by: its kind and its text (a schema dict as sorted
    JSON, a choice as its JSON list)."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json_object":
        return kind
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return f"{kind}:{text}"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("structured outputs need xgrammar: pip install xgrammar (or "
                          "cbatch[structured])") from None
    return xgrammar


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip()).strip()


# Two holes in xgrammar 0.2's grammars, closed by rewriting a grammar's text once, when it is
# parsed:
# - a JSON string with minLength/maxLength is written as repeats of this class (xgrammar's
#   issue #800), which lets raw control characters in; JSON forbids them (json.loads refuses
#   the output);
# - every negated class ([^...]) admits the surrogate code points U+D800-U+DFFF, whose bytes
#   are not UTF-8: a model with byte tokens could write text that decodes to U+FFFDs.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'
_LITERAL_OR_NEGATED_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[\^')


def _closed_holes(xgr, grammar):
    """``grammar`` without the holes above (itself where it has none, or where xgrammar would
    not read the rewritten text: a constraint is never refused for them)."""
    text = str(grammar)
    fixed = _LITERAL_OR_NEGATED_CLASS.sub(
        lambda m: m.group(0) if m.group(0).startswith('"') else r"[^\ud800-\udfff",
        text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER))
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except Exception:
        return grammar


def _choice_ebnf(choices: list[str]) -> str:
    # a JSON string literal is an EBNF one too (the same escapes), non-ASCII kept as is
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(params: StructuredOutputsParams):
    """The xgrammar ``Grammar`` of a constraint; ValueError naming the field and what is wrong
    with it (a schema that is not JSON, a keyword xgrammar does not support, a regex or a
    grammar that does not parse)."""
    xgr = _xgrammar()
    kind = params.kind
    what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
            "choice": "choice", "json_object": "JSON object"}[kind]
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"a schema is a JSON object, got {type(schema).__name__}")
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        elif kind == "json_object":  # any object: additional properties allowed
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                   strict_mode=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(params.regex)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
        else:
            grammar = xgr.Grammar.from_ebnf(params.grammar)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) for these
        raise ValueError(f"structured_outputs.{kind} is not a valid {what}: "
                         f"{_reason(exc)}") from None
    return _closed_holes(xgr, grammar)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the engine's vocabulary: ``vocab_size`` ids (the logits' width),
    the ids past the tokenizer's vocabulary never allowed.  The byte-level tokenizer of a
    ``random:`` model: ids 0-255 are their bytes, every other id a special token (never
    allowed, but the stop tokens at the grammar's end)."""
    from cbatch.tokenizer import ByteTokenizer

    xgr = _xgrammar()
    if isinstance(tokenizer, ByteTokenizer):
        vocab = [bytes([b]) for b in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids or None)


class SequenceGrammar:
    """One sequence's place in its grammar: an xgrammar ``GrammarMatcher``."""

    def __init__(self, compiled, vocab_size: int, stop_token_ids: list[int]):
        xgr = _xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_words = -(-vocab_size // 32)  # int32 words of a bitmask row
        self._row = xgr.allocate_token_bitmask(1, vocab_size)  # [1, num_words]
        # every bit but the stop tokens': what may follow a complete grammar besides its end
        words = [-1] * self.num_words
        for t in stop_token_ids:
            bit = 1 << (t % 32)
            words[t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)
        self._not_stop = torch.tensor(words, dtype=torch.int32)

    def accept(self, token: int) -> bool:
        """Advance by the sequence's new token; whether the output is done: its grammar
        ended (a stop token), or is complete and allows nothing but a stop token next.
        ValueError if the grammar does not allow ``token`` (another rule masked every token
        it allowed)."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the request's structured_outputs "
                             "grammar (did another rule, min_tokens or bad_words, forbid "
                             "every token the grammar allowed?)")
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        self.matcher.fill_next_token_bitmask(self._row)
        return not bool((self._row[0] & self._not_stop).any())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[S, num_words]``)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputs:
    """An engine's grammars: checks constraints, compiles them off the step loop (cached by
    their text), and holds the requests whose grammar is still compiling.

    ``tokenizer`` and ``vocab_size`` (the logits' width) are the engine's; ``eos_token_id``
    the model's end token(s), which end a grammar.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_id: int | tuple[int, ...] | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(eos_token_id if isinstance(eos_token_id, tuple)
                                   else () if eos_token_id is None else (eos_token_id,))
        self._lock = threading.Lock()
        self._compiler = None  # made in the worker on first use (it reads the vocabulary)
        self._compiled: collections.OrderedDict[str, concurrent.futures.Future] = (
            collections.OrderedDict())
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.held: list[tuple[Sequence, concurrent.futures.Future]] = []  # still compiling

    def check(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Parse a constraint (ValueError if it is invalid) and start compiling it, unless it
        is cached; the future of its compiled grammar.  Safe from any thread."""
        key = constraint_key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
        grammar = parse_grammar(params)  # outside the lock: it may take a moment
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="cbatch-grammar")
                future = self._compiled[key] = self._pool.submit(self._compile, grammar)
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            return future

    def _compile(self, grammar):
        # (on the pool's one thread: the compiler is made once, there)
        if self._compiler is None:
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = _xgrammar().GrammarCompiler(
                info, max_threads=max(1, min(8, os.cpu_count() or 1)))
        return self._compiler.compile_grammar(grammar)

    def hold(self, seq: Sequence) -> None:
        """Keep ``seq`` until its grammar is compiled (:meth:`ready` releases it)."""
        self.held.append((seq, self.check(seq.params.structured_outputs)))

    def remove(self, seq: Sequence) -> None:
        """Forget a held sequence (aborted before its grammar was ready)."""
        self.held = [(s, f) for s, f in self.held if s is not seq]

    def ready(self) -> list[tuple[Sequence, Exception | None]]:
        """The held sequences whose grammar is ready, each with its matcher
        (``seq.grammar``) and None, or with the error that its grammar's compilation
        raised; they are no longer held."""
        done, self.held = ([h for h in self.held if h[1].done()],
                           [h for h in self.held if not h[1].done()])
        out = []
        for seq, future in done:
            error = future.exception()
            if error is None:
                seq.grammar = SequenceGrammar(future.result(), self.vocab_size,
                                              self.stop_token_ids)
            out.append((seq, error))
        return out

    def wait(self, timeout: float) -> None:
        """Block until a held sequence's grammar is ready, at most ``timeout`` seconds (an
        engine with nothing else to run)."""
        if self.held:
            concurrent.futures.wait([f for _, f in self.held], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)


def bitmask(scheduled: list[ScheduledSequence]) -> torch.Tensor | None:
    """The step's token bitmask: int32 ``[S, ceil(vocab / 32)]`` on the CPU, row s the tokens
    sequence s may sample next (all ones for rows without a grammar or that do not sample);
    None when no row has a grammar."""
    rows = [(s, item.seq.grammar) for s, item in enumerate(scheduled)
            if item.seq.grammar is not None and item.samples]
    if not rows:
        return None
    out = torch.full((len(scheduled), rows[0][1].num_words), -1, dtype=torch.int32)
    for s, grammar in rows:
        grammar.fill(out, s)
    return out
