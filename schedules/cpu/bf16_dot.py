"""AVX512-BF16 dot product (``vdpbf16ps``) as a tensor intrinsic for the GEMM rule.

``vdpbf16ps zmm_acc, zmm_a, zmm_b`` adds, to each of 16 float32 lanes, the products of the two
bfloat16 pairs in the same 32-bit lane of ``a`` and ``b``: 32 multiply-adds per instruction,
twice the float32 FMA's 16 (and no widening of the weight: the widen-and-FMA fallback spends a
``vpmovzxwd`` + ``vpslld`` per 16 weights). CPUs: Zen 4 (znver4), Cooper Lake, Sapphire Rapids
and later Intel server parts (LLVM feature ``avx512bf16``).

The intrinsic computes ``C[i] += f32(A[k]) * f32(B[i, k])`` for i < 16, k < 2: one pair of
activations (broadcast to all lanes) against a 16 x 2 block of the weight, stored with the two
k of each output column adjacent. The GEMM rule packs bfloat16 weights for it as
``Bp[N/PN, K/2, PN, 2]`` (:mod:`.gemm`); activations are already bfloat16 in a bfloat16 model,
so nothing is rounded that the model does not round itself.

Why an imported LLVM function and not ``call_llvm_pure_intrin``: LLVM 22 (the one linked into
TVM 0.27) declares the intrinsic on ``<32 x bfloat>`` operands (older LLVMs on ``<16 x i32>``,
then ``<32 x i16>``: verified here only for 22), and TVM's BF16ComputeLegalize/BF16StorageLegalize passes rewrite every
bfloat16 value of a TIR function into float32/uint16 before codegen, so a ``<32 x bfloat>``
operand cannot be written in TIR (both tries fail LLVM's verifier; skipping the legalization
crashed the codegen). The kernel therefore carries each bf16 pair as one 32-bit lane and calls
a three-line LLVM function, linked into the module through TVM's ``pragma_import_llvm``, that
bitcasts ``<16 x i32>`` to ``<32 x bfloat>`` and calls the intrinsic; it is ``alwaysinline``,
so the generated code holds the bare ``vdpbf16ps``.

Limits: the operands must keep bfloat16 storage, i.e. be kernel parameters (a bfloat16 buffer
allocated inside a kernel is given float32 storage by BF16ComputeLegalize, and the bitcast then
fails LLVM's verifier: hence :class:`.prepack.DropSplitOriginals`). The instruction adds the odd
product of each pair first, then the even one, each addition rounded to float32, and flushes
denormals: the test's numpy model does the same.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from .common import tensor_intrin

INTRIN_NAME = "tvm_llm_bf16_dot_16x2"  # + _int32 / _int64
LLVM_FUNC = "tvm_llm_dpbf16ps_512"
FEATURE = "avx512bf16"

LLVM_IR = f"""
define linkonce_odr <16 x float> @{LLVM_FUNC}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %a2 = bitcast <16 x i32> %a to <32 x bfloat>
  %b2 = bitcast <16 x i32> %b to <32 x bfloat>
  %r = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %a2, <32 x bfloat> %b2)
  ret <16 x float> %r
}}
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)
"""


def _intrin(index_dtype: str):
    """(desc, impl) with shapes, loops and indices in index_dtype (the tensorize comparator
    wants the block's own index type: int64 in relax-built kernels)."""
    def c(v):
        return tvm.tirx.IntImm(index_dtype, v)

    @T.prim_func(s_tir=True)
    def desc(A: T.Buffer((c(2),), "bfloat16", offset_factor=1),
             B: T.Buffer((c(16), c(2)), "bfloat16", offset_factor=1),
             C: T.Buffer((c(16),), "float32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[c(0):c(16)], A[c(0):c(2)], B[c(0):c(16), c(0):c(2)])
            T.writes(C[c(0):c(16)])
            for i in T.serial(c(0), c(16)):
                for k in T.serial(c(0), c(2)):
                    with T.sblock("update"):
                        vi, vk = T.axis.remap("SR", [i, k])
                        C[vi] = C[vi] + T.Cast("float32", A[vk]) * T.Cast("float32", B[vi, vk])

    @T.prim_func(s_tir=True)
    def impl(A: T.Buffer((c(2),), "bfloat16", offset_factor=1),
             B: T.Buffer((c(16), c(2)), "bfloat16", offset_factor=1),
             C: T.Buffer((c(16),), "float32", offset_factor=1)) -> None:
        with T.sblock("root"):
            T.reads(C[c(0):c(16)], A[c(0):c(2)], B[c(0):c(16), c(0):c(2)])
            T.writes(C[c(0):c(16)])
            with T.attr(0, "pragma_import_llvm", LLVM_IR):
                # one statement: a Python name bound here would become a local buffer
                C[T.ramp(c(0), c(1), 16)] = T.call_pure_extern(
                    "float32x16", LLVM_FUNC, C.vload([c(0)], "float32x16"),
                    T.broadcast(T.reinterpret(A.vload([c(0)], "bfloat16x2"), dtype="int32"), 16),
                    T.reinterpret(B.vload([c(0), c(0)], "bfloat16x32"), dtype="int32x16"))

    return desc, impl


def intrin_name(index_dtype: str = "int64") -> str:
    """The name of the tensor intrinsic for index_dtype, registered on first use."""
    return tensor_intrin(f"{INTRIN_NAME}_{index_dtype}", lambda: _intrin(index_dtype))
