"""The grammar worker process: ``python -m cbatch.core.structured_output.worker``.

It parses and compiles constraints (:mod:`~cbatch.core.structured_output.grammar`), one job
at a time, for the pool (:class:`~cbatch.core.structured_output.pool.CompilePool`), which
kills it when its job runs past its time budget or nobody waits for it any more (xgrammar's
compile cannot be interrupted).  It imports nothing of cbatch but this package's grammar
module, and xgrammar.  It speaks pickled tuples over its stdin and a copy of its stdout (its
stdout proper is sent to stderr, so that nothing printed corrupts the pipe):

    <- ("ready",)                                          once, when xgrammar is loaded
    -> ("vocab", vocab_id, tokenizer_info_json)           a vocabulary for later jobs
    -> ("compile", vocab_id, kind, value, max_bytes)
    <- ("ok", compiled_grammar_json) | ("error", problem)
    -> ("parse", [(kind, value), ...])
    <- ("ok", None) | ("error", (index, problem))          the first that does not parse

A ``problem`` is :class:`~cbatch.core.structured_output.grammar.Refused`'s: the parent
names the field.
"""

from __future__ import annotations

from cbatch.core.structured_output.grammar import (Refused, compile_grammar, parse_grammar,
                                                  trim_memory, xgrammar)


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
    xgr = xgrammar()
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
        trim_memory()


def _die_with_parent() -> None:
    """Linux: this process is killed when the thread that started it ends (the engine's
    process is gone), even in the middle of a compile."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
