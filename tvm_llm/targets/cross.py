"""Cross-linking without a cross toolchain: zig's bundled clang/lld from the `ziglang` wheel.

`cross_compiler("aarch64")` returns an `fcompile` for `export_library`: it links the host
objects TVM wrote (and the device blob object, if any) into a shared library for
aarch64-linux-gnu with `zig cc -target aarch64-linux-gnu`. The same zig binary also provides
the LLVM-22 `ld.lld` the ROCm target links code objects with (see `zig_command`).
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..errors import UserError

# --arch name -> the triple zig links for (glibc; the .so is loaded by TVM's runtime there).
CROSS_TRIPLES = {"aarch64": "aarch64-linux-gnu", "x86_64": "x86_64-linux-gnu"}


def zig_command() -> list[str]:
    """The command that runs zig: its binary inside the ziglang package (no Python start-up per
    call), else `python -m ziglang`."""
    try:
        import ziglang
    except ImportError as err:
        raise UserError("the ziglang package is missing: pip install ziglang "
                        "(it provides the cross linker and LLD)") from err
    exe = os.path.join(os.path.dirname(ziglang.__file__), "zig")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-m", "ziglang"]


def run_zig(args: list[str], what: str) -> None:
    """Run `zig <args>`; a failure raises RuntimeError with zig's output and the command."""
    cmd = zig_command() + list(args)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        out = proc.stdout.decode("utf-8", errors="replace")
        raise RuntimeError(f"{what} failed:\n{out}\ncommand: {' '.join(cmd)}")


def cross_compiler(arch: str):
    """An `fcompile` for `Module.export_library` that links a shared library for `arch`."""
    if arch not in CROSS_TRIPLES:
        raise UserError(f"no cross linker for {arch!r}: choose one of {', '.join(CROSS_TRIPLES)}")
    triple = CROSS_TRIPLES[arch]

    def fcompile(output, objects, options=None):
        objects = [objects] if isinstance(objects, str) else list(objects)
        run_zig(["cc", "-target", triple, "-shared", "-fPIC", "-o", output, *objects,
                 *(options or [])], f"linking {os.path.basename(output)} for {triple}")

    fcompile.output_format = "so"
    fcompile.get_target_triple = lambda: triple
    return fcompile
