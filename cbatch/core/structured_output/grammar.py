"""What a constraint's text becomes: a constraint (``kind``, ``value``: a JSON schema,
``json_object``, a regex, a choice of strings, an EBNF grammar) is **parsed** into an
xgrammar ``Grammar`` (:func:`parse_grammar`), then **compiled** against a vocabulary
(:func:`compile_grammar`: the token masks of the grammar's states).  Both run in C++ and
neither can be interrupted, so the engine runs them in worker processes
(:mod:`~cbatch.core.structured_output.worker`, :mod:`~cbatch.core.structured_output.pool`).

:class:`Refused` is a constraint's own fault: its ``problem`` completes a sentence that
begins with the constraint's field ("is not a valid JSON schema: ..."), which the caller
names, as the client sent it.

This module imports nothing of cbatch, and xgrammar only when it is used (:func:`xgrammar`).
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


def xgrammar():
    """The xgrammar module, imported on first use (an ImportError saying how to install it)."""
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
    xgr = xgrammar()
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
    xgr = xgrammar()
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


def trim_memory() -> None:
    """Give the memory a large compile freed back to the system (glibc keeps it otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
