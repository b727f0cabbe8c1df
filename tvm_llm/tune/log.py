"""Tuning logs: MetaSchedule JSON databases, one directory per hardware key.

    autotune_logs/<hw-key>/database_workload.json       one workload a line: [hash, module]
    autotune_logs/<hw-key>/database_tuning_record.json  one record a line: [workload line, record]

This is MetaSchedule's own JSONDatabase format (ms.database.JSONDatabase reads it), written
and read by our code so that

* reading never crashes: a corrupt or truncated line, a record that names a missing
  workload, a record whose trace does not parse, or one tuned for another hardware key gives
  a warning naming the file and line, and is skipped;
* several tuners can append to one directory at once: every append happens under an
  exclusive ``fcntl.flock`` on ``<dir>/.lock``, after re-reading the workload lines others
  appended, so record lines always point at the right workload line (MetaSchedule's
  JSONDatabase indexes workloads by the line it saw when it started, which two writers break);
* records are appended as they are measured, so an interrupted run loses nothing and the
  next run counts what each kernel already has.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
LOCK_FILE = ".lock"
FAILED_SECONDS = 1e9  # MetaSchedule stores failed measurements as 1e10 s


_HW_KEYS: dict = {}


def hw_key_of(target) -> str:
    """The hardware key of a tvm Target, as TargetSpec.hw_key() names it:
    cpu-x86_64-znver4-avx512, cuda-sm_90, rocm-gfx942."""
    text = str(target)
    if text not in _HW_KEYS:
        _HW_KEYS[text] = _hw_key_of(target)
    return _HW_KEYS[text]


def _hw_key_of(target) -> str:
    kind = target.kind.name
    attrs = target.attrs
    if kind == "llvm":
        from ..targets.llvm import llvm_hw_key

        return llvm_hw_key(target)
    if kind == "cuda":
        return f"cuda-{attrs.get('arch', '')}"
    if kind == "rocm":
        return f"rocm-{attrs.get('mcpu', '')}"
    return kind


# CPU models of one vendor's line: a log tuned on one is a closer guess for another of the same
# line (similar pipes and caches) than one from the other vendor's
_CPU_FAMILIES = (("znver", "amd"), ("bdver", "amd"), ("btver", "amd"))


def _cpu_family(cpu: str | None) -> str | None:
    if not cpu or cpu == "generic":
        return None
    for prefix, family in _CPU_FAMILIES:
        if cpu.startswith(prefix):
            return family
    return "other"  # Intel / Arm names: no shared prefix to go by


def parse_hw_key(key: str):
    """(kind, arch, cpu, isa) of a cpu key, cpu None for the keys made before CPU models were
    part of it (cpu-x86_64-avx512); None for other kinds of key."""
    parts = str(key).split("-")
    if len(parts) < 3 or parts[0] != "cpu":
        return None
    arch, isa = parts[1], parts[-1]
    cpu = "-".join(parts[2:-1]) or None
    return "cpu", arch, cpu, isa


def key_distance(wanted: str, have: str) -> int | None:
    """How far the log key `have` is from the build's key `wanted`: 0 the same, None when a log
    of `have` does not fit (another instruction set or SIMD width), else larger = less alike:
    1 same vendor line (znver3 for znver4), 2 an old key without CPU model, 3 another CPU."""
    if wanted == have:
        return 0
    w, h = parse_hw_key(wanted), parse_hw_key(have)
    if w is None or h is None or w[1] != h[1] or w[3] != h[3]:
        return None
    if h[2] is None:
        return 2
    fam = _cpu_family(w[2])
    return 1 if fam not in (None, "other") and fam == _cpu_family(h[2]) else 3


def closest_key(wanted: str, keys) -> str | None:
    """The key of `keys` nearest to `wanted` (key_distance), ties by name; None if none fits."""
    scored = sorted((d, k) for k in set(keys) if (d := key_distance(wanted, k)) is not None)
    return scored[0][1] if scored else None


GENERIC_MARK = "tvm_llm.generic_kernel"


RULE_GRID_MARK = "tvm_llm.rule_grid"


def marked_label(record, key: str) -> str | None:
    """The value `key` annotates the root block with when the record's trace is exactly that
    mark (the records the tuner makes itself: GENERIC_MARK, RULE_GRID_MARK), else None.
    A MetaSchedule trial replayed from such a record (the unscheduled kernel plus the mark and
    an EnterPostproc, as older logs hold) is a trial like any other, not the marked kernel."""
    try:
        insts = list(record.trace.insts)
        if [i.kind.name for i in insts] != ["GetSBlock", "Annotate"]:
            return None
        if str(insts[1].attrs[0]) != key:
            return None
        val = insts[1].inputs[1]
        return str(getattr(val, "value", val))
    except Exception:  # pylint: disable=broad-except
        return None


def is_generic_record(record) -> bool:
    """A record of how fast the generic kernel (our rules' schedule of the symbolic kernel) ran
    at the bucket's size: its trace only annotates the root block with GENERIC_MARK. When it is
    a kernel's best record, the build keeps the generic kernel for that bucket."""
    return marked_label(record, GENERIC_MARK) is not None


def is_trial_record(record) -> bool:
    """A MetaSchedule trial: neither the generic kernel's measurement nor a rule-grid point
    (tvm_llm.tune.rule_grid), which the tuner measures on its own."""
    return not is_generic_record(record) and marked_label(record, RULE_GRID_MARK) is None


def mean_seconds(record) -> float | None:
    """Mean measured seconds of a record, None for a failed or unmeasured one."""
    secs = [float(s) for s in (record.run_secs or [])]
    if not secs:
        return None
    mean = sum(secs) / len(secs)
    return None if mean >= FAILED_SECONDS else mean


def log_files(log_dir: str) -> tuple[str, str]:
    return os.path.join(log_dir, WORKLOAD_FILE), os.path.join(log_dir, RECORD_FILE)


def has_log(log_dir: str) -> bool:
    return any(os.path.isfile(p) for p in log_files(log_dir))


def resolve_log_dir(path: str, hw_key: str, warn=None) -> str:
    """`path` itself when it holds a log, else `path/<hw_key>` when that does (so both
    --tuning-log autotune_logs and --tuning-log autotune_logs/cpu-x86_64-znver4-avx512 work),
    else the subdirectory of `path` whose key is closest to `hw_key` (key_distance: same ISA,
    preferably the same vendor's line, then an old-style key), with a note to `warn` saying so."""
    if has_log(path) or not os.path.isdir(path):
        return path
    if has_log(os.path.join(path, hw_key)):
        return os.path.join(path, hw_key)
    keys = [d for d in os.listdir(path) if has_log(os.path.join(path, d))]
    best = closest_key(hw_key, keys)
    if best is None:
        return path
    if warn:
        warn(f"{path}: no tuning log for {hw_key}; using the closest one, {best} (tuned on "
             "another CPU: its schedules are valid here but may not be the fastest)")
    return os.path.join(path, best)


@contextlib.contextmanager
def _locked(log_dir: str):
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, LOCK_FILE), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


