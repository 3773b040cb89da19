"""cbatch's Triton kernels, installed as ``cbatch.kernels``: one module per op, each a private
``_*_kernel`` and a public launcher.  The launchers are registered as torch custom ops in
``cbatch.ops.triton``.

This file imports nothing on purpose: from a checkout, this folder is also importable as a
top-level ``kernels`` (transformers probes for a package of that name), and that must stay
inert.
"""
