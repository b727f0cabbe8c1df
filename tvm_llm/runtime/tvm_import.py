"""Import the TVM runtime without dragging torch in.

apache-tvm-ffi imports torch eagerly whenever it is installed (for DLPack interop), which costs
seconds and hundreds of MB in a process that only runs a compiled model. If torch is not already
loaded, we hide it while TVM is first imported; torch stays importable afterwards.
"""
from __future__ import annotations

import importlib.abc
import sys

_HIDDEN = ("torch", "transformers")


class _HideModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _HIDDEN:
            raise ImportError(f"{fullname} is not used by the tvm_llm runtime")
        return None


def import_tvm():
    """`import tvm` for the runtime; returns the module."""
    if "tvm" in sys.modules or any(m in sys.modules for m in _HIDDEN):
        import tvm

        return tvm
    finder = _HideModules()
    sys.meta_path.insert(0, finder)
    try:
        import tvm
        import tvm.runtime.vm  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
    return tvm
