"""Run a CLI command or a Python API snippet in its own process, fast.

A fresh `python -m tvm_llm.cli` pays seconds of imports (torch, transformers, TVM) per call;
the fuzz suite runs dozens. Here a multiprocessing fork server imports them once, and each
case runs in a child forked from it: a real process of its own (an exit code, a signal if it
crashes, its own stderr), started in milliseconds. The server never runs a kernel or a torch op
before forking, so the children start with no thread pools to inherit.
"""
from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

PRELOAD = ["torch", "transformers", "tokenizers", "safetensors", "tvm", "tvm_llm.cli",
           "tvm_llm.build", "tvm_llm.frontend", "tvm_llm.runtime.engine", "tvm_llm.verify",
           "tvm_llm.perplexity", "tvm_llm.memory"]
_CTX = None


@dataclass
class Outcome:
    exitcode: int  # negative: killed by that signal
    stderr: str
    stdout: str

    @property
    def err_lines(self) -> list:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


def _child(kind: str, payload, cwd: str, out_path: str, err_path: str) -> None:
    """In the forked child: stdout/stderr to files, run, exit with the CLI's code."""
    import sys
    import traceback

    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    code = 1
    try:
        if kind == "cli":
            from tvm_llm.cli import main

            code = main(list(payload))
        else:  # a Python API snippet: UserError is the API's bad-input answer (CLI: exit 2)
            from tvm_llm.errors import UserError

            try:
                exec(compile(payload, "<case>", "exec"), {"__name__": "__case__"})
                code = 0
            except UserError as e:
                print(f"UserError: {e}", file=sys.stderr)
                code = 2
    except SystemExit as e:  # argparse exits through here
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(kind: str, payload, cwd: str, timeout: float = 300) -> Outcome:
    """kind "cli" (payload: argv list for `tvm-llm`), "api" (payload: Python source), or
    "subprocess" (argv run by a fresh `python -m tvm_llm.cli`: for commands that trace and
    compile, whose thread pools are safest started in a process of their own)."""
    if kind == "subprocess":
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "tvm_llm.cli", *payload], cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        return Outcome(proc.returncode, proc.stderr, proc.stdout)
    ctx = _context()
    out_path = os.path.join(cwd, ".case-stdout")
    err_path = os.path.join(cwd, ".case-stderr")
    p = ctx.Process(target=_child, args=(kind, payload, cwd, out_path, err_path))
    p.start()
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join()
        raise AssertionError(f"{kind} {payload!r} did not finish in {timeout}s")
    outcome = Outcome(p.exitcode, _read_and_remove(err_path), _read_and_remove(out_path))
    return outcome


def _read_and_remove(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
    finally:
        if os.path.exists(path):
            os.remove(path)
