"""Assigning a checkpoint's converted tensors to a model built on the meta device: the one
step every loader ends with (Hugging Face directories, :mod:`cbatch.models.loader`; GGUF files,
:mod:`cbatch.models.gguf.loader`)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def assign(model: nn.Module, state: dict[str, torch.Tensor], path: Path,
            tied: tuple[str, str] | None, device, dtype) -> None:
    """Check ``state`` against ``model``'s parameters still on the meta device (names and
    shapes) and assign it, cast to ``dtype`` on ``device``; ``tied``: (parameter, the one it
    shares its tensor with).  Layers already loaded (quantized ones) are left as they are."""
    expected = {k: v for k, v in model.state_dict().items()
                if v.is_meta and (tied is None or k != tied[0])}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the {type(model).__name__} config: "
                         f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the "
                             f"config expects {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype).contiguous()
    if tied is not None:
        state[tied[0]] = state[tied[1]]
    model.load_state_dict(state, assign=True, strict=False)  # the check above is strict
    if tied is not None:  # assign=True replaced the parameters: share one tensor again
        model.lm_head.weight = model.get_parameter(tied[1])
