#!/usr/bin/env python
"""Train the tiny embedded default model that ships in ``tvm_llm/default_model``.

A small Llama-architecture causal LM (``LlamaForCausalLM``, fp32, grouped-query
attention) and a byte-level BPE tokenizer are trained from scratch, on CPU, on
text that ships with Python itself:

* the pydoc help topics (``pydoc_data.topics.topics``), and
* "stub" renderings of the standard library's pure-Python modules: module,
  class and function docstrings together with their ``class``/``def`` lines,
  extracted with :mod:`ast` from the source files (nothing is imported).

Everything is deterministic for a given Python version: documents are taken in
sorted order, every 20th document is held out as validation text (written to
``heldout.txt``), seeds are fixed, and the learning-rate schedule is a function
of ``--steps`` only (``--minutes`` is a safety stop).

Usage::

    python scripts/train_tiny.py                       # the shipped checkpoint
    python scripts/train_tiny.py --out /tmp/m --steps 100 --minutes 2
"""
from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tvm_llm" / "default_model"

BOS, EOS = "<s>", "</s>"
HELDOUT_EVERY = 20  # document i is held out when i % 20 == HELDOUT_OFFSET
HELDOUT_OFFSET = 5
MAX_HELDOUT_BYTES = 200_000

# Docstring stubs are taken from every public pure-Python standard-library
# module (files under sysconfig's "stdlib" path, sorted), except these trees:
# tests, GUI/IDE code, bundled wheels and data.
STDLIB_EXCLUDE = frozenset({
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
    "site-packages", "dist-packages", "__pycache__", "pydoc_data", "encodings",
})
STDLIB_EXCLUDE_FILES = frozenset({"this.py", "antigravity.py"})


# --------------------------------------------------------------------------- corpus
def _strip_to_docstrings(node: ast.AST) -> ast.AST | None:
    """Return a copy of a module/class/function reduced to documented stubs."""
    doc = ast.get_docstring(node, clean=True)
    children = []
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if child.name.startswith("_") and child.name != "__init__":
                continue
            stub = _strip_to_docstrings(child)
            if stub is not None:
                children.append(stub)
    if not doc and not children:
        return None
    body: list[ast.stmt] = []
    if doc:
        body.append(ast.Expr(ast.Constant(doc)))
    body.extend(children)
    if isinstance(node, ast.Module):
        return ast.Module(body=body, type_ignores=[])
    new = copy.copy(node)
    new.body = body or [ast.Pass()]
    new.decorator_list = []
    return new


def _render_stub(tree: ast.Module) -> str:
    # ast.unparse would write docstrings as repr()s with literal "\n" escapes;
    # render them as real triple-quoted blocks so the text reads like source.
    lines = [_pretty_docstrings(node) for node in tree.body]
    return "\n\n".join(lines).strip() + "\n"


def _pretty_docstrings(node: ast.AST) -> str:
    out: list[str] = []

    def emit(n: ast.AST, indent: str) -> None:
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            doc = n.value.value.replace('"""', "'''")
            doc_lines = doc.split("\n")
            if len(doc_lines) == 1:
                out.append(f'{indent}"""{doc}"""')
            else:
                out.append(f'{indent}"""{doc_lines[0]}')
                for ln in doc_lines[1:]:
                    out.append(f"{indent}{ln}" if ln.strip() else "")
                out.append(f'{indent}"""')
            return
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            bare = copy.copy(n)
            bare.body = [ast.Pass()]
            header_src = ast.unparse(bare)
            header = header_src.rsplit("\n", 1)[0]  # drop the "    pass" line
            out.append(indent + header)
            for c in n.body:
                emit(c, indent + "    ")
            return
        if isinstance(n, ast.Pass):
            out.append(indent + "pass")
            return
        out.append(indent + ast.unparse(n))

    emit(node, "")
    return "\n".join(out)


def stdlib_source_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = rel.parts
        if rel.name in STDLIB_EXCLUDE_FILES or parts[0].startswith("config-"):
            continue
        if any(p in STDLIB_EXCLUDE or (p.startswith("_") and p != "__init__.py") for p in parts):
            continue
        mod = ".".join(parts)[: -len(".py")].removesuffix(".__init__")
        files.append((mod, path))
    return files


def stdlib_stub_documents() -> list[tuple[str, str]]:
    docs = []
    for mod, path in stdlib_source_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        stub = _strip_to_docstrings(tree)
        if stub is None:
            continue
        docs.append((f"module:{mod}", f"# Module {mod}\n\n" + _render_stub(stub)))
    return docs


def pydoc_documents() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"topic:{k}", topics[k].strip() + "\n") for k in sorted(topics)]


