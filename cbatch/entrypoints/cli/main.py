"""The ``cbatch`` command line: ``cbatch demo``, ``cbatch generate`` and ``cbatch serve``.

One module per command, each with an ``add_<command>_parser`` and the ``run_<command>``
function it calls.  Parsing imports neither torch nor the engine, so ``cbatch --help`` and
argument errors answer at once; each ``run_*`` imports what it needs.  Errors are one line,
``cbatch: error: <message>`` (exit 2); ``--debug`` or ``CBATCH_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from cbatch.entrypoints.cli.demo import add_demo_parser
from cbatch.entrypoints.cli.engine_args import model_parser
from cbatch.entrypoints.cli.generate import add_generate_parser
from cbatch.entrypoints.cli.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbatch", description="Continuous-batching inference for GPT-2-family models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = model_parser()
    add_demo_parser(sub, [model])
    add_generate_parser(sub, [model])
    add_serve_parser(sub, [model])
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cbatch: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("CBATCH_DEBUG", "") not in ("", "0")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            args.run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\ncbatch: interrupted", file=sys.stderr)
        sys.exit(130)
    except (ValueError, TypeError, FileNotFoundError) as e:  # what the user asked for
        if debug:
            raise
        print(f"cbatch: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if debug:
            raise
        print(f"cbatch: error: {type(e).__name__}: {e} (--debug shows the traceback)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
