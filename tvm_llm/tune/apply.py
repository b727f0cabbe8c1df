"""Apply a tuning log at build time: the first pass of the pipeline's "scheduling" phase.

1. read the log (tvm_llm.tune.log.read_log: bad or foreign lines are warned about, skipped);
2. add the shape-bucket copies the log has kernels for (tvm_llm.tune.buckets), keeping only
   static kernels with a record;
3. replace every PrimFunc that has a record by the log's best schedule, marked
   ``tirx.is_scheduled`` so that our rules and dlight, which run next, leave it alone.

What MetaSchedule's ``MetaScheduleApplyDatabase`` does, one kernel at a time so that a record
that fails to replay costs a warning and that kernel's default schedule, not the build.
"""
from __future__ import annotations

import warnings

from .buckets import BUCKET_ATTR, parse_buckets, specialize_buckets
from .log import is_generic_record, mean_seconds, read_log, resolve_log_dir
from .rule_grid import grid_label, schedule_at


class TuningLogWarning(UserWarning):
    """A tuning log line or record that the build skipped."""


def _warn_default(message: str) -> None:
    warnings.warn(message, TuningLogWarning, stacklevel=2)


def normalize(prim):
    """The workload module MetaSchedule keys a PrimFunc by (what task extraction stores)."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(prim)


def log_buckets(db) -> list:
    """The shape buckets the kernels of a database were tuned for, in first-seen order."""
    seen = []
    for rec in db.get_all_tuning_records():
        func = rec.workload.mod["main"]
        b = (func.attrs or {}).get(BUCKET_ATTR)
        if b is not None and str(b) not in seen:
            seen.append(str(b))
    return parse_buckets(seen)


def apply_tuning_log(mod, target_spec, log_dir: str, warn=None):
    """(module with the log applied, report dict). Never raises on a bad log."""
    import tvm
    from tvm.tirx import PrimFunc

    warn = warn or _warn_default
    target = target_spec.tvm_target()
    hw_key = target_spec.hw_key()
    messages = []

    def note(msg):
        messages.append(msg)
        warn(msg)

    log_dir = resolve_log_dir(log_dir, hw_key, note)

    report = {"log": log_dir, "hw_key": hw_key, "records": 0, "buckets": [], "kernels": [],
              "warnings": messages}
    db, n = read_log(log_dir, hw_key, note, fallback=True)
    report["records"] = n
    if n == 0:
        note(f"{log_dir}: no usable tuning records for {hw_key}; building with default schedules")
        return mod, report

    generic_won = []

    def best_record(prim, name="main"):
        wl = normalize(prim)
        if not db.has_workload(wl):
            return None
        return db.query_tuning_record(wl, target, name)

    def has_record(prim) -> bool:
        """Use a static copy when the log has a schedule for it that beat the generic kernel."""
        try:
            rec = best_record(prim)
        except Exception:  # pylint: disable=broad-except
            return False
        if rec is not None and is_generic_record(rec):
            generic_won.append(str((prim.attrs or {}).get(BUCKET_ATTR)))
            return False
        return rec is not None

    buckets = log_buckets(db)
    try:
        mod, info = specialize_buckets(mod, buckets, keep=has_record, log=note)
    except Exception as e:  # pylint: disable=broad-except
        note(f"{log_dir}: shape buckets {', '.join(map(str, buckets))} not applied "
             f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}); "
             "tuned static kernels are not used")
        info = []
    report["buckets"] = [{"bucket": i["bucket"], "function": i["function"],
                          "kernels": len(i["kernels"])} for i in info]
    report["generic_kept"] = len(generic_won)  # tuned, but our rules' kernel measured faster
    generic_of = {k: v for i in info for k, v in i["kernels"].items()}

    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, PrimFunc) or (func.attrs or {}).get("tirx.is_scheduled"):
            continue
        wl = normalize(func)
        try:
            if not db.has_workload(wl):
                continue
            rec = db.query_tuning_record(wl, target, gv.name_hint)
            sch = db.query_schedule(wl, target, gv.name_hint)
        except Exception as e:  # pylint: disable=broad-except
            note(f"{log_dir}: the record for kernel {gv.name_hint} does not apply "
                 f"({str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__}); "
                 "default schedule used")
            continue
        if sch is None or rec is None or is_generic_record(rec):
            continue
        label = grid_label(rec)
        if label is not None:  # our rule at a measured tile (tvm_llm.tune.rule_grid)
            try:
                sch = schedule_at(wl, target_spec, label)
            except Exception:  # pylint: disable=broad-except
                sch = None
            if sch is None:
                note(f"{log_dir}: rule grid point {label} no longer applies to kernel "
                     f"{gv.name_hint}; default schedule used")
                continue
        new = sch.mod["main"]
        for key, value in (func.attrs or {}).items():
            new = new.with_attr(key, value)
        updates[gv] = new.with_attr("tirx.is_scheduled", True)
        secs = mean_seconds(rec)
        attrs = func.attrs or {}
        entry = {
            "kernel": gv.name_hint, "generic": generic_of.get(gv.name_hint, gv.name_hint),
            "bucket": str(attrs[BUCKET_ATTR]) if BUCKET_ATTR in attrs else None,
            "tuned_ms": None if secs is None else round(secs * 1e3, 4)}
        if label is not None:
            entry["rule_grid"] = label  # our rule at this measured tile
        report["kernels"].append(entry)
    if updates:
        mod = mod.clone()
        for gv, new in updates.items():
            mod.update_func(gv, new)
    return mod, report


def tuning_log_pass(target_spec, log_dir: str, report: dict, warn=None):
    """The module pass the pipeline runs first in its "scheduling" phase; fills `report`."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="tvm_llm.ApplyTuningLog")
    def apply(mod, _ctx):
        new, rep = apply_tuning_log(mod, target_spec, log_dir, warn)
        report.update(rep)
        return new

    return apply
