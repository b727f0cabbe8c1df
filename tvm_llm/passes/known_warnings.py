"""The build's passes without TVM's "Fast mode segfaults" warning.

TVM's `take` lowering (topi::take, mode "fast", the mode every take of an imported model has)
prints "Fast mode segfaults when there are out-of-bounds indices" from C++ for each take it
lowers: ten lines in a build's log for a warning that does not apply to us (the indices are
token ids the engine checks against the vocabulary, positions below the context window, and
expert ids from a top-k). It is a C++ log line, out of reach of Python's warning filters, and
several passes lower takes (LegalizeOps, FoldConstant), so the pipeline runs each pass with
the process's stderr captured and writes back every line but that one: other warnings still
reach the user.
"""
from __future__ import annotations

import os
import sys
import tempfile

KNOWN_HARMLESS = ("Fast mode segfaults when there are out-of-bounds indices",)


def without_known_warnings(text: str) -> str:
    """`text` minus the lines of the known harmless warnings (a C++ warning is one line)."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not any(w in line for w in KNOWN_HARMLESS))


def run_filtering_stderr(fn, *args):
    """fn(*args) with file descriptor 2 captured; what it wrote, less the known harmless
    warnings, is written back to stderr afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            return fn(*args)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            rest = without_known_warnings(captured.read().decode(errors="replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()
