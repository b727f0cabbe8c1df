"""The compilation pipeline, declared once as named phases per target.

import_cleanup -> fusion -> folding -> lowering -> scheduling -> finalize

Each phase is a list of passes; `run_pipeline` applies them in order, can write the IR after
each phase (`--dump-ir`), and records the time and op counts per phase for the build report.
"""
from __future__ import annotations

import os
import time

from .kernel_counts import count_ops, kernels_per_call  # noqa: F401  (the build report's counts)

PHASES = ("import_cleanup", "fusion", "folding", "lowering", "scheduling", "finalize")


def phase_passes(target_spec, disabled: frozenset = frozenset(), tuning_log: str | None = None,
                 tuning_report: dict | None = None, quantization=None,
                 checkpoint_names: dict | None = None,
                 quant_report: dict | None = None) -> list[tuple[str, list]]:
    """(phase name, passes) in order for `target_spec`. Phases in `disabled` are left empty
    where skipping them keeps the module compilable (used by the ablation benchmark).
    With `tuning_log`, scheduling starts by applying that MetaSchedule log (tvm_llm.tune),
    before our rules, and fills `tuning_report`. With `quantization` (a
    quantization.scheme.QuantScheme; `checkpoint_names` maps Relax parameter names to the
    checkpoint's, for --keep-float), fusion quantizes the linear layers after merging them;
    `quant_report` gets what was quantized."""
    from tvm import relax

    from .fold_casts import FoldCasts
    from .fold_identity_take import FoldIdentityTake
    from .fold_weights import LiftWeightTransforms
    from .fuse_rms_norm import FuseRMSNorm
    from .merge_parallel_linear import MergeParallelLinear
    from .unflatten_linear import UnflattenLinear

    entry = ["prefill", "decode", "hidden_states", "create_paged_kv_cache"]
    phases = {
        "import_cleanup": [relax.transform.CanonicalizeBindings(), FoldIdentityTake(), FoldCasts(),
                           relax.transform.EliminateCommonSubexpr(),
                           relax.transform.DeadCodeElimination(entry)],
        "fusion": [UnflattenLinear(), MergeParallelLinear(), FuseRMSNorm()]
                  + _quantize_passes(quantization, checkpoint_names, quant_report,
                                     target_spec)
                  + list(target_spec.graph_passes())
                  + [relax.transform.FuseTransposeMatmul()],
        "folding": [relax.transform.FoldConstant(), LiftWeightTransforms(),
                    relax.transform.CanonicalizeBindings(), relax.transform.DeadCodeElimination(entry + ["transform_params"])],
        "lowering": [relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(),
                     relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                     relax.transform.FoldConstant(), relax.transform.FuseOps(),
                     relax.transform.FuseTIR()],
        "scheduling": _tuning_passes(target_spec, tuning_log, tuning_report)
                      + list(target_spec.schedule_passes()),
        "finalize": _finalize_passes(target_spec),
    }
    optional = {"import_cleanup", "fusion", "folding", "scheduling"}
    return [(name, [] if (name in disabled and name in optional) else phases[name])
            for name in PHASES]


def _quantize_passes(quantization, checkpoint_names, report, target_spec) -> list:
    if quantization is None:
        return []
    from .quantize_linear import QuantizeLinear

    return [QuantizeLinear(quantization, checkpoint_names, report, target_spec)]


def _tuning_passes(target_spec, tuning_log, report) -> list:
    if not tuning_log:
        return []
    from ..tune.apply import tuning_log_pass

    return [tuning_log_pass(target_spec, tuning_log, report if report is not None else {})]


def _finalize_passes(target_spec) -> list:
    from tvm import relax

    from .lean_vm_calls import LeanVMCalls

    passes = [relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
              relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
              relax.transform.StaticPlanBlockMemory()]
    passes += target_spec.graph_capture_passes()  # needs the static plan's storages
    passes += [relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse(),
               relax.transform.LowerRuntimeBuiltin(), relax.transform.ComputePrimValue(),
               relax.transform.VMShapeLower(), LeanVMCalls(), relax.transform.AttachGlobalSymbol()]
    return passes


def run_pipeline(mod, target_spec, dump_dir: str | None = None,
                 disabled: frozenset = frozenset(), tuning_log: str | None = None,
                 stop_after: str | None = None, quantization=None,
                 checkpoint_names: dict | None = None):
    """Apply every phase; return (module, weight transforms, report).
    `tuning_log`: a MetaSchedule log directory applied first in "scheduling" (its report goes
    in that phase's entry, key "tuning"); `stop_after`: a phase name to stop after (the
    tuner extracts kernels after "lowering").

    After the folding phase (weight-only graph work) and the scheduling phase (weight packing
    chosen by the schedule rules) the lifted weight transform is taken out of the module: the
    build runs each, in order, once on the host (fold_weights.apply_weight_transform)."""
    import tvm

    from .fold_weights import split_weight_transform
    from .known_warnings import run_filtering_stderr

    report = []
    weight_transforms = []
    target = target_spec.tvm_target()
    tuning: dict = {}
    quant: dict = {}
    calls_before = sum(count_ops(mod).values())
    with target, tvm.transform.PassContext(opt_level=3, config=target_spec.pass_context_config()):
        for i, (name, passes) in enumerate(phase_passes(target_spec, disabled, tuning_log, tuning,
                                                                   quantization, checkpoint_names,
                                                                   quant)):
            t0 = time.perf_counter()
            pass_seconds = {}
            for p in passes:  # one at a time, so the report can say what each pass cost
                t_pass = time.perf_counter()
                mod = run_filtering_stderr(p, mod)  # less TVM's known harmless warnings
                key = p.info.name
                pass_seconds[key] = round(pass_seconds.get(key, 0) + time.perf_counter() - t_pass, 3)
            if name in ("folding", "scheduling"):
                mod, transform = split_weight_transform(mod)
                if transform is not None:
                    weight_transforms.append(transform)
            seconds = time.perf_counter() - t0
            ops = count_ops(mod)
            report.append({"phase": name, "seconds": round(seconds, 3),
                           "relax_calls_before": calls_before, "relax_calls": sum(ops.values()),
                           "skipped": not passes, "passes": pass_seconds})
            calls_before = sum(ops.values())
            if name == "fusion" and quantization is not None:
                report[-1]["quantization"] = quant
            if name == "scheduling" and tuning:
                report[-1]["tuning"] = tuning
            if dump_dir:
                os.makedirs(dump_dir, exist_ok=True)
                with open(os.path.join(dump_dir, f"{i}_{name}.py"), "w") as f:
                    f.write(mod.script(show_meta=False))
            if name == stop_after:
                return mod, weight_transforms, report
    report.append({"phase": "total", "seconds": round(sum(r["seconds"] for r in report), 3),
                   "relax_calls": report[-1]["relax_calls"], "skipped": False,
                   "decode_kernels": kernels_per_call(mod, "decode"),
                   "prefill_kernels": kernels_per_call(mod, "prefill")})
    if target_spec.graph_capture_passes():
        from .kernel_counts import capture_summary

        report[-1]["decode_graph_capture"] = capture_summary(mod, "decode")
    return mod, weight_transforms, report
