"""Cross-linking an aarch64 shared library on this x86 machine with zig (tvm_llm.targets.cross)."""
from __future__ import annotations

import struct

import pytest

EM_AARCH64 = 183


def _elf_machine(path: str) -> tuple[int, int]:
    """(ELF class, e_machine) of the file: class 2 is 64-bit."""
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", "not an ELF file"
    return head[4], struct.unpack_from("<H", head, 18)[0]


def _small_kernel():
    import tvm
    from tvm import te

    a = te.placeholder((64,), "float32", name="a")
    b = te.compute((64,), lambda i: a[i] * 2.0 + 1.0, name="b")
    return tvm.IRModule({"scale": te.create_prim_func([a, b]).with_attr("global_symbol", "scale")})


def test_export_aarch64_shared_library(tmp_path):
    import tvm

    from tvm_llm.targets import get_target

    spec = get_target("llvm", arch="aarch64")
    ex = tvm.compile(_small_kernel(), target=spec.tvm_target())
    path = str(tmp_path / "kernel_aarch64.so")
    spec.export_library(ex, path)
    assert _elf_machine(path) == (2, EM_AARCH64)
    with open(path, "rb") as f:
        assert b"scale" in f.read()  # the kernel's symbol is in the library


def test_cross_compiler_rejects_unknown_arch():
    from tvm_llm.errors import UserError
    from tvm_llm.targets.cross import cross_compiler

    with pytest.raises(UserError, match="aarch64"):
        cross_compiler("riscv64")
