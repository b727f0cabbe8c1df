"""tvm-llm verify: where does a build's precision go? The compiled model against transformers.

    report = verify("out", reference="path/to/hf_checkpoint")
    print(report.format()); sys.exit(1 if report.flagged else 0)

The build runs its `hidden_states` function (prefill's kernels and weights, also returning every
layer's output) and transformers runs the checkpoint in float32 with eager attention, on the
same token ids. For each hidden state (the embedding output, each decoder layer's output, the
final norm's output) and for the logits, over all positions of all prompts:

  cosine        cosine similarity of the flattened states (all positions together)
  worst pos     the lowest per-position cosine, at (prompt:position)
  max abs diff  max |build - reference|, next to max |reference| for scale
  top-1         (logits) positions whose greedy token agrees

A state is flagged when its cosine is below `min_cosine` (default 0.99); the logits also when
fewer than `min_top1` (default 0.9) of the positions agree on the greedy token. A float32 build
is expected at cosine ~1 - 1e-6 and max abs diff ~1e-5 everywhere; in a quantized build the
first flagged layer is where precision is lost.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .errors import UserError

DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog.",
                   "def main():\n    return 0\n",
                   "Once upon a time, in a small town by the sea, there lived")
DEFAULT_MIN_COSINE = 0.99
DEFAULT_MIN_TOP1 = 0.9
_SHOWN_DISAGREEMENTS = 5


@dataclass
class Row:
    """One compared state: a hidden state (name as in the build) or the logits."""

    name: str
    cosine: float
    worst_cosine: float
    worst_at: tuple  # (prompt index, position) of worst_cosine
    max_abs_diff: float
    ref_max_abs: float
    top1: tuple | None = None  # logits: (agreeing positions, positions)
    flagged: bool = False


@dataclass
class Report:
    out_dir: str
    reference: str
    build: str  # e.g. "llama, float32, llvm"
    prompts: list  # token ids per prompt
    rows: list
    min_cosine: float
    min_top1: float
    disagreements: list = field(default_factory=list)  # (prompt, position, build token, ref token)

    @property
    def flagged(self) -> list:
        return [r for r in self.rows if r.flagged]

    def format(self) -> str:
        tokens = sum(len(p) for p in self.prompts)
        lines = [f"verify {self.out_dir} ({self.build}) against {self.reference} "
                 "(transformers, float32, eager attention)",
                 f"{len(self.prompts)} prompts, {tokens} tokens; FLAG: cosine < {self.min_cosine:g}"
                 f" (--min-cosine), logits top-1 agreement < {self.min_top1:.0%} (--min-top1)", ""]
        width = max(10, *(len(r.name) for r in self.rows))
        lines.append(f"{'state':<{width}}  {'cosine':>9}  {'worst pos':>19}  {'max abs diff':>12}"
                     f"  {'max |ref|':>9}  {'top-1':>9}  flag")
        for r in self.rows:
            worst = f"{r.worst_cosine:.6f} ({r.worst_at[0]}:{r.worst_at[1]})"
            top1 = f"{r.top1[0]}/{r.top1[1]}" if r.top1 else ""
            lines.append(f"{r.name:<{width}}  {r.cosine:>9.6f}  {worst:>19}  {r.max_abs_diff:>12.2e}"
                         f"  {r.ref_max_abs:>9.2e}  {top1:>9}  {'FLAG' if r.flagged else ''}".rstrip())
        if self.disagreements:
            shown = ", ".join(f"{p}:{i} {got}/{ref}"
                              for p, i, got, ref in self.disagreements[:_SHOWN_DISAGREEMENTS])
            more = len(self.disagreements) - _SHOWN_DISAGREEMENTS
            lines.append("greedy token differs (prompt:position build/reference token): "
                         + shown + (f" and {more} more" if more > 0 else ""))
        flagged = self.flagged
        lines.append("")
        if flagged:
            lines.append(f"FLAGGED: {', '.join(r.name for r in flagged)}; precision is first lost "
                         f"at {flagged[0].name}")
        else:
            lines.append("OK: nothing flagged")
        return "\n".join(lines)


def compare(name: str, got: np.ndarray, ref: np.ndarray, min_cosine: float,
            positions: list) -> Row:
    """Row for one state; got/ref: (positions, features); positions: (prompt, position) per row."""
    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(ref, dtype=np.float64)
    cosine = _cosine(a.ravel()[None], b.ravel()[None])[0]
    per_pos = _cosine(a, b)
    worst = int(np.argmin(per_pos))
    # a NaN is never below a threshold: non-finite states (NaN/Inf weights, an overflow) are
    # flagged as such, whatever the cosine says
    finite = bool(np.isfinite(a).all())
    return Row(name, float(cosine), float(per_pos[worst]), positions[worst],
               float(np.abs(a - b).max()), float(np.abs(b).max()),
               flagged=not finite or not bool(cosine >= min_cosine))


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity; 1 where both rows are zero, 0 where only one is."""
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    cos = np.where((na == 0) & (nb == 0), 1.0, np.where((na == 0) | (nb == 0), 0.0, cos))
    return np.clip(cos, -1.0, 1.0)


