"""Every environment variable cbatch reads, its default and what it does: the one list.

Python code reads them through this module alone (``from cbatch import envs;
envs.CBATCH_CPU_LINEAR``), each access reading the environment afresh, so a variable set in
a test or before a subprocess starts takes effect.  A value a variable does not take is
warned about once and its default used: a typo never stops an import or a server.  The C++
kernels read none: the extension's options are handed to it when it loads
(:mod:`cbatch.ops.compiled`).  ``setup.py`` loads this file by its path (it imports nothing
but the standard library), and the scripts read theirs as ``${NAME:-default}`` with the
defaults listed here (a test holds them to it).

``python -m cbatch.envs`` prints the table the README shows; ``--check`` fails on a value a
variable does not take.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # what an unset (or empty) variable means
    meaning: str  # one line
    choices: tuple[str, ...] | None = None  # the values it takes (None: any string)
    flag: bool = False  # a switch: 1/true/yes/on or 0/false/no/off
    when: str = "run"  # "run" (each use), "load" (when cbatch._C loads), "build", or a script
    secret: bool = False  # taken as it is: not stripped, a blank value stays blank
    upper: bool = False  # case-insensitive choices, given in upper case (logging levels)

    def parse(self, raw: str):
        """``raw`` as this variable's value: a bool for a flag, else a string (the default
        for ""); ValueError naming the variable for a value it does not take."""
        value = (raw if self.secret else raw.strip()) or self.default
        if self.upper:
            value = value.upper()
        if self.flag:
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name}={raw!r}: expected 1 or 0")
        if self.choices is not None and value and value not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(self.choices)}"
                             " (or unset)")
        return value

    def read(self):
        """The variable's value now.  A value it does not take never stops a program: it
        is warned about (once) and the default is used; ``python -m cbatch.envs --check``
        fails on it."""
        raw = os.environ.get(self.name, "")
        try:
            return self.parse(raw)
        except ValueError as e:
            if (self.name, raw) not in _warned:
                _warned.add((self.name, raw))
                warnings.warn(f"{e}; using the default ({self.default or 'unset'})",
                              RuntimeWarning, stacklevel=3)
            return self.parse("")


_warned: set[tuple[str, str]] = set()


VARIABLES = (
    Variable("CBATCH_ATTENTION_BACKEND", "",
             "the attention ops' backend when a call names none (default: the fastest here)",
             ("cuda", "triton", "cpu", "torch")),
    Variable("CBATCH_CPU_LINEAR", "",
             "the CPU linear layers' route (default: the first of cbatch, onednn, torch that "
             "runs the dtype here)", ("cbatch", "onednn", "torch")),
    Variable("CBATCH_GREEDY_SCREEN", "1",
             "0: no greedy screen for a CPU lm_head (greedy steps compute every logit)",
             flag=True),
    Variable("CBATCH_CPU_LAYERS", "1",
             "0: a CPU step runs a Llama-family model's layers op by op from Python, not in "
             "one C++ call", flag=True),
    Variable("CBATCH_HUGE_PAGES", "1",
             "0: a CPU engine's packed weights and KV pool stay on malloc, not 2 MB huge pages",
             flag=True),
    Variable("CBATCH_FILE_CACHE", "1",
             "0: a GGUF file's packed model and tokenizer are made anew at every start, not "
             "read back from the cache (cbatch.file_cache)", flag=True),
    Variable("CBATCH_CACHE_ROOT", "",
             "the folder of cbatch's file cache (default: $XDG_CACHE_HOME/cbatch, else "
             "~/.cache/cbatch)"),
    Variable("CBATCH_CPU_ISA", "",
             "avx2: the C++ CPU kernels take the paths of a CPU without AVX-512", ("avx2",),
             when="load"),
    Variable("CBATCH_CPU_ATTENTION", "",
             "generic: CPU attention runs its portable step, not the AVX-512/AVX2 one",
             ("generic",), when="load"),
    Variable("CBATCH_NO_EXT", "0",
             "1: build without the compiled extension, or do not load the one built",
             flag=True, when="build, load"),
    Variable("CBATCH_NO_CUDA", "0",
             "1: compile the CPU kernels only, even with a CUDA torch and nvcc", flag=True,
             when="build"),
    Variable("CBATCH_TRITON_AUTOTUNE", "0",
             "1: Triton launchers benchmark every config on each new shape (minutes at first)",
             flag=True),
    Variable("CBATCH_DEBUG", "0",
             "1: the cbatch command shows the traceback of an error", flag=True),
    Variable("CBATCH_LOGGING_LEVEL", "INFO",
             "the cbatch logger's level: WARNING silences the model-load lines on stderr",
             ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), when="import", upper=True),
    Variable("CBATCH_API_KEY", "",
             "the key `cbatch serve` requires when --api-key is not given (default: none)",
             secret=True),
    Variable("CBATCH_TORCH", "torch==2.13.0",
             "the torch requirement scripts/run.sh installs", when="run.sh"),
    Variable("CBATCH_SUITE_LIMIT", "300",
             "seconds scripts/gpu_check.sh gives the test suite on a GPU machine",
             when="gpu_check.sh"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def __getattr__(name: str):
    variable = _BY_NAME.get(name)
    if variable is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return variable.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_BY_NAME))


def markdown_table() -> str:
    """The README's table: variable, default, read, meaning."""
    rows = ["| variable | default | read | meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default else "unset"
        rows.append(f"| `{v.name}` | {default} | {v.when} | {v.meaning} |")
    return "\n".join(rows)


def check() -> list[str]:
    """A sentence for each variable set to a value it does not take."""
    errors = []
    for v in VARIABLES:
        try:
            v.parse(os.environ.get(v.name, ""))
        except ValueError as e:
            errors.append(str(e))
    return errors


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        problems = check()
        print("\n".join(problems) or "every CBATCH_* variable set here takes its value")
        sys.exit(1 if problems else 0)
    print(markdown_table())
