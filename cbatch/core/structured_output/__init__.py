"""Structured outputs: a request's constraint enforced token by token with xgrammar.

A :class:`~cbatch.sampling_params.StructuredOutputsParams` (a JSON schema, any JSON object, a
regex, a choice of strings, an EBNF grammar) goes through three stages:

1. **parsed** into an xgrammar ``Grammar`` and 2. **compiled** against the engine's vocabulary
   (the token masks of the grammar's states), both in a worker process: :mod:`.grammar` says
   what they are, :mod:`.worker` is the process, :mod:`.pool` a bounded pool of them whose
   compiles can be stopped.  Each compile has a time budget (``grammar_compile_timeout``)
   and a size budget (``max_grammar_bytes``); past either, or when the constraint does not
   parse or can match no output at all (``root ::= root``), the request is refused with a
   :class:`ConstraintError` naming the field.  A compile whose requests are all aborted is
   stopped (its worker killed).  :class:`StructuredOutputs` (:mod:`.manager`) keeps
   compiled grammars by their text, least recently used dropped first, within
   ``grammar_cache_bytes``.  ``Engine.validate_request`` parses a new constraint in the
   caller's thread (an invalid one is a ValueError before anything is queued); the
   server's :class:`~cbatch.core.async_engine.AsyncEngine` awaits the compile before it
   admits a request, so that a refusal is a 400 and the engine's thread never parses.  A
   request whose grammar is still compiling waits outside the scheduler: no step waits for
   it.
3. **matched** (:mod:`.matcher`): each sequence has its own ``GrammarMatcher``
   (:class:`SequenceGrammar`), advanced by every token the engine reads
   (``Engine._resolve``).  Each step, the rows of the sequences with a grammar get the
   matcher's token bitmask (:func:`bitmask`, filled by ``ModelRunner.execute`` into
   ``SamplingBatch.bitmask``), and the sampler sets every token the grammar forbids to -inf
   (:func:`cbatch.ops.sampling.apply_bitmask`) before it samples.  A constraint with
   ``reasoning_end`` (a reasoning model's ``</think>``, which the server gives with
   ``--reasoning-parser``) waits for it: until the output has written those ids, its
   matcher is not advanced (vLLM's rule) and its row allows every token but the stop
   tokens (its output cannot end before its constraint has begun).

The matcher sees only sampled tokens, so its state follows a sequence through preemption
(recompute keeps the output tokens), prefix caching and chunked prefill unchanged.  A
sequence ends with reason "stop" as soon as its grammar is complete and nothing but an end
token may follow (no end token is sampled then), or when it samples an end token (EOS).
Where the grammar allows no token at all, or the request's other rules (allowed_token_ids,
bad_words, ...) forbid every token it allows, the request ends alone with reason "error"
and a :class:`ConstraintError`; one whose first token is already ruled out by
allowed_token_ids is refused when it is checked.

JSON is generated compact (``", "`` and ``": "`` between items, no other whitespace): every
output is still a JSON document that ``json.loads`` reads, and a model cannot run away in
whitespace, which a grammar allowing any whitespace lets random or weak models do.

xgrammar is imported on first use: an engine that never sees a constraint never loads it.
"""

from __future__ import annotations

import importlib

# the names the engine and the server use, imported on first use: the worker process
# (python -m cbatch.core.structured_output.worker) loads this package, and no more of it
_EXPORTS = {
    "StructuredOutputs": "manager",
    "ConstraintError": "matcher",
    "SequenceGrammar": "matcher",
    "bitmask": "matcher",
    "Refused": "grammar",
    "WorkersBusy": "jobs",
    "prestart": "pool",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
