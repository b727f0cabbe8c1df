"""The embedded default checkpoint in tvm_llm/default_model (made by scripts/train_tiny.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

MODEL_DIR = Path(__file__).resolve().parent.parent / "tvm_llm" / "default_model"
MAX_BYTES = 10_000_000
REQUIRED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "heldout.txt",
    "README.md",
)
SAMPLE = 'The for statement iterates over a sequence:\n\n    for x in range(3):\n        print(x, "ok")\n'


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    return m.eval()


def test_files_present_and_small():
    for name in REQUIRED:
        assert (MODEL_DIR / name).is_file(), name
    total = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert total <= MAX_BYTES, f"default model is {total} bytes"
    held = (MODEL_DIR / "heldout.txt").read_text(encoding="utf-8")
    assert 10_000 < len(held.encode()) <= 200_000


def test_config_is_llama_with_gqa():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    tok = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert vocab["<s>"] == cfg["bos_token_id"]
    assert vocab["</s>"] == cfg["eos_token_id"]
    assert cfg["vocab_size"] >= len(vocab)


def test_weights_are_fp32_and_match_config():
    from safetensors import safe_open

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    with safe_open(str(MODEL_DIR / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert emb.dtype.name == "float32"
    assert emb.shape == (cfg["vocab_size"], cfg["hidden_size"])
    assert k.shape == (cfg["num_key_value_heads"] * cfg["head_dim"], cfg["hidden_size"])
    assert ("lm_head.weight" in keys) != cfg["tie_word_embeddings"]


def test_tokenizer_round_trip(tokenizer):
    from tokenizers import Tokenizer

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    ids = tokenizer(SAMPLE).input_ids
    assert ids[0] == cfg["bos_token_id"] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id == cfg["eos_token_id"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == SAMPLE
    raw = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    enc = raw.encode(SAMPLE)
    assert enc.ids == ids
    assert raw.decode(enc.ids) == SAMPLE
    assert len(ids) < len(SAMPLE) / 2  # BPE actually merges


def test_greedy_generation_is_printable(model, tokenizer):
    import torch

    inp = tokenizer("The ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inp, max_new_tokens=20, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    new = out[0, inp.input_ids.shape[1]:]
    assert new.numel() > 0
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip(), repr(text)
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    assert printable >= 0.9 * len(text), repr(text)
    letters = sum(c.isalpha() for c in text)
    assert letters >= 0.3 * len(text), repr(text)
