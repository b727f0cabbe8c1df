"""Tuning logs: MetaSchedule's JSON format, tolerant reading, locked concurrent appends, and
the build-side apply (with records made by hand: no tuning run needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

from toy import Toy
from tvm_llm.targets import get_target
from tvm_llm.tune.apply import TuningLogWarning, apply_tuning_log, normalize
from tvm_llm.tune.buckets import parse_buckets, specialize_buckets
from tvm_llm.tune.log import (RECORD_FILE, WORKLOAD_FILE, hw_key_of, make_tuning_log,
                              read_log)

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = get_target("llvm")
HW = SPEC.hw_key()


def static_kernels(sizes=(1, 2, 3)):
    """Static copies of the toy matmul, one per batch size: distinct workloads."""
    mod, _ = specialize_buckets(Toy, parse_buckets([f"decode:b={b}" for b in sizes]))
    return [mod[f"nt_matmul__b{b}"] for b in sizes]


def record(prim, secs=1e-4, target=None):
    """A tuning record with a small hand-made schedule (split the output columns by 8)."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.database import TuningRecord, Workload

    wl_mod = normalize(prim)
    sch = Schedule(wl_mod)
    _, j, _ = sch.get_loops(sch.get_sblock("mm"))
    sch.split(j, [None, 8])  # MetaSchedule ignores records whose trace does nothing
    return TuningRecord(sch.trace, Workload(wl_mod), [secs], target or SPEC.tvm_target(),
                        ArgInfo.from_prim_func(wl_mod["main"]))


def commit(db, rec):
    db.commit_workload(rec.workload.mod)
    db.commit_tuning_record(rec)


def test_appended_log_reads_back_and_is_metaschedule_format(tmp_path):
    d = str(tmp_path / "log")
    k1, k2, _ = static_kernels()
    db = make_tuning_log(d, HW)
    for secs in (3e-4, 1e-4, 2e-4):
        commit(db, record(k1, secs))
    commit(db, record(k2, 1e10))  # a failed measurement: counted, never applied
    warnings = []
    mem, n = read_log(d, HW, warnings.append)
    assert (n, warnings) == (3, [])
    assert make_tuning_log(d, HW).count(normalize(k1)) == 3  # what resume counts
    assert make_tuning_log(d, HW).count(normalize(k2)) == 1
    from tvm.s_tir.meta_schedule.database import JSONDatabase

    ms_db = JSONDatabase(work_dir=d, allow_missing=False)  # MetaSchedule reads our files
    assert len(ms_db.get_all_tuning_records()) == 4
    best = ms_db.get_top_k(ms_db.commit_workload(normalize(k1)), 1)[0]
    assert float(best.run_secs[0]) == pytest.approx(1e-4)


