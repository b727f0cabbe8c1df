"""Perplexity of a held-out text: the end-to-end measure of what quantization costs.

The text is tokenized once and cut into non-overlapping windows of `window` tokens (the
bundled model was evaluated the same way when it was trained: scripts/train_tiny.py). Each
window is one prefill of a fresh sequence that returns logits at every position; the loss is
the mean next-token negative log-likelihood over all windows.

`engine_perplexity` measures a built output directory through the runtime (what ships);
`transformers_perplexity` measures a checkpoint in transformers, optionally with its linear
weights replaced by their quantize -> dequantize round trip (the sensitivity analysis).
"""
from __future__ import annotations

import math
import os

import numpy as np

DEFAULT_TEXT = os.path.join(os.path.dirname(__file__), "default_model", "heldout.txt")


def read_text(path: str | None) -> str:
    from .errors import UserError

    path = path or DEFAULT_TEXT
    if not os.path.isfile(path):
        raise UserError(f"{path}: text file not found; pass --text FILE")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); pass a text "
                        "file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}); pass a readable text file") from None
    if "\0" in text:
        raise UserError(f"{path}: holds NUL bytes (a binary file?); pass a text file")
    if not text.strip():
        raise UserError(f"{path}: text file is empty")
    return text


def windows(ids: list, window: int, max_windows: int | None = None) -> list:
    """Non-overlapping windows of window + 1 tokens (inputs and their next-token targets)."""
    n = (len(ids) - 1) // window
    if max_windows:
        n = min(n, max_windows)
    return [ids[i * window: (i + 1) * window + 1] for i in range(n)]


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Sum of -log softmax(logits)[target] over rows (float64 for a stable sum)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].sum())


def _result(total_nll: float, count: int, n_windows: int) -> dict:
    return {"perplexity": math.exp(total_nll / count), "nll": total_nll / count,
            "tokens": count, "windows": n_windows}


def engine_perplexity(engine, text: str, window: int = 256, max_windows: int | None = None) -> dict:
    """Perplexity of `text` under a built model (tvm_llm.runtime.Engine)."""
    from .errors import UserError

    ids = engine.tokenizer.encode(text).ids
    chunk = int(engine.manifest["kv_cache"]["prefill_chunk_size"])
    if window > chunk:
        raise UserError(f"--window {window} exceeds the build's prefill chunk size ({chunk})")
    wins = windows(ids, window, max_windows)
    if not wins:
        raise UserError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    total = 0.0
    for w in wins:
        sid = engine.cache.add()
        try:
            inp = np.asarray(w[:-1], dtype="int64")[None]
            pos = np.arange(len(w) - 1, dtype="int64")[None]
            logits = engine.prefill_positions([sid], [len(w) - 1], inp, pos,
                                              np.arange(len(w) - 1, dtype="int64"))
        finally:
            engine.cache.remove(sid)
        total += _nll(logits.reshape(len(w) - 1, -1), np.asarray(w[1:]))
    return _result(total, len(wins) * window, len(wins))


def transformers_perplexity(model, tokenizer_ids: list, window: int = 256,
                            max_windows: int | None = None) -> dict:
    """Perplexity under a transformers model (fp32, eager) for the same windows."""
    import torch

    wins = windows(tokenizer_ids, window, max_windows)
    total = 0.0
    with torch.no_grad():
        for w in wins:
            logits = model(torch.tensor([w[:-1]])).logits[0].float().numpy()
            total += _nll(logits, np.asarray(w[1:]))
    return _result(total, len(wins) * window, len(wins))
