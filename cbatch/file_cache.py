"""What cbatch makes from a model file once and reads back on the next start: a GGUF file's
model, its weights already unpacked and packed for this CPU's kernels, and its tokenizer
(benchmarks/NOTES.md, "Loading a model: cold start and memory after load").

An entry is a folder under ``$CBATCH_CACHE_ROOT`` (default ``$XDG_CACHE_HOME/cbatch``, else
``~/.cache/cbatch``; vLLM's ``VLLM_CACHE_ROOT``), ``<kind>/<file name>-<slot>/<key>``: the
slot names the source file and what was asked of it (its resolved path and the arguments),
the key everything the bytes depend on besides: the file's size and modification time, the
versions of the libraries that made them, this CPU's ISA, and a digest of cbatch's own code
(its Python files' bytes, its compiled extension's size and time), so that any change to the
file, the arguments, the libraries or the code reads a new entry instead of a stale one.
Writing an entry removes the slot's older ones: a file and its arguments hold one entry.

An entry's files are written into a temporary folder, renamed into place once whole, so
that a reader (or a second process starting beside the first) never sees half of one; an
entry that cannot be written (a read-only home, a full disk: :data:`MIN_FREE_BYTES` beyond
the entry must stay free) is logged and skipped, never an error.  ``CBATCH_FILE_CACHE=0``
turns the cache off.  A model entry is a pickled module (:mod:`cbatch.models.module_file`):
cbatch writes and reads it in the user's own cache folder, where a file is trusted as
cbatch's code is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from cbatch import envs
from cbatch.logger import init_logger

logger = init_logger(__name__)

MIN_FREE_BYTES = 2 << 30  # what a written entry leaves free on its disk at least


def root() -> Path:
    """The cache's folder: ``$CBATCH_CACHE_ROOT``, else ``$XDG_CACHE_HOME/cbatch``, else
    ``~/.cache/cbatch``."""
    if envs.CBATCH_CACHE_ROOT:
        return Path(envs.CBATCH_CACHE_ROOT).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cbatch"


@functools.cache
def code_digest() -> str:
    """A digest of cbatch's code as this process runs it: every Python file's bytes and each
    compiled extension's size and modification time (a rebuild changes them)."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix == ".py":
            digest.update(f"{path.relative_to(package)}\n".encode() + path.read_bytes())
        elif path.suffix in (".so", ".pyd"):
            stat = path.stat()
            digest.update(f"{path.relative_to(package)} {stat.st_size} "
                          f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def version(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed), for an entry's key."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


class Entry:
    """One entry's folder (:func:`entry`), :attr:`path`, its files there once it
    :attr:`exists`; :meth:`write` makes it."""

    def __init__(self, slot: Path, key: str) -> None:
        self.slot, self.key = slot, key
        self.path = slot / key

    @property
    def exists(self) -> bool:
        return self.path.is_dir()

    def remove(self) -> None:
        """Remove the entry (one that did not read back: it is made anew)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def write(self, save: Callable[[Path], None], nbytes: int) -> bool:
        """Make the entry: ``save(folder)`` writes its files into ``folder``; ``nbytes``, about
        what they take, is checked against the disk's free space first.  Whether it was
        written; an error (the disk's, or a tensor ``save`` cannot write) is logged, never
        raised, and leaves nothing behind."""
        try:
            self.slot.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.slot).free
            if free < nbytes + MIN_FREE_BYTES:
                logger.info("not caching %s: %.1f GB free on its disk, the entry needs %.1f GB "
                            "and %.0f GB must stay free", self.path, free / 1e9, nbytes / 1e9,
                            MIN_FREE_BYTES / 1e9)
                return False
            staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=self.slot))
            try:
                save(staging)
                os.replace(staging, self.path)  # (fails if another process made it first)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 (a cache that cannot be written is no error)
            if isinstance(e, OSError) and self.exists:  # another process wrote it meanwhile
                return True
            logger.info("not caching %s: %s: %s", self.path, type(e).__name__, e)
            return False
        for old in self.slot.iterdir():  # the slot's entries of older keys
            if old.name != self.key and not old.name.startswith(".writing-"):
                shutil.rmtree(old, ignore_errors=True)
        return True


def entry(kind: str, source: Path, args: dict, depends: dict) -> Entry | None:
    """The entry of ``kind`` (``"model"``, ``"tokenizer"``) that ``source`` makes: ``args``
    what was asked of it (the slot: one entry at a time), ``depends`` whatever else the bytes
    depend on (library versions, this CPU's ISA; the key, with the file's size and time and
    cbatch's code); JSON-able or ``str``-able values.  None while ``CBATCH_FILE_CACHE=0``."""
    if not envs.CBATCH_FILE_CACHE:
        return None
    source = source.resolve()
    stat = source.stat()
    slot = _hash([str(source), args])[:16]
    key = _hash([stat.st_size, stat.st_mtime_ns, depends, code_digest()])[:16]
    return Entry(root() / kind / f"{source.name}-{slot}", key)
