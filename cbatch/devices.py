"""What this machine has: the devices cbatch can run on, and what ``dtype="auto"`` means on
each.  No torch at import time (``cbatch --help`` imports this)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def auto_dtype(device: str) -> str:
    """What ``dtype="auto"`` means on ``device``: float16 on CUDA; bfloat16 on a CPU that
    computes in it natively (AVX512-BF16 or AMX; weights, activations and KV cache in bf16,
    matmuls accumulating in fp32: benchmarks/NOTES.md, "bf16 on the CPU"); float32 on other
    CPUs."""
    import torch

    if torch.device(device).type == "cuda":
        return "float16"
    if torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() and (
            torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        return "bfloat16"
    return "float32"


def available_devices() -> list[str]:
    """The devices cbatch can run on here: ``cpu``, then each CUDA device."""
    import torch

    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def check_device(device) -> str:
    """``device`` (a string or torch.device) as a string, if this machine has it; otherwise a
    ValueError naming what it has (rather than torch's error from deep inside the model)."""
    import torch

    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}; "
                         f"available here: {here}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"cbatch runs on 'cpu' or 'cuda', got device={device!r}; available "
                         f"here: {here}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "torch sees no CUDA device")
            raise ValueError(f"device={device!r} but {why} (torch {torch.__version__}); "
                             f"available here: {here}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but there are only "
                             f"{torch.cuda.device_count()} CUDA devices; available here: {here}")
    return str(dev)


def to_device(values: list, device: torch.device, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """A short host list as a tensor on ``device`` without waiting for the device (pinned
    memory and an async copy; ``torch.tensor(values, device=cuda)`` would wait for every
    kernel queued, the previous step's included)."""
    import torch

    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
