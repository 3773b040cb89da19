"""An opened ``.gguf`` file: its metadata and its tensors' bytes, memory-mapped, checked
against what cbatch runs.

The header is read by :mod:`cbatch.models.gguf.header` (tested against llama.cpp's own reader,
``gguf.GGUFReader``, which takes seconds over a vocabulary); the tensor types' names and
sizes are the ``gguf`` package's.  Nothing is read twice: the file is mapped, and each
tensor's bytes are read once, when :mod:`cbatch.models.gguf.loader` decodes them.  A file
cbatch cannot run is refused by name: an architecture of ``general.architecture`` other than
:data:`ARCHITECTURES`, a tensor of a type other than
:data:`cbatch.models.gguf.blocks.SUPPORTED_TYPES`, a file that is not GGUF, is big-endian, or
ends before its header or its tensors do.
"""

from __future__ import annotations

import collections
import mmap
from pathlib import Path

import numpy as np
import torch

from cbatch.models.gguf.blocks import SUPPORTED_TYPES, from_numpy
from cbatch.models.gguf.header import VERSIONS, Truncated, byte_order_version, read_header

# general.architecture -> the model class (cbatch.models.registry's name for it)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
_MISSING = object()


class GGUFFile:
    """A ``.gguf`` file opened for reading (see the module docstring).

    Attributes
    ----------
    path : Path
    architecture : str
        ``general.architecture`` (one of :data:`ARCHITECTURES`).
    tensor_names : list of str
        In the file's order.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map, header, self._kinds = _open(self.path)  # name -> (type, bytes)
        self._metadata = header.metadata
        self._data_offset = header.data_offset
        self._tensors = {t.name: t for t in header.tensors}
        self.tensor_names = list(self._tensors)
        arch = self.get("general.architecture", None)
        if arch not in ARCHITECTURES:
            what = "names no general.architecture" if arch is None else \
                f"has general.architecture {arch!r}"
            raise ValueError(f"{self.path} {what}; cbatch runs GGUF files of "
                             f"{', '.join(ARCHITECTURES)}")
        self.architecture = arch
        for name in self._tensors:
            qtype = self.qtype(name)
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {name} is of type {qtype}, which cbatch "
                                 f"does not load; it loads {', '.join(SUPPORTED_TYPES)}")

    def get(self, key: str, default=_MISSING):
        """The value of metadata ``key``: an int, float, bool, str or list of them;
        ``default`` when the file lacks it (no default: ValueError naming file and key)."""
        if key not in self._metadata:
            if default is _MISSING:
                raise ValueError(f"{self.path} lacks the metadata key {key} (a "
                                 f"{self.get('general.architecture', '?')} file needs it)")
            return default
        return self._metadata[key]

    def arch_key(self, name: str, default=_MISSING):
        """Metadata ``<architecture>.<name>`` (``llama.block_count``)."""
        return self.get(f"{self.architecture}.{name}", default)

    def token(self, token_id: int | None) -> str | None:
        """Entry ``token_id`` of ``tokenizer.ggml.tokens`` (None for None or an id the list
        lacks)."""
        tokens = self._metadata.get("tokenizer.ggml.tokens")
        if tokens is None or token_id is None or not 0 <= token_id < len(tokens):
            return None
        return tokens[token_id]

    def qtype(self, name: str) -> str:
        """The GGUF type of tensor ``name`` (``"Q4_K"``)."""
        return self._kinds[self._tensor(name).name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, rows last, as torch orders it (GGUF lists the
        dimensions the other way round: ``[K, N]`` for a ``[N, K]`` weight)."""
        return tuple(reversed(self._tensor(name).dims))

    def raw(self, name: str) -> torch.Tensor:
        """uint8: tensor ``name``'s bytes, a view of the mapped file (not a copy)."""
        tensor = self._tensor(name)
        return from_numpy(np.frombuffer(self._map, np.uint8, self._kinds[name][1],
                                        self._data_offset + tensor.offset))

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise ValueError(f"{self.path} has no tensor {name} (a {self.architecture} file "
                             "needs it)")
        return self._tensors[name]

    def type_counts(self) -> dict[str, int]:
        """Type name -> how many tensors are of it, most first."""
        counts = collections.Counter(self.qtype(name) for name in self._tensors)
        return dict(counts.most_common())

    def describe_types(self) -> str:
        """``"Q4_K: 154 tensors, Q6_K: 29, F32: 65"``."""
        items = [f"{t}: {n}" for t, n in self.type_counts().items()]
        if not items:
            return "no tensors"
        items[0] += " tensor" if items[0].endswith(": 1") else " tensors"
        return ", ".join(items)

    def close(self) -> None:
        """Unmap the file (tensors decoded from it are copies and stay valid)."""
        self._tensors.clear()
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive: the GC unmaps it later
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: Path):
    """(the file mapped, its header, {tensor name: (its type's name, its bytes)}); ValueError
    naming the file and what is wrong."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError as e:
        raise ModuleNotFoundError("reading a .gguf file needs llama.cpp's gguf package: "
                                  "pip install gguf", name="gguf") from e
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not begin with the bytes "
                             f"'GGUF', but {magic!r})")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(mapped)
    damaged = f"{path} is truncated or damaged: its header or tensor data does not fit its " \
        f"{size} bytes"
    if size < 24:
        raise ValueError(damaged)
    order, version = byte_order_version(mapped)
    if order == "big":  # its tensors' bytes would need swapping
        raise ValueError(f"{path} is a GGUF file of the other byte order (big-endian); "
                         "cbatch reads little-endian ones")
    if version not in VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; cbatch reads versions "
                         f"{', '.join(map(str, VERSIONS))}")
    try:
        header = read_header(mapped)
    except Truncated as e:
        raise ValueError(f"{damaged} ({e})") from None
    except ValueError as e:  # a value type GGUF does not define
        raise ValueError(f"{path} is damaged: {e}") from None
    kinds = {}
    for t in header.tensors:
        try:
            qtype = GGMLQuantizationType(t.type)
        except ValueError:  # a type number this gguf package lacks
            raise ValueError(f"{path}: tensor {t.name} is of type number {t.type}, unknown to "
                             f"the gguf package; cbatch loads {', '.join(SUPPORTED_TYPES)}"
                             ) from None
        block, nbytes = GGML_QUANT_SIZES[qtype]
        kinds[t.name] = (qtype.name, int(np.prod(t.dims, dtype=np.int64)) // block * nbytes)
    end = max((header.data_offset + t.offset + kinds[t.name][1] for t in header.tensors),
              default=header.data_offset)
    if end > size:
        raise ValueError(damaged)
    return mapped, header, kinds
