"""Our own search space for our matmul rules: every register tile of the target CPU's row of
schedules/cpu/microarch.py (the target's `rule_grid`, schedules/cpu/tile_grid.py), measured
on the machine.

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


def grid_record(mod, label: str, run_secs, target, args):
    """The log record of grid point `label` of workload `mod`: a trace that only marks it."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

    sch = Schedule(mod)
    sch.annotate(sch.get_sblock("root"), RULE_GRID_MARK, label)
    return TuningRecord(sch.trace, Workload(mod), run_secs, target, args)


def schedule_at(mod, target_spec, label: str):
    """Our rule's schedule of workload `mod` at grid point `label`, or None."""
    points = target_spec.rule_grid(mod, only=label)
    return points[0][1] if points else None


def measured_labels(db, wl) -> set:
    """Grid points the tuning log `db` (make_tuning_log) already has for workload `wl`."""
    return {lab for rec in db.ranked(wl) if (lab := grid_label(rec))}


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
        points = [(lab, sch) for lab, sch in spec.rule_grid(static) if lab not in done]
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
