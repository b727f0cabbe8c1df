"""The tiny llama tuned for a handful of trials, its log applied at build: the tuned kernels are
reported, bad lines in the log only cost warnings, and the logits still match transformers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tiny_models import VOCAB
from tvm_llm.tune.apply import TuningLogWarning
from tvm_llm.tune.log import RECORD_FILE

TOL = 1e-4
BUILD = dict(target="llvm", max_batch_size=4, prefill_chunk_size=64)  # as tests/conftest.py


@pytest.fixture(scope="module")
def tuned_log(tmp_path_factory, checkpoint):
    from tvm_llm.tune import tune

    log_dir = str(tmp_path_factory.mktemp("tune") / "cpu-log")
    lines = []
    summary = tune(checkpoint("llama"), trials=2, log_dir=log_dir,
                   buckets=["decode:b=1", "prefill:n=11"],
                   kernels=["fused_NT_matmul"], trials_per_batch=2, compare_generic=False,
                   max_batch_size=BUILD["max_batch_size"],
                   prefill_chunk_size=BUILD["prefill_chunk_size"], log=lines.append)
    return log_dir, summary, "\n".join(str(x) for x in lines)


def test_tune_writes_a_resumable_log(tuned_log):
    log_dir, summary, text = tuned_log
    assert summary["trials_run"] == 8 and len(summary["kernels"]) == 4
    assert all(k["records"] == 2 for k in summary["kernels"])
    assert sorted(k["bucket"] for k in summary["kernels"]) == ["decode:b=1"] * 2 + ["prefill:n=11"] * 2
    assert "ETA" in text and "best" in text  # the progress lines
    assert os.path.getsize(os.path.join(log_dir, RECORD_FILE)) > 0
    # our own search space: the rules' register tiles of this CPU's microarch row, measured
    # and recorded besides MetaSchedule's trials (which they do not count as)
    from tvm_llm.targets import get_target
    from tvm_llm.tune.log import read_log
    from tvm_llm.tune.rule_grid import grid_label

    from schedules.cpu.microarch import tile_row

    spec = get_target("llvm")
    # this CPU's row's first tile that the tiny model's widths (multiples of 64) admit: the grid
    # skips a tile whose column count does not divide N (a 4x3 tile on 64-wide kernels)
    mr, nr = next(t for t in tile_row(spec.tvm_target()).gemv_prefill if 64 % t[1] == 0)
    assert text.count(f"(prefill:n=11) rule grid: GEMV {mr}x{nr}") == 2
    db, _ = read_log(log_dir, spec.hw_key())
    labels = {grid_label(r) for r in db.get_all_tuning_records()} - {None}
    assert {f"GEMV {mr}x{nr}", "GEMV 1x4", "GEMV 1x1"} <= labels


def test_build_applies_the_log_and_matches_transformers(tuned_log, checkpoint, hf_model,
                                                         tmp_path):
    import tvm_llm
    from tvm_llm import Engine
    from tvm_llm.report import format_manifest

    log_dir, summary, _ = tuned_log
    rec_path = os.path.join(log_dir, RECORD_FILE)
    good = open(rec_path).read()
    with open(rec_path, "a") as f:  # a corrupt line, and a record for another machine
        f.write("{corrupt\n")
        other = json.loads(good.splitlines()[0])
        other[1][2] = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
        f.write(json.dumps(other) + "\n")
    out = str(tmp_path / "out")
    try:
        with pytest.warns(TuningLogWarning) as caught:
            manifest = tvm_llm.build(checkpoint("llama"), out, tuning_log=log_dir,
                                     log=lambda *a: None, **BUILD)
    finally:
        open(rec_path, "w").write(good)
    said = "\n".join(str(w.message) for w in caught)
    n = len(good.splitlines())
    assert f"{rec_path}:{n + 1}: corrupt or truncated record" in said
    assert f"(line {n + 2}) were tuned for cpu-aarch64-generic-neon" in said

    tuning = manifest["report"]["tuning"]
    tuned = {k["kernel"] for k in tuning["kernels"]}
    assert tuned == {k["kernel"] for k in summary["kernels"]}
    assert {b["bucket"] for b in tuning["buckets"]} == {"decode:b=1", "prefill:n=11"}
    text = format_manifest(manifest)
    assert "4 kernels from the log" in text and all(k in text for k in tuned)

    eng, ref_model = Engine(out), hf_model("llama")
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, size=11)]
    n = len(prompt)
    sid = eng.cache.add()
    pre = eng.prefill_positions([sid], [n], np.array([prompt]), np.arange(n)[None], np.arange(n))[0]
    tokens, steps = [int(pre[-1].argmax())], []
    for _ in range(8):  # batch-1 decode: the tuned bucket
        row = eng.decode_step([sid], [tokens[-1]])[0]
        steps.append(row)
        tokens.append(int(row.argmax()))
    eng.cache.remove(sid)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + tokens[:-1]])).logits[0].numpy()
    assert np.abs(pre - ref[:n]).max() < TOL
    for i, row in enumerate(steps):
        assert np.abs(row - ref[n + i]).max() < TOL, f"decode step {i}"
    # batch 2 runs the generic kernels: same tokens as each prompt alone through the tuned ones
    prompts = [prompt, prompt[:5]]
    assert eng.generate_ids(prompts, max_new_tokens=6, ignore_eos=True) == [
        eng.generate_ids([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
