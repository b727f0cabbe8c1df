"""Our own search space for our matmul rules: every register tile of the target CPU's row of
schedules/cpu/microarch.py, measured on the machine.

MetaSchedule's generic CPU space does not reach our hand-written matmul schedules (no rfactor
for large spatial extents, no weight layout rewrite), so tuning it alone never corrects a tile
table row that was reasoned rather than measured. For each static matmul kernel the tuner
schedules it with our rule at each tile of the row (a handful of points), measures them like
any trial, and appends each to the log as a record whose trace only annotates the root block
with ``RULE_GRID_MARK = "GEMV 4x3"`` (our schedules' own traces hold IndexMaps, which
MetaSchedule's record JSON cannot write). The build (tvm_llm/tune/apply.py) re-schedules a
kernel whose best record is a grid point with our rule at that tile. Grid records are not
counted as MetaSchedule trials and are not measured twice; the build uses whichever record is
fastest: a grid point, a MetaSchedule schedule or the rules' default (the generic kernel).
"""
from __future__ import annotations

from .log import RULE_GRID_MARK, marked_label


def grid_label(record) -> str | None:
    """The grid point a record measured ("GEMV 4x3"), None for other records."""
    return marked_label(record, RULE_GRID_MARK)


def grid_schedules(mod, target, only: str | None = None) -> list:
    """[(label, Schedule)] of the static kernel `mod` ("main") under our matmul rules, one per
    tile of the target's microarch row (only the point labelled `only`, if given); [] when no
    matmul rule claims it."""
    from schedules.cpu import common, microarch
    from schedules.cpu.gemm import GEMM
    from schedules.cpu.gemv import GEMV, gemv_tile

    func = mod["main"]
    if not common.is_llvm_cpu(target):
        return []
    row = microarch.tile_row(target)
    out, seen = [], set()
    with target:
        if GEMM().apply(func, target, False) is not None:
            points = [("GEMM", t, GEMM(tile=t)) for t in row.gemm]
        elif GEMV().apply(func, target, False) is not None:
            prepared = common.prepare_matmul(func, allow_computed_b=True)
            pat = prepared[1]
            _, _, lanes = gemv_tile(target, pat.N, pat.K, pat.dtype, pat.decode_like)
            tiles = row.gemv_decode if pat.decode_like else row.gemv_prefill
            points = [("GEMV", t, GEMV(tile=(t[0], t[1], lanes))) for t in tiles
                      if pat.N % t[1] == 0
                      and t[0] * t[1] * lanes * 4 < common.MAX_STACK_BYTES]
        else:
            return []
        for kind, tile, rule in points:
            label = f"{kind} {tile[0]}x{tile[1]}"
            if label in seen or (only is not None and label != only):
                continue
            sch = rule.apply(func, target, False)
            if sch is None:
                continue
            seen.add(label)
            out.append((label, sch))
    return out


def grid_record(mod, label: str, run_secs, target, args):
    """The log record of grid point `label` of workload `mod`: a trace that only marks it."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

    sch = Schedule(mod)
    sch.annotate(sch.get_sblock("root"), RULE_GRID_MARK, label)
    return TuningRecord(sch.trace, Workload(mod), run_secs, target, args)


def schedule_at(mod, target, label: str):
    """Our rule's schedule of workload `mod` at grid point `label`, or None."""
    points = grid_schedules(mod, target, only=label)
    return points[0][1] if points else None


def measured_labels(db, wl) -> set:
    """Grid points the log already has for workload `wl`."""
    return {lab for rec in db.get_top_k(wl, 1 << 20) if (lab := grid_label(rec))}


def measure_rule_grid(task, spec, builder, runner, db, log) -> dict:
    """Measure every not yet measured grid point of the task's static kernel; append each as
    a record. Returns {label: mean seconds or None (failed)}."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    target = spec.tvm_target()
    static = task.extracted.dispatched[0]
    wl = db.commit_workload(static)
    done = measured_labels(db, wl)
    try:
        points = [(lab, sch) for lab, sch in grid_schedules(static, target) if lab not in done]
    except Exception as e:  # pylint: disable=broad-except
        log(f"[tvm-llm]   rule grid not available for {task.name} ({str(e)[:120]})")
        return {}
    if not points:
        return {}
    args = ArgInfo.from_prim_func(static["main"])
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, sch in points])
    results = {}
    for (label, sch), b in zip(points, built):
        secs = None
        if not b.error_msg:
            (future,) = runner.run([ms.runner.RunnerInput(b.artifact_path, spec.device_type,
                                                          args)])
            res = future.result()
            if not res.error_msg and res.run_secs:
                secs = [float(x) for x in res.run_secs]
        run_secs = secs or [1e10]  # MetaSchedule's mark of a failed measurement
        rec = grid_record(static, label, run_secs, target, args)
        db.commit_tuning_record(rec)
        results[label] = None if secs is None else sum(secs) / len(secs)
    shown = ", ".join(f"{k} {v * 1e3:.3f} ms" if v else f"{k} failed" for k, v in results.items())
    log(f"[tvm-llm]   {task.name} ({task.bucket}) rule grid: {shown}")
    return results
