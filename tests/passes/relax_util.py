"""Small helpers for pass tests: build Relax functions, run them, compare pass on vs off."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def compile_and_run(mod: tvm.IRModule, func: str, args: list) -> np.ndarray:
    target = tvm.target.Target({"kind": "llvm"})
    ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm[func](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args])
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def op_names(func) -> list:
    names = []

    def visit(e):
        if isinstance(e, relax.Call) and hasattr(e.op, "name"):
            names.append(e.op.name)

    relax.analysis.post_order_visit(func, visit)
    return names


def random(shape, seed=0, dtype="float32"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)