def test_bad_lines_are_named_and_skipped(tmp_path):
    d = str(tmp_path / "log")
    k1, k2, _ = static_kernels()
    db = make_tuning_log(d, HW)
    commit(db, record(k1))
    commit(db, record(k2))
    foreign = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]})
    rec_path = os.path.join(d, RECORD_FILE)
    lines = open(rec_path).read().splitlines()
    other = json.loads(lines[0])
    other[1] = record(k1, target=foreign).as_json()
    with open(rec_path, "a") as f:
        f.write("this is not json\n")  # line 3
        f.write(json.dumps([99, json.loads(lines[0])[1]]) + "\n")  # line 4: no such workload
        f.write(json.dumps(other) + "\n")  # line 5: tuned for another hardware key
        f.write(lines[1][: len(lines[1]) // 2])  # line 6: truncated by a killed writer
    warnings = []
    _, n = read_log(d, HW, warnings.append)
    assert n == 2
    text = "\n".join(warnings)
    assert f"{rec_path}:3: corrupt or truncated record" in text
    assert f"{rec_path}:4: record names workload line 100" in text
    assert f"(line 5) were tuned for cpu-aarch64-generic-neon, not {HW}" in text
    assert f"{rec_path}:6: corrupt or truncated record" in text
    assert hw_key_of(foreign) == "cpu-aarch64-generic-neon"
    # a tuner appending after the truncated line starts a fresh line: nothing else is lost
    commit(make_tuning_log(d, HW, warn=lambda m: None), record(k2, 5e-5))
    warnings = []
    _, n = read_log(d, HW, warnings.append)
    assert n == 3 and len(warnings) == 4


def test_garbage_or_missing_log_never_breaks_apply(tmp_path):
    d = tmp_path / "log"
    d.mkdir()
    (d / WORKLOAD_FILE).write_text('["123", "AAAA"]\n{not json\n')
    (d / RECORD_FILE).write_text('[0, [1, 2, 3]]\n\x00\x01garbage\n[1')
    said = []
    mod, report = apply_tuning_log(Toy, SPEC, str(d), warn=said.append)
    assert mod is Toy and report["kernels"] == []
    assert any(f"{d / WORKLOAD_FILE}:1: unreadable workload" in m for m in said)
    assert any(f"{d / WORKLOAD_FILE}:2: unreadable workload" in m for m in said)
    assert any("no usable tuning records" in m for m in said)
    said = []
    mod, report = apply_tuning_log(Toy, SPEC, str(tmp_path / "missing"), warn=said.append)
    assert mod is Toy and "no usable tuning records" in said[-1]
    with pytest.warns(TuningLogWarning, match="no usable tuning records"):
        apply_tuning_log(Toy, SPEC, str(tmp_path / "missing"))


def test_apply_uses_the_log_inside_its_bucket_only(tmp_path):
    d = str(tmp_path / "log")
    (k1,) = static_kernels((1,))
    commit(make_tuning_log(d, HW), record(k1, 2e-6))
    said = []
    mod, report = apply_tuning_log(Toy, SPEC, d, warn=said.append)
    assert said == []
    assert report["buckets"] == [{"bucket": "decode:b=1", "function": "decode__b1", "kernels": 1}]
    assert report["kernels"] == [{"kernel": "nt_matmul__b1", "generic": "nt_matmul",
                                  "bucket": "decode:b=1", "tuned_ms": 0.002}]
    assert mod["nt_matmul__b1"].attrs["tirx.is_scheduled"]
    assert "relu__b1" not in [gv.name_hint for gv in mod.get_global_vars()]  # no record: generic
    ex = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    w = np.random.default_rng(0).standard_normal((64, 32)).astype("float32")
    for b in (1, 3):
        x = np.random.default_rng(b).standard_normal((b, 32)).astype("float32")
        out = vm["decode"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(out, np.maximum(x @ w.T, 0), rtol=1e-5, atol=1e-5)


WRITER = """
import sys
sys.path.insert(0, {here!r})
from test_log import static_kernels, record, commit, HW
from tvm_llm.tune.log import make_tuning_log
shared, own = static_kernels((1, {size}))
db = make_tuning_log({d!r}, HW)
open({d!r} + "/ready-{size}", "w").close()
import os, time
while not all(os.path.exists({d!r} + f"/ready-{{s}}") for s in (2, 3)):
    time.sleep(0.01)
for i in range({n}):
    commit(db, record(shared if i % 2 else own, 1e-3 + i * 1e-6))
"""


def test_two_tuners_append_to_one_log_concurrently(tmp_path):
    d = str(tmp_path / "log")
    os.makedirs(d)
    n = 40
    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(here=HERE, d=d, size=s, n=n)],
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
             for s in (2, 3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    warnings = []
    mem, count = read_log(d, HW, warnings.append)
    assert (count, warnings) == (2 * n, [])
    wl = open(os.path.join(d, WORKLOAD_FILE)).read().splitlines()
    assert len(wl) == 3  # the shared kernel once, each own kernel once
    k1, k2, k3 = static_kernels()
    db = make_tuning_log(d, HW)
    assert [db.count(normalize(k)) for k in (k1, k2, k3)] == [n, n // 2, n // 2]
    from tvm.s_tir.meta_schedule.database import JSONDatabase

    assert len(JSONDatabase(work_dir=d, allow_missing=False).get_all_tuning_records()) == 2 * n


def test_generic_kernel_record_keeps_the_generic_kernel(tmp_path):
    """A kernel whose tuned records all lost to our rules' generic kernel gets no copy."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.database import TuningRecord

    from tvm_llm.tune.log import GENERIC_MARK, is_generic_record

    d = str(tmp_path / "log")
    k1, k2 = static_kernels((1, 2))
    db = make_tuning_log(d, HW)
    wl = normalize(k1)
    sch = Schedule(wl)
    sch.annotate(sch.get_sblock("root"), GENERIC_MARK, 1)
    generic = TuningRecord(sch.trace, db.commit_workload(wl), [1e-5], SPEC.tvm_target(),
                           record(k1).args_info)
    assert is_generic_record(generic) and not is_generic_record(record(k1))
    db.commit_tuning_record(generic)  # b=1: rules 10 us, tuned 20 us
    commit(db, record(k1, 2e-5))
    commit(db, record(k2, 1e-5))  # b=2: tuned, nothing to compare with
    assert db.count(wl) == 1  # the generic kernel's record is not a trial
    mod, report = apply_tuning_log(Toy, SPEC, d, warn=lambda m: None)
    assert report["generic_kept"] == 1
    assert [k["kernel"] for k in report["kernels"]] == ["nt_matmul__b2"]
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert "decode__b2" in names and "decode__b1" not in names


def test_hw_keys_name_the_cpu_model_and_isa():
    from tvm_llm.errors import UserError
    from tvm_llm.targets.llvm import host_cpu_name

    spr = get_target("llvm", arch="sapphirerapids").hw_key()
    zen = get_target("llvm", arch="x86_64:znver4").hw_key()
    hsw = get_target("llvm", arch="haswell").hw_key()
    assert (spr, zen, hsw) == ("cpu-x86_64-sapphirerapids-avx512", "cpu-x86_64-znver4-avx512",
                               "cpu-x86_64-haswell-avx2")
    assert get_target("llvm", arch="aarch64").hw_key() == "cpu-aarch64-generic-neon"
    assert get_target("llvm", arch="aarch64:neoverse-v1").hw_key() == "cpu-aarch64-neoverse-v1-neon"
    assert HW.startswith(f"cpu-{os.uname().machine}-{host_cpu_name()}")
    # a CPU name that lacks the AMX the host has (a VM masking a Xeon's model) keys apart
    masked = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                "mcpu": "rocketlake", "mattr": ["+amx-tile", "+amx-bf16"]})
    assert hw_key_of(masked) == "cpu-x86_64-rocketlake+amx-avx512"
    assert hw_key_of(get_target("llvm", arch="sapphirerapids").tvm_target()) == spr
    with pytest.raises(UserError, match="unknown --arch 'pentium9'"):
        get_target("llvm", arch="pentium9")


def test_closest_key_prefers_same_isa_then_vendor_line_then_old_keys():
    from tvm_llm.tune.log import closest_key

    have = ["cpu-x86_64-znver3-avx2", "cpu-x86_64-sapphirerapids-avx512", "cpu-x86_64-avx512",
            "cpu-x86_64-znver4-avx512", "cpu-aarch64-generic-neon"]
    assert closest_key("cpu-x86_64-znver5-avx512", have) == "cpu-x86_64-znver4-avx512"
    assert closest_key("cpu-x86_64-icelake-server-avx512",
                       [k for k in have if "sapphire" not in k]) == "cpu-x86_64-avx512"
    assert closest_key("cpu-x86_64-icelake-server-avx512", have[:2]) == \
        "cpu-x86_64-sapphirerapids-avx512"
    assert closest_key("cpu-x86_64-haswell-avx2", have) == "cpu-x86_64-znver3-avx2"
    assert closest_key("cpu-x86_64-haswell-avx2", have[1:]) is None  # no avx2 log: none fits


def test_build_falls_back_to_the_closest_log_and_says_so(tmp_path):
    """A log tuned on znver4 (its own key's directory) is used, with a note, by a build for
    sapphirerapids that has no log of its own; and an old-key directory still reads."""
    root = tmp_path / "autotune_logs"
    k1, _, _ = static_kernels()
    zen = get_target("llvm", arch="znver4")
    db = make_tuning_log(str(root / zen.hw_key()), zen.hw_key())
    commit(db, record(k1, target=zen.tvm_target()))
    spr = get_target("llvm", arch="sapphirerapids")
    said = []
    _, report = apply_tuning_log(Toy, spr, str(root), warn=said.append)
    assert report["records"] == 1 and report["log"].endswith("cpu-x86_64-znver4-avx512")
    text = "\n".join(said)
    assert "no tuning log for cpu-x86_64-sapphirerapids-avx512; using the closest one, " \
           "cpu-x86_64-znver4-avx512" in text
    assert "no records tuned for cpu-x86_64-sapphirerapids-avx512; using the 1 of the " \
           "closest key, cpu-x86_64-znver4-avx512" in text
    # the same records under an old-style directory name are found too
    os.rename(root / zen.hw_key(), root / "cpu-x86_64-avx512")
    said = []
    _, report = apply_tuning_log(Toy, zen, str(root), warn=said.append)
    assert report["records"] == 1 and report["log"].endswith("cpu-x86_64-avx512")
    assert not any("using the 1 of the closest" in m for m in said)  # records are znver4's own
    # a tuner never counts another CPU's records as its own trials
    assert make_tuning_log(str(root / "cpu-x86_64-avx512"), spr.hw_key(),
                           warn=lambda m: None).count(normalize(k1)) == 0


def test_search_never_seeds_from_marked_records(tmp_path):
    """The generic kernel's and the rule grid's records only mark the unscheduled kernel:
    MetaSchedule's search must not seed from them (it would measure the unscheduled kernel as a
    trial carrying the mark, which was then neither counted as a trial nor told apart from the
    grid point). A trial replayed from a mark, as older logs hold, is a plain trial."""
    from tvm.s_tir import Schedule
    from tvm.s_tir.meta_schedule.database import TuningRecord

    from tvm_llm.tune.log import GENERIC_MARK, RULE_GRID_MARK, is_trial_record
    from tvm_llm.tune.rule_grid import grid_label, grid_record, measured_labels

    d = str(tmp_path / "log")
    (k1,) = static_kernels((1,))
    wl_mod = normalize(k1)
    db = make_tuning_log(d, HW)
    wl = db.commit_workload(wl_mod)
    args = record(k1).args_info

    def marked(key, val, secs, replayed=False):
        sch = Schedule(wl_mod)
        sch.annotate(sch.get_sblock("root"), key, val)
        if replayed:
            sch.enter_postproc()  # what the search's replay of a marked record records
        return TuningRecord(sch.trace, wl, [secs], SPEC.tvm_target(), args)

    db.commit_tuning_record(grid_record(wl_mod, "GEMV 2x4", [1e-6], SPEC.tvm_target(), args))
    db.commit_tuning_record(marked(GENERIC_MARK, 1, 2e-6))
    replayed = marked(RULE_GRID_MARK, "GEMV 1x4", 3e-6, replayed=True)
    db.commit_tuning_record(replayed)
    commit(db, record(k1, 4e-6))
    assert grid_label(replayed) is None and is_trial_record(replayed)
    seeds = db.get_top_k(wl, 10)  # what EvolutionarySearch seeds its population from
    assert [float(r.run_secs[0]) for r in seeds] == [3e-6, 4e-6]
    assert len(db.get_top_k(wl, 1)) == 1
    assert [float(r.run_secs[0]) for r in db.ranked(wl)] == [1e-6, 2e-6, 3e-6, 4e-6]
    assert db.count(wl_mod) == 2 and make_tuning_log(d, HW).count(wl_mod) == 2
    assert measured_labels(db, wl) == {"GEMV 2x4"}
