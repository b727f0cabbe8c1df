"""One tiny llama build with a memory budget, shared by the memory tests."""
from __future__ import annotations

import pytest

BUDGET = "300MB"
BUILD_ARGS = dict(max_batch_size=4, prefill_chunk_size=64)


@pytest.fixture(scope="session")
def budget_built(tmp_path_factory, checkpoint):
    """Output directory of the tiny llama built with --max-memory 300MB."""
    import tvm_llm

    out = str(tmp_path_factory.mktemp("out_llama_budget") / "out")
    tvm_llm.build(checkpoint("llama"), out, target="llvm", max_memory=BUDGET, log=lambda *a: None,
                  **BUILD_ARGS)
    return out
