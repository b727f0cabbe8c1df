"""FuseAddRMSNorm: add + rms_norm -> one add_rms_norm kernel with two outputs (h, norm(h)),
equal to the unfused pair; left alone where the add belongs in a matmul's epilogue."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from relax_util import op_names, random
from tvm_llm.passes.fuse_add_rms_norm import FuseAddRMSNorm


@tvm.script.ir_module
class Before:  # x + attn (e.g. a hand-written kernel's output, here an input), then the norm
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), o: R.Tensor(("n", 64), "float32"),
             w: R.Tensor((64,), "float32")):
        with R.dataflow():
            h = R.add(x, o)
            y = R.nn.rms_norm(h, w, axes=[-1], epsilon=1e-5)
            out = R.tuple(h, y)  # h is the next residual
            R.output(out)
        return out


@tvm.script.ir_module
class FedByMatmul:  # the add rides in the matmul's epilogue: must not fire
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), a: R.Tensor(("n", 32), "float32"),
             wo: R.Tensor((64, 32), "float32"), w: R.Tensor((64,), "float32")):
        with R.dataflow():
            o = R.matmul(a, R.permute_dims(wo))
            h = R.add(x, o)
            y = R.nn.rms_norm(h, w, axes=[-1], epsilon=1e-5)
            out = R.tuple(h, y)
            R.output(out)
        return out


def test_before_after():
    after = FuseAddRMSNorm()(Before)
    ops = op_names(after["main"])
    assert "relax.add" not in ops and "relax.nn.rms_norm" not in ops
    assert ops.count("relax.call_tir") == 1
    prim = [f for _, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(prim) == 1 and len(prim[0].params) == 5  # x, o, w -> h, normed


def test_fused_kernel_equals_unfused_pair():
    """Through LegalizeOps and our CPU schedule rules, as the build runs it."""
    from schedules.cpu import cpu_schedule_pass
    from cpu_workloads import host_target

    args = [random((7, 64), 1), random((7, 64), 2), random((64,), 3)]
    target = host_target()

    def build_run(mod):
        seq = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                        relax.transform.AnnotateTIROpPattern(),
                                        relax.transform.FuseOps(), relax.transform.FuseTIR()])
        with target:
            mod = cpu_schedule_pass()(seq(mod))
        fused = [f for gv, f in mod.functions_items() if "add_rms_norm" in gv.name_hint]
        vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
        out = vm["main"](*[tvm.runtime.tensor(a, tvm.cpu()) for a in args])
        return [o.numpy() for o in out], fused

    (h0, y0), _ = build_run(Before)
    (h1, y1), fused = build_run(FuseAddRMSNorm()(Before))
    assert fused and all(bool(f.attrs.get("tirx.is_scheduled", False)) for f in fused)
    x, o, w = args
    np.testing.assert_array_equal(h1, h0)
    np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-6)
    ref = (x + o) / np.sqrt(((x + o) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y1, ref, rtol=1e-4, atol=1e-5)


def test_not_fired_when_add_fuses_into_matmul():
    after = FuseAddRMSNorm()(FedByMatmul)
    assert "relax.add" in op_names(after["main"]) and "relax.call_tir" not in op_names(after["main"])


@tvm.script.ir_module
class WeightAfterAdd:  # Gemma: the norm's weight (1 + w) is computed after the residual add
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), o: R.Tensor(("n", 64), "float32"),
             w: R.Tensor((64,), "float32")):
        with R.dataflow():
            h = R.add(x, o)
            w1 = R.add(w, R.const(1.0, "float32"))
            y = R.nn.rms_norm(h, w1, axes=[-1], epsilon=1e-5)
            out = R.tuple(h, y)
            R.output(out)
        return out


def test_left_alone_when_the_norm_weight_is_computed_after_the_add():
    """The fused kernel would run where the add is, before its weight exists (this broke the
    Gemma 2/3 builds): the pair stays unfused and the module stays well formed."""
    after = FuseAddRMSNorm()(WeightAfterAdd)
    assert "relax.nn.rms_norm" in op_names(after["main"])
    relax.transform.FuseTransposeMatmul()(after)  # walks use-def chains: fails on use-before-def
