"""The ``cbatch`` command line: ``cbatch demo``, ``cbatch generate`` and ``cbatch serve``.

One module per command, each with an ``add_<command>_parser`` and the ``run_<command>``
function it calls.  Parsing imports neither torch nor the engine, so ``cbatch --help`` and
argument errors answer at once; each ``run_*`` imports what it needs.  Errors are one line,
``cbatch: error: <message>`` (exit 2); ``--debug`` or ``CBATCH_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from cbatch import envs
from cbatch.entrypoints.cli.demo import add_demo_parser
from cbatch.entrypoints.cli.engine_args import model_parser
from cbatch.entrypoints.cli.generate import add_generate_parser
from cbatch.entrypoints.cli.parser import CLIParser
from cbatch.entrypoints.cli.serve import add_serve_parser


def version_report() -> str:
    """What ``cbatch --version`` prints: cbatch's version and where it is installed, the torch
    and Python it runs on, each kernel backend (live here, or off and why), and the CPU fast
    paths live here (:func:`cbatch.core.cpu.report.cpu_paths`)."""
    import platform
    from pathlib import Path

    import torch

    import cbatch
    from cbatch import ops
    from cbatch.core.cpu.report import cpu_paths, format_paths

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    lines = [f"cbatch {cbatch.__version__} ({Path(cbatch.__file__).parent})",
             f"torch {torch.__version__} ({cuda}), Python {platform.python_version()}",
             "attention backends:"]
    for name, status in ops.available_backends().items():
        lines.append(f"  {name:<7} {'live' if status.available else 'off':<5} {status.detail}")
    lines += ["cpu fast paths:"] + format_paths(cpu_paths())
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_report` and exit (torch loads only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = CLIParser(
        prog="cbatch",
        description="Continuous-batching inference for GPT-2 and the Llama family.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the version, the torch it runs on, which attention "
                             "backends and CPU fast paths are live, and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = model_parser()
    add_demo_parser(sub, [model])
    add_generate_parser(sub, [model])
    add_serve_parser(sub, [model])
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cbatch: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `cbatch`: what it can do
        parser.print_help()
        sys.exit(2)
    args = parser.parse_args(argv)
    debug = args.debug or envs.CBATCH_DEBUG
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            args.run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\ncbatch: interrupted", file=sys.stderr)
        sys.exit(130)
    except ModuleNotFoundError as e:  # a missing extra: the message names what to install
        if debug:
            raise
        print(f"cbatch: error: {e}", file=sys.stderr)
        sys.exit(1)
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
