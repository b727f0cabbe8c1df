"""A vectorizable float32 ``exp`` for LLVM CPU targets.

TVM lowers ``exp`` to LLVM's ``llvm.exp`` intrinsic; on a vector (the SiLU·up and softmax
kernels our rules vectorize) LLVM has no vector math library to call and splits it into one
scalar ``expf`` call per lane: on llama-110m at 512 tokens the SiLU·up kernel spent 1.5 ms
per layer there. This lowering rule replaces float32 ``exp`` (and with it ``sigmoid``, which
lowers to ``1 / (1 + exp(-x))``) by arithmetic that stays in vector registers:

    x = clamp(x, -87.34, 88.38)                     (the float32 range of exp)
    n = floor(x * log2(e) + 1/2),  r = x - n * ln2  (Cody-Waite: ln2 split in two parts,
                                                     so r is exact to float32)
    exp(r) = degree-7 Taylor polynomial in Horner form, |r| <= ln2 / 2
    exp(x) = exp(r) * 2^n, 2^n built in the exponent bits: (n + 127) << 23

Relative error <= 1.2 ulp (7e-8) over [-87, 87] (tests/schedules/test_fast_math.py); NaN in
gives NaN out; below -87.34 the result is the smallest normal float (1.2e-38), not 0, which
a softmax's masked positions cannot tell apart, and above 88.38 it is 2.4e38, not inf. Registered for the "llvm" target only, once
per process, by tvm_llm.targets.llvm when it hands out its schedule passes.
"""
from __future__ import annotations

import tvm
from tvm import tirx

LOG2E = 1.4426950408889634
LN2_HI = 0.693359375  # ln 2 = LN2_HI + LN2_LO, LN2_HI with few mantissa bits: n * LN2_HI exact
LN2_LO = -2.12194440054690583e-4
X_MAX = 88.3762626647949  # 2^n stays finite: n <= 127
X_MIN = -87.3365447504019  # 2^n stays normal: n >= -126
LEVEL = 100  # above TVM's own llvm rule for exp (level 10)

_registered = False


def fast_exp_expr(x, dtype: str):
    """exp(x) for a float32 (or float32xN vector) expression, as TIR arithmetic."""
    lanes = tvm.runtime.DataType(dtype).lanes

    def c(v, t="float32"):
        s = tirx.const(v, t)
        return s if lanes == 1 else tirx.Broadcast(s, lanes)

    idt = "int32" if lanes == 1 else f"int32x{lanes}"
    xc = tirx.max(tirx.min(x, c(X_MAX)), c(X_MIN))
    n = tirx.floor(xc * c(LOG2E) + c(0.5))
    r = xc - n * c(LN2_HI) - n * c(LN2_LO)
    p = c(1.0 / 5040)
    for k in (720, 120, 24, 6, 2, 1, 1):
        p = p * r + c(1.0 / k)
    two_n = tirx.reinterpret(dtype, (tirx.Cast(idt, n) + c(127, "int32")) << c(23, "int32"))
    # NaN stays NaN; tested on the bits, as LLVM may fold a float x != x away
    bits = tirx.reinterpret(idt, x) & c(0x7FFFFFFF, "int32")
    return tirx.Select(bits > c(0x7F800000, "int32"), x, p * two_n)


def _lower_exp(op):
    dtype = str(op.ty)
    if tvm.runtime.DataType(dtype).bits != 32 or not dtype.startswith("float"):
        # float16/float64: what TVM's own llvm rule emits
        return tirx.call_llvm_pure_intrin(dtype, "llvm.exp", op.args[0])
    return fast_exp_expr(op.args[0], dtype)


def register_fast_exp() -> None:
    """Install the rule for target "llvm" (idempotent)."""
    global _registered  # pylint: disable=global-statement
    if not _registered:
        tirx.op.register_intrin_lowering("tirx.exp", "llvm", f=_lower_exp, level=LEVEL)
        _registered = True
