"""`tvm-llm tune`: MetaSchedule + XGBoost over the model's kernels, into a per-hardware log.

    tune(model_dir, target="llvm", trials=32, log_dir="autotune_logs/cpu-x86_64-znver4-avx512")

1. import the checkpoint and run our pipeline up to its "lowering" phase (tvm_llm/front.py,
   with the build's configuration: dtype, batch sizes, quantization), so the kernels are
   exactly those the build compiles (same fusion, same weight layout, same quantized kernels);
2. add the static shape-bucket copies of the symbolic kernels (tvm_llm.tune.buckets; MetaSchedule
   aborts on symbolic extents) and extract them as tasks, deduplicated structurally
   (`ms.relax_integration.extract_tasks`);
3. tune them one kernel after the other, `trials` trials each minus what the log already has
   for that kernel (so an interrupted run resumes where it stopped), with the XGBoost cost
   model shared across kernels, measuring locally or on TVM RPC servers behind a tracker;
4. every measured record is appended to the log at once, under a file lock.

Figures printed per batch: trials done, the kernel's best latency, elapsed time and ETA.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ..errors import UserError
from .rule_grid import measure_rule_grid

DEFAULT_TRIALS = 32


def fast_build(mod, target, _params):
    """MetaSchedule's default_build minus ``import tvm.s_tir.tensor_intrin``, which costs each
    builder worker 30-90 s here (longer than the build timeout)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    if target.kind.name == "llvm":  # the build's CPU pipeline (register tiles over 1 KiB)
        from ..targets import get_target

        return tvm_build(mod, target=target, pipeline=get_target("llvm").tir_pipeline())
    return tvm_build(mod, target=target)


def make_builder(max_workers: int, timeout_sec: float = 60.0, should_stop=None):
    """MetaSchedule's LocalBuilder with our fast_build, on one worker pool kept for the whole
    run: LocalBuilder starts fresh worker processes for every batch, and each start (importing
    tvm) took longer here than building the batch."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
    from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class PooledBuilder(PyBuilder):
        def __init__(self):
            super().__init__()
            self.pool = None

        def build(self, build_inputs):
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt
            if self.pool is None:
                self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec)
            results = []
            for r in self.pool.map_with_error_catching(
                    lambda x: _worker_func(*x),
                    [(fast_build, None, b.mod, b.target, _serialize_params(b.params))
                     for b in build_inputs]):
                if r.status == StatusKind.COMPLETE:
                    results.append(BuilderResult(r.value, None))
                elif r.status == StatusKind.TIMEOUT:
                    results.append(BuilderResult(None, f"build timed out after {timeout_sec}s"))
                else:
                    results.append(BuilderResult(None, f"build failed: {r.value}"))
            return results

        def shutdown(self):
            if self.pool is not None:
                self.pool.shutdown()
                self.pool = None

    return PooledBuilder()


@contextlib.contextmanager
def light_tensor_intrin(target):
    """TuneContext imports all of ``tvm.s_tir.tensor_intrin`` (CUDA, ROCm, Hexagon... ~30 s of
    TVMScript parsing). For the span of a tuning run, stand in a package object with the real
    path so that only the submodule this target's rules need is loaded (x86: 0.5 s)."""
    import types

    import tvm.s_tir

    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    stub = types.ModuleType(name)
    stub.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
    sys.modules[name] = stub
    try:
        kind = target.kind.name
        triple = str(target.attrs.get("mtriple", "") or "")
        import importlib

        if kind == "llvm":
            importlib.import_module(name + (".arm_cpu" if triple.startswith("aarch64") else ".x86"))
        elif kind == "cuda":
            importlib.import_module(name + ".cuda")
        elif kind == "rocm":
            importlib.import_module(name + ".rocm")
        yield
    finally:  # the submodules stay loaded: their intrinsics are registered once per process
        if sys.modules.get(name) is stub:
            del sys.modules[name]


@dataclass
class KernelTask:
    name: str  # the static kernel's name in the module, e.g. NT_matmul__b1
    bucket: str  # e.g. decode:b=1
    weight: int  # calls per run of its function
    extracted: object  # ms ExtractedTask
    generic: object = None  # the symbolic kernel it is a copy of (what the build runs otherwise)
    done: int = 0  # records the log already had


