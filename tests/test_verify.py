"""tvm-llm verify: a float32 build agrees with transformers at every layer; a corrupted layer
is flagged from that layer on; bad input is one line and exit code 2."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tiny_models import ARCHS, VOCAB
from tvm_llm.cli import main
from tvm_llm.verify import verify

STATES = ["embed", "layer 0", "layer 1", "final_norm", "logits"]


def _table(text: str) -> dict:
    """state name -> whether its table row is flagged."""
    rows = {}
    for line in text.splitlines():
        for name in STATES:
            if line.startswith(name + " "):
                rows[name] = line.rstrip().endswith("FLAG")
    return rows


def test_float32_build_matches_transformers_at_every_layer(built, checkpoint, capsys):
    out, ck = built("llama"), checkpoint("llama")
    long_prompt = [int(t) for t in np.random.default_rng(0).integers(3, VOCAB, size=150)]
    report = verify(out, reference=ck, prompts=["the quick brown fox", long_prompt])  # > 1 chunk
    assert [r.name for r in report.rows] == STATES
    for r in report.rows:
        assert r.cosine > 0.99999 and r.worst_cosine > 0.99999, r
        assert r.max_abs_diff < 1e-3 * max(1.0, r.ref_max_abs), r
        assert not r.flagged
    positions = sum(len(p) for p in report.prompts)
    assert positions > 150
    assert report.rows[-1].top1 == (positions, positions) and not report.disagreements
    assert report.flagged == []
    # the CLI (reference taken from the manifest's source) prints the table and exits 0
    assert main(["verify", out, "--prompt", "def main(): return 0"]) == 0
    printed = capsys.readouterr().out
    assert _table(printed) == {name: False for name in STATES}
    assert "OK: nothing flagged" in printed


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_every_architecture_verifies(arch, built, checkpoint):
    """Embedding scaling, learned positions, parallel residuals, fused weights: the hidden
    states are defined alike in the trace and the reference (builds are shared with the
    end-to-end tests)."""
    report = verify(built(arch), reference=checkpoint(arch), prompts=["the quick brown fox"])
    assert [r.name for r in report.rows] == STATES
    assert report.flagged == []
    assert min(r.cosine for r in report.rows) > 0.99999


def _corrupt_layer(out: str, dst: str, layer: int) -> str:
    """A copy of the build with noise added to one weight of decoder layer `layer`."""
    shutil.copytree(out, dst)
    with open(os.path.join(dst, "manifest.json")) as f:
        manifest = json.load(f)
    # a weight that keeps its checkpoint name (CPU builds save the linears packed, under
    # the names of the weight transform's outputs): the layer's first one, e.g. its norm
    entry = next(p for p in manifest["params"] if f"layers.{layer}." in p["name"])
    w = np.memmap(os.path.join(dst, "weights.bin"), dtype=entry["dtype"], mode="r+",
                  offset=entry["offset"], shape=tuple(entry["shape"]))
    scale = max(float(w.std()), float(np.abs(w).mean()))  # a norm weight: ~1 +- small
    w += np.random.default_rng(0).normal(0, scale, w.shape).astype(w.dtype)
    w.flush()
    del w
    return entry["name"]


def test_corrupted_layer_is_flagged_from_that_layer_on(built, checkpoint, tmp_path, capsys):
    bad = str(tmp_path / "bad")
    name = _corrupt_layer(built("llama"), bad, layer=1)
    assert name.startswith("model.layers.1.")
    assert main(["verify", bad, "--reference", checkpoint("llama")]) == 1
    printed = capsys.readouterr().out
    assert _table(printed) == {"embed": False, "layer 0": False, "layer 1": True,
                               "final_norm": True, "logits": True}
    assert "precision is first lost at layer 1" in printed


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tvm-llm: error: "), captured.err
    return lines[0]


def test_bad_input_is_one_line_and_exit_code_2(built, checkpoint, tmp_path, capsys):
    out, ck = built("llama"), checkpoint("llama")
    assert main(["verify", str(tmp_path), "--reference", ck]) == 2  # not a build directory
    assert "not a tvm-llm output directory" in _one_error_line(capsys)

    other = tmp_path / "other"  # the same checkpoint with a different layer count
    shutil.copytree(ck, other)
    with open(other / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = 3
    with open(other / "config.json", "w") as f:
        json.dump(config, f)
    assert main(["verify", out, "--reference", str(other)]) == 2
    line = _one_error_line(capsys)
    assert "num_layers is 3 in the reference but 2 in the build" in line

    assert main(["verify", out, "--reference", str(tmp_path / "missing")]) == 2
    assert "no such directory" in _one_error_line(capsys)