class _Reader:
    """Parses the two files line by line, collecting warnings instead of raising."""

    def __init__(self, log_dir: str, hw_key: str | None, warn):
        self.log_dir, self.hw_key, self.warn = log_dir, hw_key, warn
        self.wl_path, self.rec_path = log_files(log_dir)
        self.workloads = []  # line index -> Workload or None (bad line)
        self.hashes = []  # line index -> structural hash string or None
        self.wl_offset = 0

    def read_workloads(self):
        """Parse the workload lines appended since the last call."""
        from tvm.s_tir.meta_schedule.database import Workload

        if not os.path.isfile(self.wl_path):
            return
        with open(self.wl_path, "rb") as f:
            f.seek(self.wl_offset)
            data = f.read()
        complete = data.rfind(b"\n") + 1  # a line without its newline is still being written
        for raw in data[:complete].split(b"\n")[:-1]:
            lineno = len(self.workloads) + 1
            wl, h = None, None
            try:
                obj = json.loads(raw.decode("utf-8"))
                wl = Workload.from_json(obj)
                h = str(obj[0])
            except Exception as e:  # pylint: disable=broad-except
                self.warn(f"{self.wl_path}:{lineno}: unreadable workload ({_short(e)}); "
                          "its records are skipped")
            self.workloads.append(wl)
            self.hashes.append(h)
        self.wl_offset += complete

    def read_records(self, on_record, fallback=False):
        """on_record(lineno, record) for every record line that parses and fits the hw key.
        With `fallback`, when no record has the exact key, the records of the closest key
        (key_distance) are used instead, with a note saying so."""
        from tvm.s_tir.meta_schedule.database import TuningRecord

        if not os.path.isfile(self.rec_path):
            return 0
        other = {}
        n = 0
        with open(self.rec_path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{self.rec_path}:{lineno}"
                try:
                    obj = json.loads(raw.decode("utf-8"))
                    idx = int(obj[0])
                except Exception as e:  # pylint: disable=broad-except
                    self.warn(f"{where}: corrupt or truncated record ({_short(e)}); skipped")
                    continue
                if not 0 <= idx < len(self.workloads):
                    self.warn(f"{where}: record names workload line {idx + 1}, which "
                              f"{self.wl_path} does not have; skipped")
                    continue
                if self.workloads[idx] is None:
                    continue  # already warned about the workload line
                try:
                    rec = TuningRecord.from_json(obj[1], self.workloads[idx])
                except Exception as e:  # pylint: disable=broad-except
                    self.warn(f"{where}: unreadable record ({_short(e)}); skipped")
                    continue
                if self.hw_key is not None:
                    key = hw_key_of(rec.target) if rec.target is not None else None
                    if key != self.hw_key:
                        other.setdefault(key, []).append((lineno, rec))
                        continue
                on_record(lineno, rec)
                n += 1
        best = closest_key(self.hw_key, [k for k in other if k]) if fallback and n == 0 else None
        if best is not None:
            self.warn(f"{self.rec_path}: no records tuned for {self.hw_key}; using the "
                      f"{len(other[best])} of the closest key, {best} (another CPU: valid "
                      "schedules here, maybe not the fastest)")
            for lineno, rec in other.pop(best):
                on_record(lineno, rec)
                n += 1
        for key, lines in other.items():
            nums = [x for x, _ in lines]
            shown = ", ".join(str(x) for x in nums[:5]) + (" ..." if len(nums) > 5 else "")
            self.warn(f"{self.rec_path}: {len(nums)} record(s) (line {shown}) were tuned for "
                      f"{key}, not {self.hw_key}; skipped")
        return n


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:160]


