"""The pipeline's passes run without exactly TVM's "Fast mode segfaults" line on stderr; the
rest of stderr is kept and the passes' results are unchanged."""
from __future__ import annotations

import os

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_llm.passes.known_warnings import run_filtering_stderr


@I.ir_module
class Lookup:
    @R.function
    def main(table: R.Tensor((16, 8), "float32"), ids: R.Tensor((3,), "int64")):
        with R.dataflow():
            y = R.take(table, ids, axis=0)
            R.output(y)
        return y


def test_take_warning_is_dropped_and_the_module_matches_legalize_ops(capfd):
    quiet = run_filtering_stderr(relax.transform.LegalizeOps(), Lookup)
    err = capfd.readouterr().err
    assert "Fast mode segfaults" not in err
    tvm.ir.assert_structural_equal(quiet, relax.transform.LegalizeOps()(Lookup))
    assert "Fast mode segfaults" in capfd.readouterr().err  # what the plain pass prints


def test_other_stderr_lines_are_kept(capfd):
    def noisy():
        os.write(2, b"[x] Warning: Fast mode segfaults when there are out-of-bounds indices\n")
        os.write(2, b"[y] Warning: something else\n")
        return 7

    assert run_filtering_stderr(noisy) == 7
    err = capfd.readouterr().err
    assert "something else" in err and "Fast mode" not in err
