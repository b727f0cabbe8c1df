"""scripts/gpu_check.sh / gpu_check.py stay runnable on a machine with no GPU.

The shell script is syntax-checked; the roofline phase (decode tokens/s of tvm_llm and
transformers against memory bandwidth / weight bytes per token) runs in its CPU mode on the
tiny benchmark shape, the same code the GPU run takes apart from the device.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shell_script_parses():
    subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", "gpu_check.sh")], check=True)


def test_bytes_per_token_read_one_embedding_row_unless_tied():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from gpu_check import decode_bytes_per_token

    emb = {"name": "model.embed_tokens.weight", "shape": [1000, 64], "nbytes": 1000 * 64 * 2}
    head = {"name": "folded.lv52", "shape": [21, 64, 48], "nbytes": 21 * 64 * 48 * 2}  # packed
    norm = {"name": "model.norm.weight", "shape": [64], "nbytes": 64 * 2}
    assert decode_bytes_per_token([emb, head, norm], tied_embeddings=False) == \
        64 * 2 + 21 * 64 * 48 * 2 + 64 * 2
    assert decode_bytes_per_token([emb, norm], tied_embeddings=True) == 1000 * 64 * 2 + 64 * 2


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": REPO, "TVM_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--device", "cpu",
         "--roofline-shape", "llama-tiny", "--roofline-steps", "5", "--bandwidth-gbs", "50"],
        env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "gpu_check.json") as f:
        return json.load(f), proc.stdout


def test_cpu_mode_reports_decode_against_the_roofline(cpu_run):
    results, stdout = cpu_run
    assert results["ok"] and results["checks"]["roofline_decode_measured"]["ok"]
    roof, decode = results["figures"]["roofline"], results["figures"]["roofline_decode"]
    # llama-tiny in float32: 2 layers of (qkv 128x256, o 128x128, gate_up 128x512, down 256x128,
    # 2 norms of 128), the final norm, one embedding row, and the 1000x128 LM head, which the
    # GEMV's packed layout pads to 1008 rows
    layer = 128 * 256 + 128 * 128 + 128 * 512 + 256 * 128 + 2 * 128
    assert 4 * (2 * layer + 128 + 128 + 1000 * 128) <= roof["weight_bytes_per_token"] \
        <= 4 * (2 * layer + 128 + 128 + 1024 * 128)
    assert roof["bandwidth_GBs"] == 50 and roof["bandwidth_source"] == "--bandwidth-gbs"
    assert roof["roofline_tokens_per_s"] == pytest.approx(50e9 / roof["weight_bytes_per_token"],
                                                          rel=1e-3)
    for system in ("tvm_llm", "transformers_cpu"):
        rate = decode[system]["tokens_per_s"]
        assert rate > 0
        assert decode[system]["share_of_roofline"] == pytest.approx(
            rate / roof["roofline_tokens_per_s"], abs=2e-3)
    assert "of the" in stdout and "roofline" in stdout
