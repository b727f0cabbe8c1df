"""The short names of the targets (llvm, cuda, rocm): each target module registers its spec
class here, and `tvm_llm.targets.get_target` looks it up."""
from __future__ import annotations

_REGISTRY: dict = {}


def register_target(name):
    def deco(cls):
        _REGISTRY[name] = cls
        return cls
    return deco
