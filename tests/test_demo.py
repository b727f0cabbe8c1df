"""The README's first command: the bundled model builds for this CPU and generates what
transformers generates from the same checkpoint."""
import subprocess
import sys

import torch

from tvm_llm.cli import DEFAULT_MODEL_DIR


def test_demo_generates_the_transformers_text(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "tvm_llm.cli", "demo", "-o", str(out),
                           "--prompt", "The for statement", "--max-new-tokens", "24"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR).eval()
    ids = tok("The for statement", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    expected = "The for statement" + tok.decode(ref, skip_special_tokens=True)
    assert expected in proc.stdout
