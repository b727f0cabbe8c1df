"""The compilation pipeline, declared once as named phases per target.

import_cleanup -> fusion -> folding -> lowering -> scheduling -> finalize

Each phase is a list of passes; `run_pipeline` applies them in order, can write the IR after
each phase (`--dump-ir`), and records the time and op counts per phase for the build report.
"""
from __future__ import annotations

import os
import time

PHASES = ("import_cleanup", "fusion", "folding", "lowering", "scheduling", "finalize")


def phase_passes(target_spec, disabled: frozenset = frozenset()) -> list[tuple[str, list]]:
    """(phase name, passes) in order for `target_spec`. Phases in `disabled` are left empty
    where skipping them keeps the module compilable (used by the ablation benchmark)."""
    from tvm import relax

    phases = {
        "import_cleanup": [relax.transform.CanonicalizeBindings(),
                           relax.transform.DeadCodeElimination(["prefill", "decode",
                                                                "create_paged_kv_cache"])],
        "fusion": [relax.transform.FuseTransposeMatmul()],
        "folding": [relax.transform.FoldConstant()],
        "lowering": [relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(),
                     relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                     relax.transform.FoldConstant(), relax.transform.FuseOps(),
                     relax.transform.FuseTIR()],
        "scheduling": list(target_spec.schedule_passes()),
        "finalize": _finalize_passes(target_spec),
    }
    optional = {"import_cleanup", "fusion", "folding", "scheduling"}
    return [(name, [] if (name in disabled and name in optional) else phases[name])
            for name in PHASES]


def _finalize_passes(target_spec) -> list:
    from tvm import relax

    passes = [relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
              relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
              relax.transform.StaticPlanBlockMemory()]
    if target_spec.name == "cuda":
        passes.append(relax.transform.RewriteCUDAGraph())
    passes += [relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse(),
               relax.transform.LowerRuntimeBuiltin(), relax.transform.ComputePrimValue(),
               relax.transform.VMShapeLower(), relax.transform.AttachGlobalSymbol()]
    return passes


def count_ops(mod) -> dict:
    """Relax calls per operator name (call_tir counts as its kernel kind) across the module."""
    from tvm import relax

    counts: dict = {}

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            name = getattr(op, "name", None) or getattr(op, "name_hint", None) or "call"
            counts[name] = counts.get(name, 0) + 1

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return counts


def run_pipeline(mod, target_spec, dump_dir: str | None = None,
                 disabled: frozenset = frozenset()):
    """Apply every phase; return (module, report) where report lists per-phase time and ops."""
    import tvm

    report = []
    target = target_spec.tvm_target()
    with target, tvm.transform.PassContext(opt_level=3, config=target_spec.pass_context_config()):
        for i, (name, passes) in enumerate(phase_passes(target_spec, disabled)):
            t0 = time.perf_counter()
            if passes:
                mod = tvm.transform.Sequential(passes, name=name)(mod)
            seconds = time.perf_counter() - t0
            ops = count_ops(mod)
            report.append({"phase": name, "seconds": round(seconds, 3),
                           "relax_calls": sum(ops.values()), "skipped": not passes})
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                with open(os.path.join(dump_dir, f"{i}_{name}.py"), "w") as f:
                    f.write(mod.script(show_meta=False))
    return mod, report
