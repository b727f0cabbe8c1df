"""Quality and speed of every quantization of one checkpoint, ours and llama.cpp's, in one table.

    python scripts/bench_quality.py --ckpt ~/.cache/tvm_llm/models/smollm2-135m-instruct \
        --schemes fp32,q8,q4,w8a8,w4a8 --llamacpp F32,Q8_0,Q4_0,Q4_K_M --max-windows 32

For each scheme the checkpoint is built with tvm_llm (cached under ~/.cache/tvm_llm/quality/)
and its perplexity measured through the compiled runtime (tvm_llm/perplexity.py: the text's
tokens cut into non-overlapping windows of --window tokens, each one fresh prefill). llama.cpp
gets the very same token ids per window (a fresh context, all logits) from GGUFs converted and
quantized from the same checkpoint (scripts/llamacpp_ref.py). Then bits per weight and batch-1
decode tok/s (scripts/bench.py's runners, interleaved, medians).

Schemes: `fp32`, `bf16` / `fp16` (unquantized builds in that dtype), a --quantization name
(q8, q4, or a format name), `w8a8` / `w4a8` (q8 / q4 with int8 activations), or NAME/int8; extra
build options after a colon, comma-free: `q4:calibrate=none`, `q4:bits_per_weight=5`,
`q4_k:calibrate=awq+importance`. Every scheme is built as `tvm-llm build` builds it
(BuildConfig.recommended): q8 and q4 without calibration options are our recipe (q4: the
automatic mix under 4.6 stored bits per weight, calibrated; q8: AWQ), `:calibrate=none` the plain
format.

Default text: Isaac Newton's *Opticks* (Project Gutenberg), which ships with apache-tvm-ffi (a
dependency of tvm_llm) as tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt: English
prose none of us wrote, disjoint from the calibration text (Python's pydoc topics).

Bits per weight, two ways: "all" = stored bytes of every tensor but the embedding lookup table
(linears, their scales, the LM head; norms included, < 0.01 bit) over the linear weights incl.
the LM head (a tied embedding counted once, as the head); "body" = the same without the LM head
(decoder layers only). llama.cpp: the same over its GGUF tensors (token_embd is the head of a
tied model). Never a test: figures.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm", "quality")


def default_text() -> str:
    import tvm_ffi

    return os.path.join(os.path.dirname(tvm_ffi.__file__), "3rdparty", "libbacktrace",
                        "Isaac.Newton-Opticks.txt")


def parse_scheme(spec: str) -> tuple:
    """(label, tvm_llm.build keyword arguments) of a --schemes entry."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from bench import entry_options

    name, options = entry_options(spec)
    kw: dict = {}
    if name == "fp32":
        pass
    elif name in ("bf16", "fp16"):  # unquantized, in that dtype (--dtype bfloat16 / float16)
        kw = {"dtype": "bfloat16" if name == "bf16" else "float16"}
    elif name in ("w8a8", "w4a8"):
        kw = {"quantization": "q8" if name == "w8a8" else "q4", "activations": "int8"}
    else:
        q, _, act = name.partition("/")
        kw = {"quantization": q, **({"activations": act} if act else {})}
    kw.update(options)
    return spec, kw


def build(ckpt: str, spec: str, kw: dict, rebuild: bool, window: int) -> str:
    import json

    import tvm_llm
    from bench import file_tag
    from tvm_llm.config import BuildConfig

    out = os.path.join(CACHE, f"{os.path.basename(os.path.abspath(ckpt))}-{file_tag(spec)}")
    config = BuildConfig.recommended(context_window=max(512, window + 1), max_batch_size=1,
                                     prefill_chunk_size=window, **kw)
    # the options the cached build was made with (a build of other options is made again)
    asked = repr(config.options())
    stamp = os.path.join(out, "bench_quality_options.txt")
    cached = False
    if os.path.isfile(stamp):
        with open(stamp) as f:
            cached = f.read() == asked
    if rebuild or not cached or not os.path.isfile(os.path.join(out, "manifest.json")):
        os.makedirs(CACHE, exist_ok=True)
        tvm_llm.build(ckpt, out, config, force=True, log=lambda *a: print("#", *a, flush=True))
        with open(stamp, "w") as f:
            f.write(asked)
    with open(os.path.join(out, "manifest.json")) as f:
        json.load(f)
    return out


def _dims(ckpt: str) -> tuple:
    """(vocab, hidden, linear weights incl. the head, linear weights of the decoder layers)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt).get_text_config()
    V, H = cfg.vocab_size, cfg.hidden_size
    L, I = cfg.num_hidden_layers, cfg.intermediate_size
    D = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * D
    q = cfg.num_attention_heads * D
    body = L * (H * (q + 2 * kv) + q * H + 3 * H * I)
    return V, H, body + V * H, body


from tvm_llm.quantization.report import stored_bytes  # noqa: E402  (used by the tests too)


def ours_bits_per_weight(out: str, ckpt: str) -> tuple:
    """(bits per weight over all linears incl. the head, over the decoder layers only): stored
    bytes of the build's tensors but the embedding lookup table, see the module docstring."""
    import json

    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    V, H, n_all, n_body = _dims(ckpt)
    all_bytes, head_bytes = stored_bytes(manifest["params"], V, H,
                                         (manifest.get("quantization") or {}).get("quantized") or {})
    return 8 * all_bytes / n_all, 8 * (all_bytes - head_bytes) / n_body