def build_corpus(use_stdlib: bool = True) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Return (train_docs, heldout_docs); deterministic for a Python version."""
    docs = pydoc_documents()
    if use_stdlib:
        docs += stdlib_stub_documents()
    train, held = [], []
    for i, d in enumerate(docs):
        (held if i % HELDOUT_EVERY == HELDOUT_OFFSET else train).append(d)
    return train, held


# ------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # Like Llama: encode() prepends <s>; decode() skips specials by default.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def save_tokenizer_files(tok, out: Path, model_max_length: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


def encode_docs(tok, docs: list[tuple[str, str]]) -> np.ndarray:
    """<s> doc </s> <s> doc </s> ... as one int32 stream."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([t for _, t in docs]):
        ids.extend(enc.ids)  # starts with <s> (post-processor)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------------------- model
def make_model(args, vocab_size: int, bos_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=args.tie,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
        torch_dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    return model


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, batch: int = 16) -> float:
    """Mean next-token loss over non-overlapping seq_len windows of data."""
    model.eval()
    n = (len(data) - 1) // seq_len
    x = torch.from_numpy(data[: n * seq_len + 1])
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        j = min(n, i + batch)
        inp = torch.stack([x[k * seq_len:(k + 1) * seq_len] for k in range(i, j)])
        tgt = torch.stack([x[k * seq_len + 1:(k + 1) * seq_len + 1] for k in range(i, j)])
        logits = model(input_ids=inp).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += tgt.numel()
    model.train()
    return tot / max(cnt, 1)


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float, time_frac: float = 0.0) -> float:
    """Linear warmup, then cosine decay to final_frac * peak.

    The decay follows whichever runs out first, the step budget or the time
    budget (time_frac = elapsed / budget), so a run cut short by --minutes on a
    slow or busy machine still ends annealed.  When the step budget binds (the
    normal case) the schedule is a pure function of the step number.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * p)))


PROMPTS = ["The for statement", "def ", "The ", "A class", "Return the"]


@torch.no_grad()
def show_samples(model, tok, max_new_tokens: int = 48, seed: int = 0) -> list[tuple[str, str, str]]:
    model.eval()
    res = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p).ids])
        g = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                           repetition_penalty=1.0, pad_token_id=model.config.eos_token_id)
        greedy = tok.decode(g[0].tolist())
        g2 = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                            repetition_penalty=1.3, no_repeat_ngram_size=4,
                            pad_token_id=model.config.eos_token_id)
        norep = tok.decode(g2[0].tolist())
        torch.manual_seed(seed)
        s = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8,
                           top_k=40, top_p=0.95, repetition_penalty=1.1,
                           pad_token_id=model.config.eos_token_id)
        sampled = tok.decode(s[0].tolist())
        res.append((greedy, norep, sampled))
        print(f"--- prompt {p!r}")
        print(f"[greedy]        {greedy!r}")
        print(f"[greedy,no-rep] {norep!r}")
        print(f"[sampled T=0.8] {sampled!r}")
    model.train()
    return res


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def write_readme(out: Path, args, n_params: int, val_loss: float, train_loss: float,
                 n_train_tok: int, n_val_tok: int, steps: int, wall: float, samples, cmd: str) -> None:
    cfg = json.loads((out / "config.json").read_text())
    n_modules = len(stdlib_stub_documents()) if args.stdlib else 0
    greedy_examples = "\n".join(f"    {s[0]!r}" for s in samples[:3])
    norep_examples = "\n".join(f"    {s[1]!r}" for s in samples[:3])
    text = f"""# tvm_llm default model

A tiny Llama-architecture causal language model (`LlamaForCausalLM`, fp32) that
ships inside the `tvm_llm` package so the tools can be exercised without
downloading anything. It is a toy: it writes Python-documentation-flavoured
text, not facts.

* Architecture: `model_type` llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']},
  intermediate {cfg['intermediate_size']}, {cfg['num_attention_heads']} attention heads /
  {cfg['num_key_value_heads']} KV heads (GQA), head_dim {cfg['head_dim']}, RoPE (theta {cfg.get('rope_theta', (cfg.get('rope_parameters') or {}).get('rope_theta'))}),
  RMSNorm, SiLU MLP, max_position_embeddings {cfg['max_position_embeddings']},
  tie_word_embeddings={str(cfg['tie_word_embeddings']).lower()}.
* Parameters: {n_params:,} ({n_params * 4 / 1e6:.2f} MB in fp32).
* Tokenizer: byte-level BPE trained with `tokenizers`, vocab {cfg['vocab_size']},
  specials `<s>` (bos, id {cfg['bos_token_id']}) and `</s>` (eos, id {cfg['eos_token_id']});
  `encode` prepends `<s>`.
* Training text (all of it ships with CPython {sys.version.split()[0]}): the pydoc help topics
  (`pydoc_data.topics.topics`) plus docstring stubs (`class`/`def` lines with
  their docstrings, extracted with `ast`) of {n_modules} public pure-Python standard-library modules.
  Every {HELDOUT_EVERY}th document is held out; that text is `heldout.txt`
  ({n_val_tok:,} tokens; {n_train_tok:,} training tokens).
* Training: {steps} AdamW steps, batch {args.batch} x {args.seq_len} tokens, peak lr {args.lr},
  warmup + cosine decay, seed {args.seed}; {wall / 60:.1f} min wall with {args.threads} torch
  thread(s) on the machine that made it (the run time depends on how busy the CPU is; the
  result depends on the step count, not on the thread count).
