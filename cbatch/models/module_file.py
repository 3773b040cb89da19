"""A built model to disk and back, its tensors mapped from the file rather than read into
memory: how the file cache (:mod:`cbatch.file_cache`) keeps a GGUF file's packed model.

Two files: ``module.pickle``, the module tree pickled with each tensor replaced by where its
bytes lie, and ``tensors.bin``, every tensor's bytes one after another (each at a multiple of
:data:`ALIGN`), written as the pickler meets them, so saving makes no copy of the model.
``torch.save`` cannot be used: it keeps each tensor's whole storage, and refuses storages
viewed as several dtypes, which a CPU runner's huge-page chunks are (one chunk holds int8
levels, fp32 scales, ...).  A tensor held twice (a tied weight) is written once and read back
as one tensor; views of one storage come back as tensors of their own.  Reading maps
``tensors.bin`` privately (``MAP_PRIVATE``: pages shared with the page cache until written,
as llama.cpp maps its file).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

ALIGN = 64  # each tensor's offset in tensors.bin: a cache line, a multiple of any dtype


class _Pickler(pickle.Pickler):
    def __init__(self, file, data) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.data, self.offset = data, 0
        self.seen: dict[int, tuple] = {}
        self.alive: list[torch.Tensor] = []  # (ids stay unique while written)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self.seen:
            t = obj.detach()
            if t.device.type != "cpu":
                raise ValueError(f"a {t.device} tensor: only CPU models are saved")
            pad = -self.offset % ALIGN
            self.data.write(b"\0" * pad)
            self.offset += pad
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            self.data.write(flat.numpy())
            self.seen[id(obj)] = ("tensor", self.offset, str(t.dtype).removeprefix("torch."),
                                  tuple(t.shape), isinstance(obj, nn.Parameter),
                                  obj.requires_grad)
            self.offset += flat.numel()
            self.alive.append(obj)
        return self.seen[id(obj)]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, data: torch.Tensor) -> None:
        super().__init__(file)
        self.data = data
        self.made: dict[tuple, torch.Tensor] = {}

    def persistent_load(self, pid):
        if pid not in self.made:  # (a tensor held twice is one pid, loaded once)
            _, offset, dtype, shape, is_param, requires_grad = pid
            dtype = getattr(torch, dtype)
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            t = self.data[offset:offset + nbytes].view(dtype).view(shape)
            self.made[pid] = nn.Parameter(t, requires_grad) if is_param else t
        return self.made[pid]


def save_module(module: nn.Module, folder: Path) -> None:
    """Write ``module`` (on the CPU) into ``folder``: ``module.pickle`` and ``tensors.bin``."""
    with open(folder / "tensors.bin", "wb") as data, open(folder / "module.pickle", "wb") as f:
        _Pickler(f, data).dump(module)


def load_module(folder: Path) -> nn.Module:
    """The module :func:`save_module` wrote into ``folder``, its tensors viewing a private
    mapping of ``tensors.bin`` (written to, a page becomes the process's own copy)."""
    path = folder / "tensors.bin"
    size = path.stat().st_size
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8) if size \
        else torch.empty(0, dtype=torch.uint8)
    with open(folder / "module.pickle", "rb") as f:
        return _Unpickler(f, data).load()