def llamacpp_bits_per_weight(gguf_path: str) -> tuple:
    """The same two figures over a GGUF's tensors (token_embd is the head of a tied model)."""
    import gguf

    r = gguf.GGUFReader(gguf_path)
    names = {t.name for t in r.tensors}
    tied = "output.weight" not in names
    head = "token_embd.weight" if tied else "output.weight"
    bits = {"all": 0, "body": 0}
    n = {"all": 0, "body": 0}
    for t in r.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        shape = [int(d) for d in t.shape]
        size = math.prod(shape) if len(shape) == 2 else 0
        for k in ("all", "body"):
            if k == "body" and t.name in (head, "output_norm.weight"):
                continue
            bits[k] += 8 * int(t.n_bytes)
            n[k] += size
    return bits["all"] / n["all"], bits["body"] / n["body"]


def llamacpp_perplexity(gguf_path: str, wins: list, threads: int) -> dict:
    """Perplexity of the GGUF on the same windows (token ids) as ours: each window a fresh
    context, evaluated in one batch with the logits of every position."""
    import llama_cpp
    import numpy as np

    sys.path.insert(0, os.path.join(HERE, ".."))
    from tvm_llm.perplexity import _nll, _result

    W = len(wins[0]) - 1
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=W + 8, n_batch=W, n_ubatch=W,
                          n_threads=threads, n_threads_batch=threads, logits_all=True,
                          verbose=False)
    try:
        total = 0.0
        for w in wins:
            llm.reset()
            llm.eval(w[:-1])
            logits = np.array(llm.scores[:W], dtype=np.float32)
            total += _nll(logits, np.asarray(w[1:]))
    finally:
        llm.close()
    return _result(total, len(wins) * W, len(wins))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="HF checkpoint directory")
    p.add_argument("--text", default=None, help="evaluation text (default: Newton's Opticks, "
                   "shipped with apache-tvm-ffi)")
    p.add_argument("--schemes", default="fp32,q8,q4,w8a8,w4a8")
    p.add_argument("--llamacpp", default="F32,Q8_0,Q4_0,Q4_K_M")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-windows", type=int, default=32)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-speed", action="store_true", help="perplexity and bits only")
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rebuild", action="store_true")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, ".."))
    import bench
    import llamacpp_ref
    from tokenizers import Tokenizer

    from tvm_llm.perplexity import engine_perplexity, read_text, windows
    from tvm_llm.runtime.engine import Engine

    text_path = args.text or default_text()
    text = read_text(text_path)
    ids = Tokenizer.from_file(os.path.join(args.ckpt, "tokenizer.json")).encode(text).ids
    wins = windows(ids, args.window, args.max_windows)
    print(f"# {args.ckpt}\n# text {text_path}: {len(wins)} windows of {args.window} tokens "
          f"({len(wins) * args.window} tokens), {args.threads} threads", flush=True)
    rows, runners = [], []
    for spec in [s.strip() for s in args.schemes.split(",") if s.strip()]:
        label, kw = parse_scheme(spec)
        out = build(args.ckpt, spec, kw, args.rebuild, args.window)
        r = engine_perplexity(Engine(out, num_threads=args.threads), text, args.window,
                              args.max_windows)
        rows.append({"system": f"tvm_llm {label}", "ppl": r["perplexity"],
                     "bpw": ours_bits_per_weight(out, args.ckpt)})
        q = Engine(out).manifest.get("quantization") or {}
        if q.get("calibration"):
            print(f"#   calibration: {q['calibration'].get('awq', '')} "
                  f"{q['calibration'].get('mix', '')}", flush=True)
        print(f"# tvm_llm {label}: perplexity {r['perplexity']:.4f}", flush=True)
        if not args.no_speed:
            runners.append(bench.TvmRunner(out, args.threads, name=f"tvm_llm {label}"))
    qtypes = [q.strip().upper() for q in args.llamacpp.split(",") if q.strip()]
    ok, why = llamacpp_ref.available()
    if qtypes and not ok:
        print(f"# llama.cpp not measured: {why}")
        qtypes = []
    for qt in qtypes:
        path = llamacpp_ref.gguf_path(args.ckpt, qt, args.threads)
        r = llamacpp_perplexity(path, wins, args.threads)
        rows.append({"system": f"llama.cpp {qt}", "ppl": r["perplexity"],
                     "bpw": llamacpp_bits_per_weight(path)})
        print(f"# llama.cpp {qt}: perplexity {r['perplexity']:.4f}", flush=True)
        if not args.no_speed:
            runners.append(llamacpp_ref.LlamaCppRunner(args.ckpt, qt, args.threads,
                                                       n_ctx=args.prompt_len + args.gen_len + 8))
    speed = bench.measure(runners, args.prompt_len, args.gen_len, args.repeats) if runners else {}
    base = {r["system"].split()[0]: r["ppl"] for r in rows
            if r["system"] in ("tvm_llm fp32", "llama.cpp F32")}
    print(f"\n| system | perplexity | vs its fp32 | bits/weight all (body) | decode tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        ref = base.get(r["system"].split()[0])
        rel = f"{100 * (r['ppl'] / ref - 1):+.2f}%" if ref else "-"
        dec = speed.get(r["system"], {}).get("decode_tok_s")
        print(f"| {r['system']} | {r['ppl']:.3f} | {rel} | {r['bpw'][0]:.2f} ({r['bpw'][1]:.2f}) | "
              f"{'-' if dec is None else f'{dec:.1f}'} |")
    print(f"# decode: batch 1, prompt {args.prompt_len}, {args.gen_len} tokens, median of "
          f"{args.repeats}, interleaved; bits/weight counted as in the script's docstring")
    return 0


if __name__ == "__main__":
    sys.exit(main())