* Final training loss {train_loss:.3f}; validation loss on `heldout.txt`
  {val_loss:.3f}, **perplexity {math.exp(val_loss):.2f}** (windows of {args.seq_len} tokens).

Reproduce (from the repository root):

    {cmd}

Greedy samples (prompts "The for statement", "def ", "The "):

{greedy_examples}

Greedy with `repetition_penalty=1.3, no_repeat_ngram_size=4`:

{norep_examples}
"""
    (out / "README.md").write_text(text)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (replaced)")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget; training stops when spent")
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps (defines the LR schedule)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--max-pos", type=int, default=512)
    ap.add_argument("--untied", dest="tie", action="store_false", help="separate lm_head weights")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--no-stdlib", dest="stdlib", action="store_false", help="pydoc topics only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-bytes", type=int, default=10_000_000, help="fail if the checkpoint is larger")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_docs, held_docs = build_corpus(args.stdlib)
    heldout_text = "\n".join(t for _, t in held_docs)
    if len(heldout_text.encode()) > MAX_HELDOUT_BYTES:
        raise SystemExit(f"held-out text is {len(heldout_text.encode())} bytes > {MAX_HELDOUT_BYTES}")
    n_chars = sum(len(t) for _, t in train_docs)
    print(f"corpus: {len(train_docs)} train docs ({n_chars:,} chars), {len(held_docs)} held-out docs "
          f"({len(heldout_text):,} chars): {', '.join(k for k, _ in held_docs)}", flush=True)

    tok = train_tokenizer([t for _, t in train_docs], args.vocab)
    vocab_size = tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    train_ids = encode_docs(tok, train_docs)
    val_ids = np.asarray(tok.encode(heldout_text).ids + [eos_id], dtype=np.int64)
    print(f"tokenizer: vocab {vocab_size}, {n_chars / len(train_ids):.2f} chars/token; "
          f"{len(train_ids):,} train tokens, {len(val_ids):,} held-out tokens", flush=True)

    model = make_model(args, vocab_size, bos_id, eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} params ({n_params * 4 / 1e6:.2f} MB fp32)  "
          f"hidden {args.hidden} layers {args.layers} heads {args.heads}/{args.kv_heads} "
          f"ffn {args.intermediate} tied={args.tie}", flush=True)
    if n_params * 4 > args.max_bytes - 300_000:
        raise SystemExit("model too large for the size budget")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    data = torch.from_numpy(train_ids)
    hi = len(train_ids) - args.seq_len - 1
    offs = torch.arange(args.seq_len + 1)

    model.train()
    t0 = time.time()
    # Leave ~60 s of the budget for evaluation, samples and saving.
    train_budget = max(30.0, t_start + args.minutes * 60 - 60 - t0)
    deadline = t0 + train_budget
    tokens = 0
    ema = None
    step = 0
    for step in range(args.steps):
        time_frac = (time.time() - t0) / train_budget
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.final_lr_frac, time_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, hi, (args.batch,), generator=gen)
        chunk = data[starts[:, None] + offs]
        logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += chunk[:, :-1].numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0 or step == args.steps - 1:
            el = time.time() - t0
            print(f"step {step:5d}/{args.steps}  loss {loss.item():.3f} (ema {ema:.3f})  lr {lr:.2e}  "
                  f"{tokens / el:,.0f} tok/s  {el:.0f}s", flush=True)
        if args.eval_every and step > 0 and step % args.eval_every == 0:
            vl = evaluate(model, val_ids, args.seq_len)
            print(f"  eval step {step}: val loss {vl:.3f}  ppl {math.exp(vl):.2f}", flush=True)
        if time.time() > deadline:
            print(f"time budget reached after {step + 1} steps", flush=True)
            break
    steps_done = step + 1
    train_wall = time.time() - t0

    val_loss = evaluate(model, val_ids, args.seq_len)
    print(f"final: {steps_done} steps, {tokens:,} tokens in {train_wall:.0f}s; train loss (ema) {ema:.3f}; "
          f"val loss {val_loss:.3f}  val perplexity {math.exp(val_loss):.2f}", flush=True)
    samples = show_samples(model, tok)

    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        model.generation_config.bos_token_id = bos_id
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer_files(tok, tmp, args.max_pos)
        (tmp / "heldout.txt").write_text(heldout_text, encoding="utf-8")
        argv_list = sys.argv[1:] if argv is None else list(argv)
        cmd = "python scripts/train_tiny.py" + "".join(f" {a}" for a in argv_list)
        write_readme(tmp, args, n_params, val_loss, ema, len(train_ids), len(val_ids), steps_done,
                     time.time() - t_start, samples, cmd)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        size = dir_size(tmp)
        print(f"checkpoint: {size:,} bytes ({size / 1e6:.2f} MB)", flush=True)
        if size > args.max_bytes:
            raise SystemExit(f"checkpoint {size} bytes exceeds --max-bytes {args.max_bytes}")
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"saved to {out}  (total {time.time() - t_start:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