def check_reference(manifest: dict, config, reference: str, out_dir: str) -> None:
    """UserError when the reference checkpoint's config is not the one the build was made from."""
    text = config.get_text_config()
    model = manifest.get("model", {})
    expected = {"model_type": config.model_type,
                "num_layers": getattr(text, "num_hidden_layers", None),
                "vocab_size": getattr(text, "vocab_size", None),
                "num_heads": getattr(text, "num_attention_heads", None)}
    for key, ref_value in expected.items():
        built = model.get(key)
        if built is not None and ref_value is not None and built != ref_value:
            raise UserError(f"{reference}: does not match the build in {out_dir}: {key} is "
                            f"{ref_value} in the reference but {built} in the build; pass the "
                            "checkpoint the build was made from")


def _reference_dir(manifest: dict, reference: str | None, out_dir: str) -> str:
    if reference is None:
        reference = manifest.get("model", {}).get("source")
        if not reference:
            raise UserError(f"{out_dir}: the manifest names no source checkpoint; pass --reference "
                            "MODEL_DIR")
        if not os.path.isdir(reference):
            raise UserError(f"{reference}: the checkpoint {out_dir} was built from is gone; pass "
                            "--reference MODEL_DIR")
    return reference


def _tokenize(engine, prompts) -> list:
    out = []
    for i, p in enumerate(prompts):
        ids = engine.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if not ids:
            raise UserError(f"prompt {i} is empty after tokenization; give some text")
        if len(ids) > engine.context_window:
            raise UserError(f"prompt {i} has {len(ids)} tokens; the build's context window is "
                            f"{engine.context_window}")
        out.append(ids)
    return out


def reference_states(model, token_ids: list) -> tuple:
    """(logits (n, vocab), hidden states (k, n, hidden), names) of the transformers model."""
    import torch

    from .frontend.exporter import forward_with_hidden_states

    with torch.no_grad():
        logits, states, names = forward_with_hidden_states(
            model, input_ids=torch.tensor([token_ids]), use_cache=False)
    return (logits[0].float().numpy(), np.stack([s[0].float().numpy() for s in states]), names)


def verify(out_dir: str, reference: str | None = None, prompts=None,
           min_cosine: float = DEFAULT_MIN_COSINE, min_top1: float = DEFAULT_MIN_TOP1,
           num_threads: int | None = None) -> Report:
    """Compare the build in `out_dir` with transformers on the checkpoint `reference` (default:
    the directory the build was made from); `prompts`: texts (tokenized with the build's
    tokenizer) or token id lists, default DEFAULT_PROMPTS."""
    from .runtime import artifact

    if not 0 <= min_top1 <= 1:
        raise UserError(f"--min-top1 must be a fraction in [0, 1], got {min_top1}")
    manifest = artifact.read_manifest(out_dir)  # UserError if not a build directory
    reference = _reference_dir(manifest, reference, out_dir)
    from .config import BuildConfig
    from .front import lower, read_checkpoint

    checkpoint = read_checkpoint(reference)
    config = checkpoint.config
    check_reference(manifest, config, reference, out_dir)
    from .runtime.engine import Engine

    engine = Engine(out_dir, num_threads=num_threads)
    token_ids = _tokenize(engine, list(prompts) if prompts else list(DEFAULT_PROMPTS))
    built = [engine.hidden_states(ids) for ids in token_ids]  # UserError on an older build
    hidden = getattr(config.get_text_config(), "hidden_size", None)
    got_hidden = built[0][1].shape[-1]
    if hidden is not None and got_hidden != hidden:
        raise UserError(f"{reference}: does not match the build in {out_dir}: hidden size is "
                        f"{hidden} in the reference but {got_hidden} in the build; pass the "
                        "checkpoint the build was made from")

    model = lower(checkpoint, BuildConfig.create(dtype="float32"), "load", log=lambda *a: None).model
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    refs = [reference_states(model, ids) for ids in token_ids]
    names = refs[0][2]
    if built[0][1].shape[0] != len(names):
        raise UserError(f"{out_dir} returns {built[0][1].shape[0]} hidden states but transformers "
                        f"gives {len(names)} for {reference}; rebuild with this tvm_llm version")

    positions = [(p, i) for p, ids in enumerate(token_ids) for i in range(len(ids))]
    rows = []
    for k, name in enumerate(names):
        got = np.concatenate([b[1][k] for b in built])
        ref = np.concatenate([r[1][k] for r in refs])
        rows.append(compare(name, got, ref, min_cosine, positions))
    got_logits = np.concatenate([b[0] for b in built])
    ref_logits = np.concatenate([r[0] for r in refs])
    logits = compare("logits", got_logits, ref_logits, min_cosine, positions)
    got_top, ref_top = got_logits.argmax(-1), ref_logits.argmax(-1)
    agree = int((got_top == ref_top).sum())
    logits.top1 = (agree, len(positions))
    logits.flagged = logits.flagged or agree < min_top1 * len(positions)
    rows.append(logits)
    disagreements = [(*positions[j], int(got_top[j]), int(ref_top[j]))
                     for j in np.flatnonzero(got_top != ref_top)]
    quant = manifest.get("quantization") or {}
    scheme = quant.get("scheme") if isinstance(quant, dict) else None
    desc = ", ".join(str(x) for x in (manifest.get("model", {}).get("model_type"),
                                      manifest.get("dtype"), scheme,
                                      manifest.get("target", {}).get("name")) if x)
    return Report(out_dir, reference, desc, token_ids, rows, min_cosine, min_top1, disagreements)
