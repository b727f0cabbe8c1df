"""Weight quantization started early: the build's quantizer running beside trace and passes.

The build quantizes its weights in the lifted weight transform (kernels.quantize_weight), which
runs only after tracing and the passes: ~15 s of mostly single-threaded work on the llama-1b
shape, while the quantizer (formats.py) could keep the other core busy. As soon as calibration
has fixed the weights and the plan, `start` quantizes every linear the plan stores (its merged
matrix: q|k|v, gate|up) in one background thread, in the order the transform asks for them.
`take` hands a result to the transform when it is the same computation: the same format and
importance, and a weight equal element by element to the matrix quantized here (else the
transform quantizes it itself, so a mismatch costs time, never a wrong weight).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .formats import get_format

_LOCK = threading.Lock()
_PENDING: dict = {}  # key (sorted checkpoint names, comma-joined) -> (fmt, importance, sources, future)
_POOL: list = []  # the background executor, while one runs
_COUNTS = {"queued": 0, "taken": 0}


def _units(model, scheme) -> list:
    """(key, fmt, importance, source arrays in merge order) per linear the plan quantizes."""
    from .plan import FLOAT
    from .simulation import merged_names, plan_linears

    plan = scheme.plan
    linears = plan_linears(model)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    units, seen = [], set()
    for name in linears:
        if name in seen or (tied and name == "lm_head.weight"):
            continue
        names = [n for n in merged_names(name) if n in linears]
        seen.update(names)
        fmt = FLOAT if scheme.keeps_float(names) else plan.format_for(names)
        sources = [linears[n].weight.detach().numpy() for n in names]
        if fmt == FLOAT or any(s.dtype != np.float32 for s in sources):
            continue
        N, K = sum(len(s) for s in sources), sources[0].shape[1]
        if not get_format(fmt).applies_to(N, K):
            continue
        units.append((",".join(sorted(names)), fmt, plan.importance_for(names), sources))
    return units


def start(model, scheme) -> int:
    """Quantize the plan's linears of the (calibrated) transformers `model` in a background
    thread; returns how many were queued. The model's weights must not change afterwards."""
    stop()
    units = _units(model, scheme)
    if not units:
        return 0
    for _key, fmt, imp, sources in units:  # TVM compiles here, on the caller's thread
        get_format(fmt).prepare(sources[0].shape[1], imp)
    pool = ThreadPoolExecutor(1, thread_name_prefix="tvm-llm-prequantize")
    with _LOCK:
        _POOL.append(pool)
        _COUNTS.update(queued=len(units), taken=0)
        for key, fmt, imp, sources in units:
            _PENDING[key] = (fmt, imp, sources, pool.submit(_quantize, fmt, imp, sources))
    return len(units)


def _quantize(fmt: str, imp, sources: list) -> dict:
    """One unit on one core (the other core is the build's main thread: trace, passes,
    codegen)."""
    w = sources[0] if len(sources) == 1 else np.concatenate(sources)
    return get_format(fmt).quantize(w, imp, threads=1)


def take(key: str, fmt: str, importance, w: np.ndarray):
    """The stored arrays of weight `w` quantized early, or None (not queued, not started yet,
    or a different computation). Waits for a unit that is being quantized. The first call
    cancels every unit not started yet."""
    with _LOCK:
        entry = _PENDING.pop(key, None)
        # the transform has begun: it quantizes on both cores what is not started yet (the
        # background thread would take the next units one core at a time while it waits)
        for *_, other in _PENDING.values():
            other.cancel()
    if entry is None:
        return None
    q_fmt, q_imp, sources, future = entry
    if future.cancel():  # not started: the caller's own quantizer (both cores) is faster
        return None
    same_importance = (importance is None and q_imp is None) or (
        importance is not None and q_imp is not None and np.array_equal(importance, q_imp))
    if q_fmt != fmt or not same_importance or not _equal(w, sources):
        future.cancel()
        return None
    try:
        stored = future.result()
    except Exception:  # noqa: BLE001 - the transform quantizes the weight itself
        return None
    with _LOCK:
        _COUNTS["taken"] += 1
    return stored


def _equal(w: np.ndarray, sources: list) -> bool:
    if w.ndim != 2 or w.shape != (sum(len(s) for s in sources), sources[0].shape[1]):
        return False
    row = 0
    for s in sources:
        if not np.array_equal(w[row:row + len(s)], s):
            return False
        row += len(s)
    return True


def stop() -> None:
    """Drop whatever is queued or kept (the build's weights are done, or it failed)."""
    with _LOCK:
        for *_, future in _PENDING.values():
            future.cancel()
        _PENDING.clear()
        _COUNTS.update(queued=0, taken=0)
        pools = list(_POOL)
        _POOL.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


def finish() -> None:
    """Wait until every queued unit is quantized (for tests: a build never waits here)."""
    with _LOCK:
        futures = [f for *_, f in _PENDING.values()]
    for f in futures:
        f.exception()


def counts() -> dict:
    """{"queued": linears queued by the last start, "taken": results the transform used}."""
    with _LOCK:
        return dict(_COUNTS)