def kernel_tasks(mod, spec, buckets, only=None, log=print) -> list[KernelTask]:
    """The static bucket kernels of `mod` as deduplicated MetaSchedule tasks, buckets in the
    given order. `only`: substrings; a kernel is kept if its name contains one of them."""
    from tvm.s_tir import meta_schedule as ms

    from .buckets import BUCKET_ATTR, is_static, specialize_buckets

    spec_mod, info = specialize_buckets(mod, buckets, log=log)
    generic_of = {k: v for i in info for k, v in i["kernels"].items()}
    tasks = ms.relax_integration.extract_tasks(spec_mod, spec.tvm_target())
    out = []
    for t in tasks:
        func = t.dispatched[0]["main"]
        bucket = (func.attrs or {}).get(BUCKET_ATTR)
        if bucket is None or not is_static(func):
            continue  # generic symbolic kernels: our rules schedule them
        if only and not any(s in t.task_name for s in only):
            continue
        if has_indirect_index(func):
            log(f"{t.task_name}: skipped (indexes memory with loaded values, e.g. an embedding "
                "lookup: random measurement inputs would read out of bounds)")
            continue
        generic = generic_of.get(t.task_name)
        out.append(KernelTask(t.task_name, str(bucket), int(t.weight), t,
                              spec_mod[generic] if generic else None))
    order = {str(b): i for i, b in enumerate(buckets)}
    out.sort(key=lambda k: order.get(k.bucket, len(order)))
    return out


def has_indirect_index(prim) -> bool:
    """True when a load or store index depends on another load (gather/scatter)."""
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad  # what tirx.BufferLoad(...) builds

    def loads(expr) -> bool:
        seen = []
        tvm_ffi.structural_walk(expr, [(TensorLoad, lambda n: seen.append(n))])
        return bool(seen)

    found = []

    def check(node):
        if any(loads(i) for i in node.indices):
            found.append(node)

    tvm_ffi.structural_walk(prim.body, [((TensorLoad, tirx.BufferStore), check)])
    return bool(found)


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fmt_ms(sec) -> str:
    return "-" if sec is None else (f"{sec * 1e3:.4f} ms" if sec < 0.01 else f"{sec * 1e3:.2f} ms")


@dataclass
class Progress:
    """Prints one line per measured batch: kernel, trials, its best latency, totals, ETA."""

    total: int
    emit: object = print
    done: int = 0
    start: float = field(default_factory=time.perf_counter)
    width: int = 24

    def line(self, idx: int, ntasks: int, task: KernelTask, trials: int, best) -> None:
        frac = self.done / self.total if self.total else 1.0
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        name = task.name if len(task.name) <= 40 else task.name[:18] + ".." + task.name[-20:]
        self.emit(f"[{bar}] {self.done}/{self.total} {frac:4.0%}  elapsed {_fmt_time(elapsed)} "
                  f"ETA {'-' if eta is None else _fmt_time(eta)} | kernel {idx}/{ntasks} {name} "
                  f"({task.bucket}) trial {trials}, best {_fmt_ms(best)}")


@contextlib.contextmanager
def _interruptible(log):
    """Ctrl-C stops the run after the batch being measured (its records are saved first);
    a second Ctrl-C stops at once. MetaSchedule's C++ loop would otherwise swallow it."""
    import signal
    import threading

    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(_sig, _frame):
        if flag["stop"]:
            raise KeyboardInterrupt
        flag["stop"] = True
        log("[tvm-llm] stopping after the batch being measured (Ctrl-C again to stop now)")

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


