"""What differs per target, behind one small interface and a registry of short names.

`get_target("llvm")`, `get_target("cuda", arch="sm_90")`, `get_target("rocm", arch="gfx942")`
return a `TargetSpec`; build.py asks it for the TVM target, the scheduling passes to run after
fusion, the default dtype, and how to link and export the compiled module.
"""
from __future__ import annotations

from .base import TargetSpec  # noqa: F401
from .registry import _REGISTRY, register_target  # noqa: F401
from ..errors import UserError


def _load_all():
    # Importing the modules registers them; GPU modules import lazily-needed tools only when used.
    from . import llvm  # noqa: F401
    try:
        from . import cuda  # noqa: F401
    except ImportError:
        pass
    try:
        from . import rocm  # noqa: F401
    except ImportError:
        pass


def get_target(name: str, arch: str | None = None, **options) -> TargetSpec:
    _load_all()
    if name not in _REGISTRY:
        raise UserError(f"unknown target {name!r}: choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](arch=arch, **options)
