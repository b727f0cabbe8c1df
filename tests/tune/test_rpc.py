"""Measuring over TVM's own RPC: a tracker and a server on 127.0.0.1, MetaSchedule's RPCRunner."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from toy import Toy
from tvm_llm.errors import UserError
from tvm_llm.targets import get_target
from tvm_llm.tune.buckets import parse_buckets
from tvm_llm.tune.log import read_log
from tvm_llm.tune.tuner import make_runner, rpc_servers, tune_module

KEY = "tvm-llm-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args):
    # a session of its own: the RPC server's listening process is a child of this launcher,
    # so the whole process group is stopped at the end
    return subprocess.Popen([sys.executable, "-m", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def rpc_farm():
    port = _free_port()
    tracker = _start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port),
                      "--port-end", str(port + 1), "--silent"])
    server = None
    try:
        sport = _free_port()
        server = _start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(sport),
                         "--port-end", str(sport + 1), "--tracker", f"127.0.0.1:{port}",
                         "--key", KEY, "--silent"])
        deadline = time.time() + 120
        while True:
            try:
                if rpc_servers("127.0.0.1", port, KEY) > 0:
                    break
            except UserError:
                pass  # the tracker is still starting
            assert time.time() < deadline, "the RPC server never registered with the tracker"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        for proc in (server, tracker):
            if proc is not None:
                _stop(proc)


def test_tune_measures_over_rpc_and_resumes(rpc_farm, tmp_path):
    spec = get_target("llvm")
    log_dir = str(tmp_path / "log")
    runner = make_runner(rpc_farm, KEY)
    assert "1 server(s)" in runner[1]
    lines = []
    # the matmul only: MetaSchedule's space for the toy's relu holds one schedule
    options = dict(kernels=["nt_matmul"], rule_grid=False)  # the grid: test_tune_model
    summary = tune_module(Toy, spec, parse_buckets(["decode:b=1"]), trials=2, log_dir=log_dir,
                          runner=runner, trials_per_batch=2, log=lines.append, **options)
    text = "\n".join(lines)
    assert f"measuring on RPC tracker {rpc_farm}" in text
    assert summary["trials_run"] == 2
    (k,) = summary["kernels"]
    assert k["kernel"] == "nt_matmul__b1"
    assert k["records"] == 2 and k["best_seconds"] and k["generic_seconds"]
    _, n = read_log(log_dir, spec.hw_key())
    assert n == 3  # 2 trials + the generic kernel's measurement
    # run again: the kernel has its trials, nothing is measured
    again = tune_module(Toy, spec, parse_buckets(["decode:b=1"]), trials=2, log_dir=log_dir,
                        runner=runner, log=lambda *a: None, **options)
    assert again["trials_run"] == 0 and read_log(log_dir, spec.hw_key())[1] == 3


def test_bad_rpc_arguments_are_user_errors():
    with pytest.raises(UserError, match="expected HOST:PORT"):
        make_runner("nohost", KEY)
    with pytest.raises(UserError, match="needs --rpc-key"):
        make_runner("127.0.0.1:1", None)
    with pytest.raises(UserError, match="cannot reach the RPC tracker"):
        make_runner(f"127.0.0.1:{_free_port()}", KEY)
