"""What a constraint's text becomes, and the worker process that makes it.

A constraint (``kind``, ``value``: a JSON schema, ``json_object``, a regex, a choice of
strings, an EBNF grammar) is **parsed** into an xgrammar ``Grammar`` (:func:`parse_grammar`),
then **compiled** against the engine's vocabulary (:func:`compile_grammar`: the token masks
of the grammar's states).  Both run in C++ and neither can be interrupted, so a thread that
runs them can only be waited out.  They run in worker processes instead
(:class:`cbatch.core.grammar_pool.CompilePool`), one job at a time each, and a worker whose
job runs past its time budget, or whose requests have all gone, is killed and replaced.

The worker is ``python -m cbatch.core.grammar_worker``: this module imports nothing of cbatch
but itself, and xgrammar only when it runs.  It speaks pickled tuples over its stdin and a copy
of its stdout (its stdout proper is sent to stderr, so that nothing printed corrupts the pipe):

    <- ("ready",)                                          once, when xgrammar is loaded
    -> ("vocab", vocab_id, tokenizer_info_json)           a vocabulary for later jobs
    -> ("compile", vocab_id, kind, value, max_bytes)
    <- ("ok", compiled_grammar_json) | ("error", problem)
    -> ("parse", [(kind, value), ...])
    <- ("ok", None) | ("error", (index, problem))          the first that does not parse

A ``problem`` completes a sentence that begins with the constraint's field ("is not a valid
JSON schema: ..."): the parent names the field, as the client sent it.
"""

from __future__ import annotations

import json
import re

_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
         "choice": "choice", "json_object": "JSON object"}


class Refused(Exception):
    """A constraint that cannot be used: ``problem`` says why (see the module)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


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


def parse_grammar(kind: str, value):
    """The xgrammar ``Grammar`` of a constraint; :class:`Refused` saying what is wrong with
    it (a schema that is not JSON, a keyword xgrammar does not support, a regex or a grammar
    that does not parse)."""
    xgr = _xgrammar()
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise Refused(f"is not a valid JSON schema: a schema is a JSON object, got "
                              f"{type(schema).__name__}")
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        elif kind == "json_object":  # any object: additional properties allowed
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                   strict_mode=False)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(value)
        elif kind == "choice":
            grammar = xgr.Grammar.from_ebnf(_choice_ebnf(value))
        else:
            grammar = xgr.Grammar.from_ebnf(value)
    except Refused:
        raise
    except json.JSONDecodeError as exc:
        raise Refused(f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise Refused(f"is not a valid {_WHAT[kind]}: it is nested too deeply") from None
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) for these
        raise Refused(f"is not a valid {_WHAT[kind]}: {_reason(exc)}") from None
    return _closed_holes(xgr, grammar)


def compile_grammar(compiler, kind: str, value, max_bytes: int):
    """The ``CompiledGrammar`` of a constraint against ``compiler``'s vocabulary;
    :class:`Refused` when it does not parse, takes more than ``max_bytes`` of memory, or
    can match no output at all (``root ::= root``, a schema that is its own only property):
    then no first token is allowed."""
    xgr = _xgrammar()
    compiled = compiler.compile_grammar(parse_grammar(kind, value))
    size = compiled.memory_size_bytes
    if size > max_bytes:
        raise Refused(f"compiles to {size / 2**20:.1f} MiB of token masks, more than this "
                      f"engine's limit of {max_bytes / 2**20:.1f} MiB (max_grammar_bytes); "
                      "give a smaller constraint")
    first = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first)
    if not bool(first.any()):
        raise Refused("matches no output at all: no token can begin one (is a rule defined "
                      "only by itself, or a schema its own required property?)")
    return compiled


def main() -> None:
    """The worker's loop (see the module): one job at a time, until its stdin closes."""
    import os
    import sys
    from multiprocessing.connection import Connection

    _die_with_parent()
    out = os.dup(1)
    os.dup2(2, 1)  # print() and C++ writes to stdout go to stderr, not into the pipe
    sys.stdout = sys.stderr
    reader, writer = Connection(0, writable=False), Connection(out, readable=False)
    xgr = _xgrammar()
    compilers = {}  # vocab id -> GrammarCompiler
    writer.send(("ready",))
    while True:
        try:
            message = reader.recv()
        except EOFError:  # the engine's process is gone, or let this worker go
            return
        op, args = message[0], message[1:]
        if op == "vocab":
            vocab_id, info_json = args
            info = xgr.TokenizerInfo.deserialize_json(info_json)
            # one thread: the pool's size is the number of cores compiles take; the engine
            # caches compiled grammars itself
            compilers[vocab_id] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
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
        _trim()


def _die_with_parent() -> None:
    """Linux: this process is killed when the thread that started it ends (the engine's
    process is gone), even in the middle of a compile."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _trim() -> None:
    """Give the memory a large compile freed back to the system (glibc keeps it otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
