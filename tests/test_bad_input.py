"""Bad input: one line naming the problem, exit code 2, and no output directory left behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import tiny_models


def _run_cli(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "tvm_llm.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)
    return proc.returncode, [l for l in proc.stderr.splitlines() if l.strip()]


def _clone(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _assert_refused(tmp_path, model_dir, *extra, expect):
    out = tmp_path / "out"
    code, err = _run_cli("build", str(model_dir), "-o", str(out), *extra)
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("tvm-llm: error: ") and expect in err[0], err
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tvm-llm")]  # no temp dirs


def _edit_safetensors(model_dir, edit):
    from safetensors.numpy import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_config(tmp_path, checkpoint):
    d = _clone(checkpoint("llama"), tmp_path / "ck")
    os.remove(os.path.join(d, "config.json"))
    _assert_refused(tmp_path, d, expect="config.json is missing")


def test_unknown_model_type(tmp_path, checkpoint):
    d = _clone(checkpoint("llama"), tmp_path / "ck")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "llamazing"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    _assert_refused(tmp_path, d, expect="unknown model_type 'llamazing'")


def test_missing_tensor(tmp_path, checkpoint):
    d = _clone(checkpoint("llama"), tmp_path / "ck")
    _edit_safetensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _assert_refused(tmp_path, d, expect="model.layers.1.mlp.up_proj.weight is missing")


def test_misshapen_tensor(tmp_path, checkpoint):
    import numpy as np

    d = _clone(checkpoint("llama"), tmp_path / "ck")

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)

    _edit_safetensors(d, shrink)
    _assert_refused(tmp_path, d, expect="model.layers.0.self_attn.k_proj.weight")


def test_pickle_only_checkpoint(tmp_path, checkpoint):
    import torch
    from safetensors.torch import load_file

    d = _clone(checkpoint("llama"), tmp_path / "ck")
    sd = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save(sd, os.path.join(d, "pytorch_model.bin"))
    _assert_refused(tmp_path, d, expect="only pickle weights (pytorch_model.bin)")


def test_invalid_target(tmp_path, checkpoint):
    _assert_refused(tmp_path, checkpoint("llama"), "--target", "tpu", expect="unknown target 'tpu'")


@pytest.mark.parametrize("extra,expect", [
    (("--quantization", "q3"), "unknown --quantization 'q3'"),
    (("--quantization", "q4", "--activations", "int4"), "unknown --activations 'int4'"),
    (("--quantization", "q4", "--group-size", "24"), "--group-size must be 32"),
    (("--quantization", "q4", "--activations", "int8", "--arch", "x86-64-v2"),
     "needs int8 dot-product instructions"),
    (("--quantization", "q4_0", "--activations", "int16", "--arch", "x86-64-v2"),
     "--activations int16 needs int8 dot-product instructions"),
    (("--keep-float", "0",), "need --quantization"),
])
def test_bad_quantization_options(tmp_path, checkpoint, extra, expect):
    _assert_refused(tmp_path, checkpoint("llama"), *extra, expect=expect)


def test_existing_output_needs_force(tmp_path, checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _run_cli("build", checkpoint("llama"), "-o", str(out))
    assert code == 2 and len(err) == 1 and "already exists; pass --force" in err[0], err
    assert (out / "keep.txt").read_text() == "user data"


def test_generate_on_a_non_output_directory(tmp_path):
    code, err = _run_cli("generate", str(tmp_path), "--prompt", "hi")
    assert code == 2 and len(err) == 1 and "not a tvm-llm output directory" in err[0], err
