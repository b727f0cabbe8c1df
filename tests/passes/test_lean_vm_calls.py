"""LeanVMCalls: repeated make_shape calls merged, unused tuples and decode's kills dropped,
results unchanged."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from relax_util import random
from tvm_llm.passes.lean_vm_calls import LeanVMCalls

tvm.register_global_func("test.lean_vm_calls.same", lambda t: t, override=True)


def _module():
    @tvm.script.ir_module(check_well_formed=False)  # TIR's verifier refuses sblocks by now
    class Mod:
        @T.prim_func(private=True)
        def two_outputs(x: T.handle, a: T.handle, c: T.handle):  # as add_rms_norm: two outputs
            T.func_attr({"op_pattern": 8, "tirx.is_scheduled": True})
            n = T.int64()
            X = T.match_buffer(x, (n, 64), "float32")
            A = T.match_buffer(a, (n, 64), "float32")
            C = T.match_buffer(c, (n, 64), "float32")
            with T.sblock("root"):  # RewriteDataflowReshape's analysis wants sblocks
                for i, j in T.grid(n, 64):
                    with T.sblock("two"):
                        vi, vj = T.axis.remap("SS", [i, j])
                        A[vi, vj] = X[vi, vj] + T.float32(1)
                        C[vi, vj] = X[vi, vj] * T.float32(2)

        @R.function
        def decode(x: R.Tensor(("b", 1, 64), "float32"), w: R.Tensor((64, 64), "float32")):
            R.func_attr({"tir_var_upper_bound": {"b": 8}})  # as our build's decode: a static plan
            b = T.int64()
            cls = Mod
            with R.dataflow():
                y = R.reshape(x, (b, 64))
                t = R.call_tir(cls.two_outputs, (y,), out_ty=[R.Tensor((b, 64), "float32"),
                                                              R.Tensor((b, 64), "float32")])
                z = R.matmul(R.add(t[0], t[1]), w)
                u = R.reshape(R.nn.silu(z), (b, 1, 64))
                v = R.add(u, x)
                o = R.reshape(R.matmul(R.reshape(v, (b, 64)), w), (b, 1, 64))
                R.output(o)
            return o

        @R.function
        def prefill(x: R.Tensor(("b", 1, 64), "float32"), w: R.Tensor((64, 64), "float32")):
            R.func_attr({"tir_var_upper_bound": {"b": 8}})
            b = T.int64()
            with R.dataflow():
                y = R.reshape(x, (b, 64))
                z = R.matmul(y, w)
                o = R.reshape(R.add(R.nn.silu(z), y), (b, 1, 64))
                R.output(o)
            return o

        @R.function
        def rematch(x: R.Tensor(("b", 64), "float32")):
            b = T.int64()
            y = R.add(x, x)
            z = R.call_pure_packed("test.lean_vm_calls.same", y, ty_args=R.Tensor(ndim=2, dtype="float32"))
            w = R.match_cast(z, R.Tensor((b, 64), "float32"))  # reads the shape heap again
            return R.add(w, x)

    return Mod


def _lower(mod, lean: bool, report=None):
    """Our finalize phase's passes (tvm_llm.passes.pipeline) with or without LeanVMCalls."""
    seq = [relax.transform.LegalizeOps(), relax.transform.RewriteDataflowReshape(),
           relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
           relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory(),
           relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse(),
           relax.transform.LowerRuntimeBuiltin(), relax.transform.ComputePrimValue(),
           relax.transform.VMShapeLower()]
    seq += [LeanVMCalls(report=report)] if lean else []
    seq += [relax.transform.AttachGlobalSymbol()]
    target = tvm.target.Target({"kind": "llvm"})
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(seq)(mod)


def _calls(func) -> dict:
    counts = {}

    def visit(e):
        if isinstance(e, relax.Call):
            name = str(e.op.global_symbol) if isinstance(e.op, relax.ExternFunc) else getattr(e.op, "name", "")
            counts[name] = counts.get(name, 0) + 1

    relax.analysis.post_order_visit(func, visit)
    return counts


def _tuple_bindings(func) -> int:
    return sum(isinstance(b.value, relax.Tuple) for blk in func.body.blocks for b in blk.bindings)


def test_before_after():
    report = {}
    plain, lean = _lower(_module(), False), _lower(_module(), True, report)
    before, after = _calls(plain["decode"]), _calls(lean["decode"])
    assert before["vm.builtin.make_shape"] > 3 and before["relax.vm.kill_object"] > 3
    # one make_shape per distinct shape: (b, 64), (b, 1, 64) and the returned tensor's storage
    # size (b * 256 bytes: the output is not in the static plan)
    assert after["vm.builtin.make_shape"] == 3
    assert "relax.vm.kill_object" not in after
    assert report["decode"] == {"make_shape": before["vm.builtin.make_shape"] - 3,
                                "kills": before["relax.vm.kill_object"], "tuples": 1}
    assert _tuple_bindings(plain["decode"]) == 1 and _tuple_bindings(lean["decode"]) == 0
    # prefill keeps its kills (a storage freed mid-call can serve a later allocation)
    assert _calls(lean["prefill"])["relax.vm.kill_object"] == _calls(plain["prefill"])["relax.vm.kill_object"]


def test_shapes_built_before_a_heap_write_are_not_reused_after_it():
    lean, plain = _calls(_lower(_module(), True)["rematch"]), _calls(_lower(_module(), False)["rematch"])
    # the input's, the packed call's result's (between the two uses of (b, 64)), the return's
    assert plain["vm.builtin.match_shape"] == 3
    # (b, 64) is built before and after the match: both kept
    assert lean["vm.builtin.make_shape"] == plain["vm.builtin.make_shape"] == 4


def test_numerics_on_vs_off():
    w = random((64, 64), seed=1) * 0.1
    got = {}
    for lean in (False, True):
        ex = tvm.compile(_lower(_module(), lean), target=tvm.target.Target({"kind": "llvm"}),
                         relax_pipeline=None)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        for b in (1, 3):
            x = random((b, 1, 64), seed=b)
            for fn in ("decode", "prefill"):
                args = [tvm.runtime.tensor(x, tvm.cpu()), tvm.runtime.tensor(w, tvm.cpu())]
                got[lean, fn, b] = vm[fn](*args).numpy()
            got[lean, "rematch", b] = vm["rematch"](tvm.runtime.tensor(x[:, 0], tvm.cpu())).numpy()
    for key in [k for k in got if not k[0]]:
        np.testing.assert_array_equal(got[key], got[(True,) + key[1:]])