def read_log(log_dir: str, hw_key: str | None, warn=None, fallback: bool = False):
    """(MemoryDatabase of the valid, successfully measured records, number of such records).
    Never raises on bad content; `warn(message)` hears about every line it skipped.
    `fallback`: use the records of the closest hardware key when none has `hw_key` (a build
    may; a tuner counting its own trials must not)."""
    from tvm.s_tir.meta_schedule.database import MemoryDatabase

    warn = warn or (lambda msg: None)
    db = MemoryDatabase()
    reader = _Reader(log_dir, hw_key, warn)
    try:
        reader.read_workloads()
    except OSError as e:
        warn(f"{reader.wl_path}: cannot read ({e}); no tuning records used")
        return db, 0

    def add(lineno, rec):
        if mean_seconds(rec) is None:
            return
        try:
            db.commit_workload(rec.workload.mod)
            db.commit_tuning_record(rec)
        except Exception as e:  # pylint: disable=broad-except
            warn(f"{reader.rec_path}:{lineno}: record not usable ({_short(e)}); skipped")

    try:
        reader.read_records(add, fallback=fallback)
    except OSError as e:
        warn(f"{reader.rec_path}: cannot read ({e}); no tuning records used")
    return db, len(db)


def make_tuning_log(log_dir: str, hw_key: str, warn=None):
    """A MetaSchedule Database over `log_dir` for tuning: it holds every record already there
    (failed ones too, so trials are counted) and appends new ones under the lock."""
    from tvm.s_tir.meta_schedule.database import MemoryDatabase, PyDatabase
    from tvm.ir.utils import derived_object

    warn = warn or (lambda msg: None)

    @derived_object
    class TuningLog(PyDatabase):
        def __init__(self):
            super().__init__()
            self.log_dir = log_dir
            self.mem = MemoryDatabase()
            self.reader = _Reader(log_dir, hw_key, warn)
            self.counts = {}  # workload structural hash -> records in the log
            with _locked(log_dir):
                self.reader.read_workloads()
                self.reader.read_records(self._load)

        def _load(self, lineno, rec):
            self.mem.commit_workload(rec.workload.mod)
            self.mem.commit_tuning_record(rec)
            if is_trial_record(rec):
                h = str(rec.workload.as_json()[0])
                self.counts[h] = self.counts.get(h, 0) + 1

        def count(self, mod) -> int:
            """Tuning trials (measured or failed records, not the generic kernel's) the log has
            for the workload `mod`."""
            from tvm.s_tir.meta_schedule.database import Workload

            return self.counts.get(str(Workload(mod).as_json()[0]), 0)

        # -- the Database interface -----------------------------------------------------
        def has_workload(self, mod):
            return self.mem.has_workload(mod)

        def commit_workload(self, mod):
            return self.mem.commit_workload(mod)

        def commit_tuning_record(self, record):
            self.mem.commit_tuning_record(record)
            self._append(record)

        def get_top_k(self, workload, top_k):
            """MetaSchedule's search seeds its population from these: only its own trials.
            A marked record's trace (generic kernel, grid point) replays as the unscheduled
            kernel, which the search would then measure as a trial carrying the mark."""
            ranked = self.mem.get_top_k(workload, 1 << 30)
            return [r for r in ranked if is_trial_record(r)][:top_k]

        def ranked(self, workload):
            """Every record of `workload`, fastest first, marked ones included."""
            return self.mem.get_top_k(workload, 1 << 30)

        def get_all_tuning_records(self):
            return self.mem.get_all_tuning_records()

        def query_tuning_record(self, mod, target, workload_name=None):
            return self.mem.query_tuning_record(mod, target, workload_name)

        def query_schedule(self, mod, target, workload_name=None):
            return self.mem.query_schedule(mod, target, workload_name)

        def query_ir_module(self, mod, target, workload_name=None):
            return self.mem.query_ir_module(mod, target, workload_name)

        def __len__(self):
            return len(self.mem)

        # -- appending ----------------------------------------------------------------------
        def _append(self, record):
            import tvm_ffi

            wl_json = record.workload.as_json()
            h = str(wl_json[0])
            with _locked(self.log_dir):
                self.reader.read_workloads()  # lines other tuners appended meanwhile
                idx = None
                for i, (hh, wl) in enumerate(zip(self.reader.hashes, self.reader.workloads)):
                    if hh == h and wl is not None and tvm_ffi.structural_equal(
                            wl.mod, record.workload.mod):
                        idx = i
                        break
                if idx is None:
                    _append_line(self.reader.wl_path, json.dumps(wl_json))
                    self.reader.read_workloads()
                    idx = len(self.reader.workloads) - 1
                _append_line(self.reader.rec_path, json.dumps([idx, record.as_json()]))
            if is_trial_record(record):
                self.counts[h] = self.counts.get(h, 0) + 1

    return TuningLog()


def _append_line(path: str, line: str) -> None:
    """Append one line in one write; first end a line a killed writer left unterminated."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        prefix = b""
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    prefix = b"\n"
        os.write(fd, prefix + line.encode("utf-8") + b"\n")
    finally:
        os.close(fd)
