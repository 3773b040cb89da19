"""A GGUF file's header read in one pass over its bytes: the metadata as Python values and
where each tensor's bytes lie (llama.cpp's ``docs/gguf.md``; versions 2 and 3, little-endian).

``gguf.GGUFReader`` (llama.cpp's own reader) builds a numpy view per value at open, a hundred
thousand of them for a vocabulary's strings: 3 s for SmolLM2's, 10 s for Llama 3's on this
machine.  This reads the same header in a loop of ``struct`` calls (numbers arrays as one
``numpy.frombuffer`` each): 0.16 and 0.32 s; it is tested field for field against GGUFReader
(tests/models/test_gguf_header.py).  Tensors' bytes are not read here: :class:`TensorInfo`
says where they are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

# GGUF value types (gguf.GGUFValueType): the scalars' struct formats; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32  # general.alignment when the file does not say


class Truncated(ValueError):
    """The header runs past the end of the bytes."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``dims`` in GGUF's order (the fastest-varying first: ``[K, N]``
    for an ``[N, K]`` weight), ``type`` a ggml type number (``gguf.GGMLQuantizationType``),
    ``offset`` its bytes' start from the data region's."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int


@dataclass(frozen=True)
class Header:
    """``metadata``: key -> int, float, bool, str or a list of them (a float32 as the shortest
    decimal that is it, as a config.json writes it); ``data_offset``: where the tensors'
    bytes begin in the file (aligned to ``general.alignment``)."""

    version: int
    metadata: dict[str, object]
    tensors: list[TensorInfo]
    data_offset: int


def byte_order_version(buf) -> tuple[str, int]:
    """("little" or "big", the version) from the four bytes after the magic."""
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0 and version:  # a big-endian file's small version number
        return "big", int.from_bytes(struct.pack("<I", version), "big")
    return "little", version


def read_header(buf) -> Header:
    """The header of the GGUF file whose bytes are ``buf`` (a memory map); :class:`Truncated`
    if they end before it does, ValueError for a value type GGUF does not define."""
    reader = _Reader(buf)
    try:
        reader.pos = 4  # after the magic
        version = reader.scalar("<I")
        tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = tuple(reader.scalar("<Q") for _ in range(reader.scalar("<I")))
            tensors.append(TensorInfo(name, dims, reader.scalar("<I"), reader.scalar("<Q")))
    except struct.error as e:
        raise Truncated(str(e)) from None
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    return Header(version, metadata, tensors, -(-reader.pos // alignment) * alignment)


class _Reader:
    def __init__(self, buf):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        start = self.pos + 8
        end = start + self.scalar("<Q")
        if end > self.size:
            raise struct.error(f"a string of {end - start} bytes at {start}")
        self.pos = end
        return str(self.buf[start:end], "utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in (_STRING, _ARRAY):
                return [self.value(item) for _ in range(count)]
            dtype = np.dtype(self._format(item))
            if self.pos + count * dtype.itemsize > self.size:
                raise struct.error(f"an array of {count} at {self.pos}")
            values = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += values.nbytes
            return [float(str(v)) for v in values] if item == _FLOAT32 else values.tolist()
        value = self.scalar(self._format(kind))
        return float(str(np.float32(value))) if kind == _FLOAT32 else value

    @staticmethod
    def _format(kind: int) -> str:
        if kind not in _SCALARS:
            raise ValueError(f"a metadata value of type {kind}, which GGUF does not define")
        return _SCALARS[kind]