def _make_callback(progress: Progress, state: dict):
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class ProgressCallback(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            n = len(runner_results)
            progress.done += n
            state["trials"] += n
            for b, r in zip(builder_results, runner_results):
                secs = [float(s) for s in (r.run_secs or [])] if b.error_msg is None else []
                if r.error_msg is None and secs:
                    mean = sum(secs) / len(secs)
                    if mean < 1e9 and (state["best"] is None or mean < state["best"]):
                        state["best"] = mean
                else:
                    state["errors"] += 1
            progress.line(state["idx"], state["ntasks"], state["task"], state["trials"],
                          state["best"])
            if state["stop"]["stop"]:
                raise KeyboardInterrupt  # after AddToDatabase: this batch's records are saved

    return ProgressCallback()


def make_runner(rpc_tracker: str | None, rpc_key: str | None, flush: bool = True):
    """(MetaSchedule runner, description): local, or TVM's RPCRunner over the servers that
    registered `rpc_key` at the tracker HOST:PORT (one measurement at a time per server)."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(number=1 if flush else 3, repeat=5 if flush else 1,
                                          min_repeat_ms=0 if flush else 40,
                                          enable_cpu_cache_flush=flush)
    if not rpc_tracker:
        if rpc_key:
            raise UserError("--rpc-key needs --rpc-tracker HOST:PORT")
        return ms.runner.LocalRunner(timeout_sec=60, evaluator_config=evaluator), "local"
    host, _, port = rpc_tracker.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--rpc-tracker {rpc_tracker!r}: expected HOST:PORT")
    if not rpc_key:
        raise UserError("--rpc-tracker needs --rpc-key (the key the RPC servers registered with)")
    servers = rpc_servers(host, int(port), rpc_key)
    if servers == 0:
        raise UserError(f"no RPC server with key {rpc_key!r} is registered at tracker {rpc_tracker}")
    config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port), tracker_key=rpc_key,
                                 session_priority=1, session_timeout_sec=120)
    runner = ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator,
                                 max_workers=servers)
    return runner, f"RPC tracker {rpc_tracker}, key {rpc_key}, {servers} server(s)"


def rpc_servers(host: str, port: int, key: str) -> int:
    """Servers registered with `key` at the tracker (free or busy); raises UserError if the
    tracker does not answer."""
    import socket

    from tvm import rpc

    try:
        socket.create_connection((host, port), timeout=10).close()  # connect_tracker retries 60 s
        summary = rpc.connect_tracker(host, port).summary()
    except Exception as e:  # pylint: disable=broad-except
        raise UserError(f"cannot reach the RPC tracker at {host}:{port}: {e}") from None
    return sum(1 for server in summary.get("server_info", [])
               if str(server.get("key", "")) == f"server:{key}")


def tune(model_dir: str, config=None, *, trials: int = DEFAULT_TRIALS,
         log_dir: str | None = None, buckets=None, kernels=None, rpc_tracker: str | None = None,
         rpc_key: str | None = None, log=print, **options) -> dict:
    """Tune the kernels of `model_dir` into `log_dir` (default autotune_logs/<hw-key>), `trials`
    trials per kernel; returns a summary dict. Safe to interrupt and rerun: measured records
    are on disk, and each kernel only gets the trials it still lacks. `config`: the build's
    tvm_llm.config.BuildConfig (target, dtype, batch sizes, quantization: the kernels tuned
    are those that build compiles); `options`: BuildConfig fields by name (overriding
    `config`'s) and tune_module's options (trials_per_batch, builders, warmup_samples,
    cache_flush, seed, compare_generic, rule_grid)."""
    from dataclasses import fields

    from ..config import BuildConfig
    from ..front import lower
    from .buckets import DEFAULT_BUCKETS, parse_buckets

    names = {f.name for f in fields(BuildConfig)}
    build_options = {k: v for k, v in options.items() if k in names}
    options = {k: v for k, v in options.items() if k not in names}
    if config is None:
        config = BuildConfig.create(**build_options)
    elif build_options:
        config = config.with_options(**build_options)
    spec = config.spec
    if not isinstance(trials, int) or trials < 1:
        raise UserError(f"--trials must be a positive integer, got {trials!r}")
    try:
        buckets = parse_buckets(buckets or DEFAULT_BUCKETS)
    except ValueError as e:
        raise UserError(str(e)) from None
    runner = make_runner(rpc_tracker, rpc_key, options.get("cache_flush", True)
                         and spec.device_type == "cpu")  # fail early on a bad tracker
    mod = lower(model_dir, config, "lowering", log=log).mod
    return tune_module(mod, spec, buckets, trials=trials, log_dir=log_dir, kernels=kernels,
                       runner=runner, log=log, **options)


def tune_module(mod, spec, buckets, trials: int = DEFAULT_TRIALS, log_dir: str | None = None,
                kernels=None, runner=None, trials_per_batch: int = 16,
                builders: int | None = None, warmup_samples: int = 8, cache_flush: bool = True,
                seed: int = 0, compare_generic: bool = True, rule_grid: bool = True,
                log=print) -> dict:
    """Tune the static bucket kernels of a lowered module (see tune); `runner` is a
    (MetaSchedule runner, description) pair from make_runner, default local.
    compare_generic: first measure each kernel's generic version under our rules (recorded in
    the log, so the build keeps it where tuning did not beat it).
    rule_grid: then measure our matmul rules at every register tile of the CPU's row of
    schedules/cpu/microarch.py (tvm_llm.tune.rule_grid), recorded likewise."""
    from tvm.s_tir import meta_schedule as ms

    from .log import make_tuning_log

    hw_key = spec.hw_key()
    log_dir = log_dir or os.path.join("autotune_logs", hw_key)
    tvm_target = spec.tvm_target()
    runner, where = runner or make_runner(None, None, cache_flush and spec.device_type == "cpu")
    t0 = time.perf_counter()
    tasks = kernel_tasks(mod, spec, buckets, kernels, log=lambda m: log(f"[tvm-llm] {m}"))
    if not tasks:
        raise UserError("no kernel to tune (check --bucket and --kernels)")
    db = make_tuning_log(log_dir, hw_key, warn=lambda m: log(f"[tvm-llm] warning: {m}"))
    for t in tasks:
        t.done = db.count(t.extracted.dispatched[0])
    todo = [t for t in tasks if t.done < trials]
    total = sum(trials - t.done for t in todo)
    log(f"[tvm-llm] {len(tasks)} kernels in buckets {', '.join(map(str, buckets))} "
        f"(found in {time.perf_counter() - t0:.0f}s); log {log_dir} [{hw_key}]; "
        f"measuring on {where}")
    log(f"[tvm-llm] {trials} trials per kernel: {len(tasks) - len(todo)} kernels already done, "
        f"{total} trials to run over {len(todo)} kernels")
    summary = {"log_dir": log_dir, "hw_key": hw_key, "kernels": [], "trials_run": 0,
               "interrupted": False}
    num_threads = max(1, os.cpu_count() or 1)
    interrupt = _interruptible(log)
    stop = interrupt.__enter__()
    builder = make_builder(builders or min(2, num_threads), should_stop=lambda: stop["stop"])
    baseline = [t for t in tasks if compare_generic and t.generic is not None
                and _generic_seconds(db, t) is None]
    if baseline:
        log(f"[tvm-llm] measuring our rules' generic kernel at each size first ({len(baseline)} "
            "kernels): the build keeps it wherever no tuned schedule beats it")
    grid = [t for t in tasks if rule_grid and spec.device_type == "cpu"]
    try:
        for t in baseline:
            if stop["stop"]:
                raise KeyboardInterrupt
            measure_generic(t, spec, builder, runner, db, log)
        if grid:
            log("[tvm-llm] measuring our matmul rules at each register tile of the "
                f"{spec.tile_table_name()} row (schedules/cpu/microarch.py)")
        for t in grid:
            if stop["stop"]:
                raise KeyboardInterrupt
            measure_rule_grid(t, spec, builder, runner, db, log)
    except BaseException as e:
        builder.shutdown()
        interrupt.__exit__(None, None, None)
        if _is_interrupt(e) or stop["stop"]:  # the FFI may rewrap it as RuntimeError
            log(f"[tvm-llm] interrupted: every measured record is in {log_dir}; rerun the same "
                "command to resume")
            raise KeyboardInterrupt from None
        raise
    if not todo:
        builder.shutdown()
        interrupt.__exit__(None, None, None)
        summary["kernels"] = _kernel_summary(tasks, db)
        _print_summary(summary, log)
        return summary

    cost_model = ms.cost_model.XGBModel(num_warmup_samples=warmup_samples,
                                        num_tuning_cores=num_threads)
    progress = Progress(total=total, emit=log)
    state = {"trials": 0, "best": None, "errors": 0, "idx": 0, "ntasks": len(todo), "task": None,
             "stop": stop}
    callbacks = list(ms.measure_callback.MeasureCallback.create("default"))
    callbacks.append(_make_callback(progress, state))
    work = tempfile.mkdtemp(prefix="tvm-llm-tune-")
    try:
        with light_tensor_intrin(tvm_target):
            for i, task in enumerate(todo, 1):
                remaining = trials - task.done
                state.update(trials=task.done, best=_best_seconds(db, task), idx=i, task=task,
                             errors=0)
                log(f"[tvm-llm] kernel {i}/{len(todo)} {task.name} ({task.bucket}, "
                    f"{task.weight} call(s)): {remaining} trials"
                    + (f", resuming after {task.done}" if task.done else ""))
                ctx = ms.TuneContext(
                    mod=task.extracted.dispatched[0], target=tvm_target,
                    space_generator="post-order-apply",
                    search_strategy=ms.search_strategy.EvolutionarySearch(
                        population_size=256, init_min_unmeasured=32, genetic_num_iters=3),
                    task_name=task.name, rand_state=seed + i + task.done,
                    num_threads=num_threads).clone()
                ms.tune.tune_tasks(
                    tasks=[ctx], task_weights=[1.0], work_dir=work, max_trials_global=remaining,
                    max_trials_per_task=remaining,
                    num_trials_per_iter=min(trials_per_batch, remaining),
                    builder=builder, runner=runner, database=db, cost_model=cost_model,
                    measure_callbacks=callbacks, task_scheduler="round-robin")
                summary["trials_run"] = progress.done
                if state["trials"] < trials:
                    log(f"[tvm-llm]   {task.name}: MetaSchedule's search found no further "
                        f"distinct schedule after {state['trials']} trial(s); moving on")
    except BaseException as e:  # KeyboardInterrupt may arrive wrapped by the FFI
        if _is_interrupt(e) or stop["stop"]:  # the FFI may rewrap it as RuntimeError
            log(f"[tvm-llm] interrupted: every measured record is in {log_dir}; rerun the same "
                "command to resume")
            raise KeyboardInterrupt from None
        raise
    finally:
        import shutil

        builder.shutdown()
        interrupt.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
    summary["kernels"] = _kernel_summary(tasks, db)
    log(f"[tvm-llm] tuned {len(todo)} kernels, {progress.done} trials in "
        f"{_fmt_time(time.perf_counter() - progress.start)}; log {log_dir}")
    _print_summary(summary, log)
    return summary



def _is_interrupt(e: BaseException) -> bool:
    return isinstance(e, KeyboardInterrupt) or "KeyboardInterrupt" in f"{type(e).__name__} {e}"


def _print_summary(summary, log):
    log(f"  {'kernel':<60} {'bucket':<16} {'records':>7} {'tuned':>12} {'rules':>12} {'x':>6}")
    for k in summary["kernels"]:
        best, gen = k["best_seconds"], k["generic_seconds"]
        x = f"{gen / best:.2f}" if best and gen else "-"
        log(f"  {k['kernel'][:60]:<60} {k['bucket']:<16} {k['records']:>7} {_fmt_ms(best):>12} "
            f"{_fmt_ms(gen):>12} {x:>6}")


def measure_generic(task, spec, builder, runner, db, log):
    """Measure the generic kernel, scheduled by our rules, at the task's static sizes with the
    same builder and runner, and record it as a GENERIC_MARK record of the static kernel."""
    import tvm
    from tvm.s_tir import Schedule
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.database import TuningRecord

    from .log import GENERIC_MARK

    target = spec.tvm_target()
    static = task.extracted.dispatched[0]
    mod = tvm.IRModule({"main": task.generic.with_attr("global_symbol", "main")})
    try:
        with target, tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
            mod = tvm.transform.Sequential(list(spec.schedule_passes()))(mod)
        (built,) = builder.build([ms.builder.BuilderInput(mod, target)])
        if built.error_msg:
            raise RuntimeError(built.error_msg.strip().splitlines()[-1])
        args = ArgInfo.from_prim_func(static["main"])
        (future,) = runner.run([ms.runner.RunnerInput(built.artifact_path, spec.device_type, args)])
        result = future.result()
        if result.error_msg or not result.run_secs:
            raise RuntimeError((result.error_msg or "no result").strip().splitlines()[-1])
    except Exception as e:  # pylint: disable=broad-except
        log(f"[tvm-llm]   could not measure the generic kernel ({str(e)[:160]}); "
            "tuned schedules are compared with nothing")
        return None
    sch = Schedule(static)
    sch.annotate(sch.get_sblock("root"), GENERIC_MARK, 1)
    wl = db.commit_workload(static)
    db.commit_tuning_record(TuningRecord(sch.trace, wl, [float(x) for x in result.run_secs],
                                         target, args))
    return sum(float(x) for x in result.run_secs) / len(result.run_secs)


def _generic_seconds(db, task):
    from .log import is_generic_record, mean_seconds

    wl = db.commit_workload(task.extracted.dispatched[0])
    for rec in db.ranked(wl):
        if is_generic_record(rec):
            return mean_seconds(rec)
    return None


def _best_seconds(db, task):
    """Best tuned (not generic) seconds of the task's kernel in the log."""
    from .log import is_generic_record, mean_seconds

    wl = db.commit_workload(task.extracted.dispatched[0])
    for rec in db.ranked(wl):
        if not is_generic_record(rec):
            return mean_seconds(rec)
    return None


def _kernel_summary(tasks, db) -> list:
    return [{"kernel": t.name, "bucket": t.bucket, "calls": t.weight,
             "records": db.count(t.extracted.dispatched[0]), "best_seconds": _best_seconds(db, t),
             "generic_seconds": _generic_seconds(db, t)} for t in tasks]
