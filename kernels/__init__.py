"""cbatch's Triton kernels, installed as ``cbatch.kernels``: one module per op, each a private
``_*_kernel`` and a public launcher.  The launchers are registered as torch custom ops in
``cbatch.ops.triton``.

From a checkout's root (pytest, ``python -c``, a script or a REPL started there) this folder
is also on the import path as a top-level ``kernels``: the name of Hugging Face's kernels
package, which transformers imports.  Imported under that name, this file hands the import
over to the first ``kernels`` found elsewhere on the path, so ``import kernels`` means
Hugging Face's package wherever it runs, and cbatch's modules import only as
``cbatch.kernels``.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (cbatch's kernels/ folder imports "
                                  "only as cbatch.kernels)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what is here when we end
    _spec.loader.exec_module(_module)
