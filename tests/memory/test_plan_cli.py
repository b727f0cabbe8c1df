"""The plan as users see it: the build uses it for the KV cache, `tvm-llm plan` prints the same
figures without compiling, `tvm-llm inspect` shows them, bad budgets are one-line errors."""
from __future__ import annotations

import json
import os

import pytest

from tvm_llm.cli import main
from tvm_llm.runtime.artifact import read_manifest

BUDGET = "300MB"  # what tests/memory/conftest.py builds with (max batch 4, prefill chunk 64)


def test_build_sizes_the_kv_cache_from_the_plan(budget_built):
    from tvm_llm import Engine

    m = read_manifest(budget_built)
    mem, kv = m["memory"], m["kv_cache"]
    assert mem["budget"]["spec"] == BUDGET and mem["budget"]["bytes"] == 300 * 10**6
    assert mem["total_bytes"] <= mem["budget"]["bytes"]
    assert kv["max_total_seq_len"] == mem["kv_cache"]["max_total_seq_len"]
    assert kv["context_window"] == mem["context_window"] == 512  # max_position_embeddings
    assert mem["weights"]["bytes"] == sum(p["nbytes"] for p in m["params"])
    assert mem["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    engine = Engine(budget_built)
    assert engine.cache.total_pages == mem["kv_cache"]["pages"]  # TVM allocated exactly the plan


def test_plan_prints_the_builds_figures_without_compiling(budget_built, checkpoint, capsys,
                                                          monkeypatch):
    import tvm

    def no_codegen(*a, **k):
        raise AssertionError("tvm-llm plan must not compile kernels")

    monkeypatch.setattr(tvm, "compile", no_codegen)
    args = ["--max-memory", BUDGET, "--max-batch-size", "4", "--prefill-chunk-size", "64"]
    assert main(["plan", checkpoint("llama"), *args, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned == read_manifest(budget_built)["memory"]

    assert main(["inspect", budget_built]) == 0
    text = capsys.readouterr().out
    assert "memory plan (cpu; budget --max-memory 300MB = 286.1 MiB)" in text
    pages = planned["kv_cache"]["pages"]
    assert f"{pages} pages x 16 tokens x 512 B/token" in text


@pytest.mark.parametrize("budget,message", [
    ("lots", "--max-memory 'lots' is not a size"),
    ("100KB", "--max-memory 100KB (97.7 KiB) is below the 449.2 KiB of weights"),
])
def test_bad_budgets_are_one_line_exit_2(checkpoint, tmp_path, capsys, budget, message):
    out, ck = tmp_path / "out", checkpoint("llama")
    capsys.readouterr()  # making the checkpoint may print progress
    assert main(["build", ck, "-o", str(out), "--max-memory", budget]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tvm-llm: error: ") and "\n" not in err
    assert message in err
    assert not os.path.exists(out)


def test_budget_and_kv_cache_tokens_together_are_refused(checkpoint, capsys):
    ck = checkpoint("llama")
    capsys.readouterr()
    assert main(["plan", ck, "--max-memory", "1GB", "--kv-cache-tokens", "64"]) == 2
    assert "not both" in capsys.readouterr().err
