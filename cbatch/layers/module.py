"""Modules whose calls go straight to ``forward``: the layers a step calls many times.

``nn.Module.__call__`` looks for hooks (global and the module's own; forward, pre-forward and
backward) before and after it calls ``forward``, and a GPT-2 step calls over a hundred
modules: with small widths that bookkeeping is a visible share of a step (benchmarks/NOTES.md,
"Host side of a step").

cbatch's layers inherit :class:`DirectCall`, so ``layer(x)`` is ``layer.forward(x)``; an
instance's own ``forward`` attribute is honoured (wrap it to time or trace a layer).  Hooks
are not: registering one on such a layer raises, rather than being skipped silently, and
global module hooks (``torch.nn.modules.module.register_module_forward_hook``) do not run
for them.  A model's top module (one call per step) stays a plain ``nn.Module``.
"""

from __future__ import annotations

from torch import nn

_NO_HOOKS = ("cbatch's layers call forward directly and run no hooks (cbatch/layers/module.py); "
             "wrap the module's forward instead, e.g. `m.forward = wrapper(m.forward)`")


class DirectCall:
    """Mixin, before the ``nn.Module`` class in the bases: calls run ``self.forward``."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        raise NotImplementedError(_NO_HOOKS)

    def register_forward_pre_hook(self, *args, **kwargs):
        raise NotImplementedError(_NO_HOOKS)


class Module(DirectCall, nn.Module):
    """``nn.Module`` without the per-call hook dispatch (see the module docstring)."""
