"""The build writes weights.bin on a second thread beside its codegen (tvm_llm/build.py
WeightWriter): the same bytes as writing them in line, errors reach the build, a failed build
stops the writer and leaves nothing behind, and the writer's thread never runs TVM's compiler."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from tvm_llm.build import WeightWriter
from tvm_llm.runtime import artifact


def _arrays():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((3, 5)).astype(np.float32), np.arange(7, dtype=np.int8),
            rng.standard_normal((16, 4)).astype(np.float32)]


def test_writer_writes_what_save_weights_writes(tmp_path):
    names = ["a", "b", "c"]
    want = artifact.save_weights(str(tmp_path / "direct.bin"), names, _arrays())
    writer = WeightWriter(str(tmp_path / "threaded.bin"), names, iter(_arrays()))
    assert writer.result() == want
    assert (tmp_path / "threaded.bin").read_bytes() == (tmp_path / "direct.bin").read_bytes()
    assert writer.seconds > 0


def test_writer_hands_its_error_to_the_caller(tmp_path):
    def failing():
        yield _arrays()[0]
        raise ValueError("transform failed on the second weight")

    writer = WeightWriter(str(tmp_path / "w.bin"), ["a", "b"], failing())
    with pytest.raises(ValueError, match="second weight"):
        writer.result()


def test_cancel_stops_the_writer_between_weights(tmp_path):
    made = []

    def endless():
        while True:
            made.append(1)
            time.sleep(0.01)
            yield np.zeros(4, np.float32)

    writer = WeightWriter(str(tmp_path / "w.bin"), (f"w{i}" for i in range(10**9)), endless())
    time.sleep(0.05)
    writer.cancel()
    count = len(made)
    time.sleep(0.05)
    assert len(made) == count  # nothing is computed after cancel() returns
    assert not any(t.name == "tvm-llm-weights" and t.is_alive() for t in threading.enumerate())


def test_failed_codegen_stops_the_writer_and_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    import tvm

    from tvm_llm.build import build

    real = tvm.compile
    started = []

    def codegen_fails(*args, **kwargs):
        if "relax_pipeline" not in kwargs:  # the weight transform's own compile
            return real(*args, **kwargs)
        started.append(any(t.name == "tvm-llm-weights" for t in threading.enumerate()))
        raise RuntimeError("codegen failed")

    monkeypatch.setattr(tvm, "compile", codegen_fails)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="codegen failed"):
        build(checkpoint("llama"), str(out), context_window=64, log=lambda *a: None)
    assert started  # the build's codegen was reached (the writer had been started before it)
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # no temporary directory left
    assert not any(t.name == "tvm-llm-weights" and t.is_alive() for t in threading.enumerate())


def test_writer_thread_never_compiles(checkpoint, tmp_path, monkeypatch):
    """A q4_k build whose transform quantizes every weight itself (no early quantizer, no
    q4_k search compiled yet): the searches are compiled before the writer
    starts (kernels.prepare_quantizers), so every tvm.compile runs on the build's thread."""
    import tvm

    from tvm_llm.build import build
    from tvm_llm.quantization import kquant_search, prequantize

    threads = []
    real = tvm.compile

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(tvm, "compile", recording)
    monkeypatch.setattr(prequantize, "start", lambda *a, **k: 0)  # it would compile them
    monkeypatch.setattr(kquant_search, "_COMPILED", {})
    build(checkpoint("llama"), str(tmp_path / "out"), context_window=64, quantization="q4_k",
          log=lambda *a: None)
    assert threads and "tvm-llm-weights" not in threads, threads
    assert kquant_search._COMPILED  # the transform did need a compiled search
