"""An opened ``.gguf`` file: its metadata and its tensors' bytes, memory-mapped by llama.cpp's
own reader (``gguf.GGUFReader``), checked against what cbatch runs.

Nothing is read twice: the reader maps the file, and each tensor's bytes are read once, when
:mod:`cbatch.models.gguf.loader` decodes them.  A file cbatch cannot run is refused by name:
an architecture of ``general.architecture`` other than :data:`ARCHITECTURES`, a tensor of a
type other than :data:`cbatch.models.gguf.blocks.SUPPORTED_TYPES`, a file that is not GGUF or
ends before its header or its tensors do.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import torch

from cbatch.models.gguf.blocks import SUPPORTED_TYPES, from_numpy

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
        self._reader = _open(self.path)
        if self._reader.byte_order != "I":  # its tensors' bytes would need swapping
            raise ValueError(f"{self.path} is a GGUF file of the other byte order (big-endian); "
                             "cbatch reads little-endian ones")
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.tensor_names = list(self._tensors)
        arch = self.get("general.architecture", None)
        if arch not in ARCHITECTURES:
            what = "names no general.architecture" if arch is None else \
                f"has general.architecture {arch!r}"
            raise ValueError(f"{self.path} {what}; cbatch runs GGUF files of "
                             f"{', '.join(ARCHITECTURES)}")
        self.architecture = arch
        for name, tensor in self._tensors.items():
            qtype = tensor.tensor_type.name
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(f"{self.path}: tensor {name} is of type {qtype}, which cbatch "
                                 f"does not load; it loads {', '.join(SUPPORTED_TYPES)}")

    def get(self, key: str, default=_MISSING):
        """The value of metadata ``key``: an int, float, bool, str or list of them;
        ``default`` when the file lacks it (no default: ValueError naming file and key)."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"{self.path} lacks the metadata key {key} (a "
                                 f"{self.get('general.architecture', '?')} file needs it)")
            return default
        return _value(field)

    def arch_key(self, name: str, default=_MISSING):
        """Metadata ``<architecture>.<name>`` (``llama.block_count``)."""
        return self.get(f"{self.architecture}.{name}", default)

    def token(self, token_id: int | None) -> str | None:
        """Entry ``token_id`` of ``tokenizer.ggml.tokens`` (None for None or an id the list
        lacks), read alone (a vocabulary has a hundred thousand entries)."""
        field = self._reader.fields.get("tokenizer.ggml.tokens")
        if field is None or token_id is None or not 0 <= token_id < len(field.data):
            return None
        return bytes(field.parts[field.data[token_id]]).decode("utf-8")

    def qtype(self, name: str) -> str:
        """The GGUF type of tensor ``name`` (``"Q4_K"``)."""
        return self._tensor(name).tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape, rows last, as torch orders it (GGUF lists the
        dimensions the other way round: ``[K, N]`` for a ``[N, K]`` weight)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def raw(self, name: str) -> torch.Tensor:
        """uint8: tensor ``name``'s bytes, a view of the mapped file (not a copy)."""
        return from_numpy(self._tensor(name).data)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise ValueError(f"{self.path} has no tensor {name} (a {self.architecture} file "
                             "needs it)")
        return self._tensors[name]

    def type_counts(self) -> dict[str, int]:
        """Type name -> how many tensors are of it, most first."""
        counts = collections.Counter(t.tensor_type.name for t in self._tensors.values())
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
        mapping = getattr(self._reader.data, "_mmap", None)
        self._reader = None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a view of it is still alive: the GC unmaps it later
                pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: Path):
    """``gguf.GGUFReader`` over ``path``; ValueError naming the file and what is wrong."""
    try:
        from gguf import GGUFReader
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
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        if "GGMLQuantizationType" in str(e):  # a type number this gguf package lacks
            raise ValueError(f"{path} holds a tensor of a type unknown to the gguf package "
                             f"({e}); cbatch loads {', '.join(SUPPORTED_TYPES)}") from None
        # the reader slices its memory map: a file cut short gives short slices, whose
        # reshapes and dtype views fail
        size = path.stat().st_size
        raise ValueError(f"{path} is truncated or damaged: its header or tensor data does "
                         f"not fit its {size} bytes (gguf's reader: {e})") from None


def _value(field):
    """A metadata field's value, from the reader's parts (gguf's GGUFValueType numbers:
    8 string, 9 array, the rest scalars)."""
    kind = int(field.types[0])
    if kind == 8:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    if kind == 9:
        if len(field.types) > 1 and int(field.types[1]) == 8:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [_scalar(field.parts[i]) for i in field.data]
    return _scalar(field.parts[field.data[0]])


def _scalar(part: np.ndarray):
    value = part[0]
    if part.dtype == np.float32:  # the shortest decimal that is this float32 (1e-06, not
        return float(str(value))  # 9.99999997e-07): what a config.json said, to the bit
    return bool(value) if part.dtype == np.bool_ else value.item()
