"""Prefill and decode speed of tvm_llm against transformers eager, measured in one run.

    python scripts/bench.py --shape llama-110m --threads 2
    python scripts/bench.py --shape llama-1b --threads 2 --quantization fp32,q8,q4,w8a8 \
        --llamacpp Q8_0,Q4_0 --no-transformers      # quantized builds against llama.cpp

Random fp32 weights of a Llama shape (speed does not depend on values), batch 1, a prompt of
--prompt-len tokens, then --gen-len greedy tokens. Systems are measured interleaved, --repeats
times each, and medians are printed with ratios. Never a test: figures, not assertions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SHAPES = {
    "llama-110m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, intermediate_size=2048, vocab_size=32000),
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, intermediate_size=5632, vocab_size=32000),
    "llama-tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=256, vocab_size=1000),
}
ABLATION_PHASES = ("import_cleanup", "fusion", "folding", "scheduling")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm", "bench")


def make_checkpoint(shape: str) -> str:
    """A random-weight Llama checkpoint of `shape` (cached), with the bundled tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(CACHE, shape)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import make_tokenizer

    make_tokenizer(tmp)  # a small BPE: the benchmark feeds token ids, any tokenizer will do
    shutil.rmtree(path, ignore_errors=True)  # a partial earlier run
    os.replace(tmp, path)
    return path


def build_model(ckpt: str, shape: str, rebuild: bool, **build_kwargs) -> str:
    import tvm_llm

    tag = build_kwargs.pop("tag", "default")
    out = os.path.join(CACHE, f"{shape}-{tag}-out")
    manifest = os.path.join(out, "manifest.json")
    stale = False
    if os.path.isfile(manifest):
        with open(manifest) as f:
            m = json.load(f)
        # a build from before the weight formats, or with another KV cache dtype: rebuild it
        stale = bool(build_kwargs.get("quantization")) and "format_counts" not in (m.get("quantization") or {})
        stale = stale or cache_dtype(m) != build_kwargs.get("kv_dtype", build_kwargs.get("dtype", "float32"))
    if rebuild or stale or not os.path.isfile(manifest):
        t0 = time.perf_counter()
        tvm_llm.build(ckpt, out, force=True, log=lambda *a: None, **build_kwargs)
        print(f"# built {shape} [{tag}] in {time.perf_counter() - t0:.1f}s -> {out}", flush=True)
    return out


class TransformersRunner:
    name = "transformers eager"

    def __init__(self, ckpt: str, threads: int, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        if dtype != "float32":
            self.name = f"transformers eager {dtype}"
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()

    def run(self, prompt, gen_len):
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(ids, use_cache=True)
            t1 = time.perf_counter()
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            t2 = time.perf_counter()
            for _ in range(gen_len):
                out = self.model(tok, cache=cache, use_cache=True)
                cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            t3 = time.perf_counter()
        return t1 - t0, t3 - t2


class TvmRunner:
    def __init__(self, out: str, threads: int, name="tvm_llm"):
        from tvm_llm import Engine

        self.name = name
        self.engine = Engine(out, num_threads=threads, max_batch_size=1)

    def run(self, prompt, gen_len):
        import numpy as np

        eng = self.engine
        sid = eng.cache.add()
        chunk = eng.cache.prefill_chunk_size  # a longer prompt goes in chunks, as generate's do
        t0 = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            logits = eng.prefill([(sid, prompt[i:i + chunk])])
        t1 = time.perf_counter()
        tok = int(np.argmax(logits[0]))
        t2 = time.perf_counter()
        for _ in range(gen_len):
            tok = int(np.argmax(eng.decode_step([sid], [tok])[0]))
        t3 = time.perf_counter()
        eng.cache.remove(sid)
        return t1 - t0, t3 - t2


class BandwidthProbe:
    """The machine's read bandwidth at this moment (GB/s): torch's sum over a 256 MB buffer at
    `threads` threads, best of 3 (~0.1 s). The buffer lies on transparent huge pages, as the
    engine's weights do (runtime/engine.py _huge_page_arena): on 4 KiB pages the same sum reads
    ~15-20% less on our machines (a TLB miss and a prefetcher stop every 4 KiB), which made
    half-precision builds show more than 1.0 of a roofline measured that way. The VM's bandwidth
    drifts by up to 2x within minutes, so `measure` probes before and after every timed run and
    each run's roofline share uses its own probes."""

    SETTLE_S = 0.3  # idle time after a probe, before the next timed run

    def __init__(self, threads: int, mb: int = 256):
        import mmap

        import torch

        self.torch, self.threads = torch, threads
        self.region = mmap.mmap(-1, mb * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP refused: ordinary pages
        self.buf = torch.frombuffer(self.region, dtype=torch.float32)
        self.buf.fill_(1.0)

    def __call__(self, tries: int = 3) -> float:
        self.torch.set_num_threads(self.threads)
        best = 0.0
        for _ in range(tries):
            t0 = time.perf_counter()
            self.buf.sum()
            best = max(best, self.buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        # torch's OpenMP workers spin on after the sum and take cores from the run that
        # follows: measured, a 128-token prefill right after a probe was ~15% slower
        time.sleep(self.SETTLE_S)
        return best


class SgemmProbe:
    """The machine's float32 GEMM rate at this moment (GFLOP/s): torch's 2048^3 sgemm at
    `threads` threads, best of 3 (~0.1 s). The VM's clock moves with its neighbours (this probe
    read 304-424 within a day on one Xeon), so `measure` probes around every timed run, as it
    does the bandwidth, and each run's prefill share uses its own probes."""

    def __init__(self, threads: int, n: int = 2048):
        import torch

        self.torch, self.threads = torch, threads
        self.a, self.b = torch.randn(n, n), torch.randn(n, n)

    def __call__(self, tries: int = 3) -> float:
        self.torch.set_num_threads(self.threads)
        best = 0.0
        for _ in range(tries):
            t0 = time.perf_counter()
            self.a @ self.b
            best = max(best, 2 * self.a.shape[0] ** 3 / (time.perf_counter() - t0) / 1e9)
        time.sleep(BandwidthProbe.SETTLE_S)  # torch's workers spin on (see BandwidthProbe)
        return best


def measure(runners, prompt_len, gen_len, repeats, warmup=1, probe=None, flops_probe=None):
    """Medians over `repeats` interleaved rounds (after `warmup` rounds) per system: prefill and
    decode tok/s, and with a `probe` (BandwidthProbe) the read bandwidth around each timed run,
    with a `flops_probe` (SgemmProbe) the sgemm rate around it (each the mean of a probe just
    before and just after the run), kept per run in "runs"."""
    import numpy as np

    def probes():
        return (probe() if probe else 0.0, flops_probe() if flops_probe else 0.0)

    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 1000, size=prompt_len)]
    samples = {r.name: [] for r in runners}
    for rep in range(warmup + repeats):
        for r in runners:  # interleaved, so machine noise hits every system alike
            before = probes() if rep >= warmup else (0.0, 0.0)
            pre, dec = r.run(prompt, gen_len)
            if rep >= warmup:
                after = probes()
                samples[r.name].append((prompt_len / pre, gen_len / dec, (before[0] + after[0]) / 2,
                                        (before[1] + after[1]) / 2))
    return {name: {"prefill_tok_s": statistics.median(s[0] for s in v),
                   "decode_tok_s": statistics.median(s[1] for s in v),
                   "runs": [{"prefill_tok_s": p, "decode_tok_s": d, "read_GB_s": b, "sgemm_GFLOP_s": f}
                            for p, d, b, f in v]}
            for name, v in samples.items()}


def machine_limits(threads: int) -> dict:
    """Measured read bandwidth (GB/s, BandwidthProbe: a 256 MB reduction on huge pages) and fp32
    sgemm (GFLOP/s, SgemmProbe: 2048^3), both with torch at `threads` threads, best of 5."""
    return {"read_GB_s": BandwidthProbe(threads)(5), "sgemm_GFLOP_s": SgemmProbe(threads)(5)}


# Bytes per matmul weight as stored (scales included) of llama.cpp's formats; Q4_K_M is its
# mix (Q4_K at 144 bytes / 256, Q6_K for the LM head and half of attn_v / ffn_down): ~4.85 bits.
BYTES_PER_WEIGHT = {"fp32": 4.0, "F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32,
                    "Q4_K_M": 4.85 / 8}


FLOAT_BUILDS = {"bf16": "bfloat16", "fp16": "float16"}


def entry_options(spec: str) -> tuple:
    """(name, extra build() options) of an entry NAME[:key=value;key=value...] (a comma inside
    a value written as '+'; bits_per_weight a number), e.g. `q4:bits_per_weight=4.8;bits_count=all`
    (here and in scripts/bench_quality.py's --schemes)."""
    name, _, opts = spec.partition(":")
    kw: dict = {}
    for opt in filter(None, opts.split(";")):
        key, _, value = opt.partition("=")
        value = value.replace("+", ",")
        kw[key] = float(value) if key == "bits_per_weight" else value
    return name, kw


def file_tag(spec: str) -> str:
    """`spec` as part of a file name: characters other than letters, digits and ._- become _."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)


def tvm_build_options(q: str) -> dict:
    """build() options of a --quantization entry's name: q8 / q4 (our defaults for this CPU), a
    format name (q8_0, q4_0, q4_1, q4_k...: the build's default activations for this CPU, int16
    where it has integer dot products: x86 with AVX2 or AVX-512), a format with `_a8` / `_a16` /
    `_float` (int8 / int16 / float activations), or bf16 / fp16 (an unquantized build in that
    dtype: --dtype bfloat16 / float16). Options after a colon: entry_options."""
    if q in FLOAT_BUILDS:
        return dict(dtype=FLOAT_BUILDS[q])
    for suffix, activations in (("_a8", "int8"), ("_a16", "int16"), ("_float", "float")):
        if q.endswith(suffix):
            return dict(quantization=q[:-len(suffix)], activations=activations)
    if q in CLI_RECIPES:  # q4 / q8 as `tvm-llm build --quantization` makes them
        return dict(quantization=q, **CLI_RECIPES[q])
    return dict(quantization=q)


# The CLI's q4 is the automatic mix (q4_k with the most sensitive matrices and the LM head in
# q8_0) under 4.6 bits per weight; its AWQ scaling only changes weight values, not the formats
# or the kernels, so it is left out here (it would calibrate random weights, minutes on
# llama-1b). q8 is q8_0 everywhere with or without AWQ.
# Both take the CLI's float16 KV cache (tvm_llm.config.RECOMMENDED_KV_DTYPE).
CLI_RECIPES = {"q4": {"bits_per_weight": 4.6, "calibrate": "none", "kv_dtype": "float16"},
               "q8": {"kv_dtype": "float16"}}


def cli_budget(kw: dict) -> float:
    """The bits-per-weight budget `tvm-llm build` gives these options: 4.6 stored bits where the
    kernels take int8 activations, more where a weight-only layout stores q4_k at 6 bits (e.g.
    `--activations float`, or an aarch64 target); see BuildConfig.from_args."""
    from tvm_llm.config import BuildConfig
    from tvm_llm.quantization.calibration import layout_budget

    scheme = BuildConfig.create(**kw).scheme
    return layout_budget(kw["bits_per_weight"], scheme.format, scheme.activations)


def stored_decode_bytes(out: str, shape: str) -> float:
    """Bytes a decode step reads from our build's weights: every stored tensor but the
    embedding lookup table (tvm_llm.quantization.report.stored_bytes), as the build laid them out
    (mixed formats, scales, packing included)."""
    from tvm_llm.quantization.report import stored_bytes

    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    s = SHAPES[shape]
    return float(stored_bytes(manifest["params"], s["vocab_size"], s["hidden_size"],
                              (manifest.get("quantization") or {}).get("quantized") or {})[0])


def cache_dtype(manifest: dict) -> str:
    """A build's KV cache dtype (builds from before the manifest recorded it: the build dtype)."""
    return (manifest.get("kv_cache") or {}).get("dtype") or manifest.get("dtype", "float32")


def kv_value_bytes(out: str) -> int:
    """Bytes per cached K/V value of a build (its manifest's cache_dtype)."""
    from tvm_llm.memory.kv_budget import dtype_bytes

    with open(os.path.join(out, "manifest.json")) as f:
        return dtype_bytes(cache_dtype(json.load(f)))


def model_costs(shape: str, context: int, bytes_per_weight: float = 4.0,
                kv_bytes_per_value: int = 4, prompt_len: int = 1) -> dict:
    """Bytes read per decode token (every weight but the embedding table, at
    `bytes_per_weight`, plus the KV cache at `context` tokens, `kv_bytes_per_value` each: 4 for
    fp32 and quantized builds, 2 for bf16/fp16 builds and llama.cpp's default f16 cache) and
    FLOPs per prefill token of a `prompt_len`-token prompt (2 per weight multiply-add; the LM
    head once a prompt, for the next token's logits, as our runtime and llama.cpp compute it:
    counted per token, it had put llama-110m's prefill share 1.32x too high at 128 tokens,
    llama-1b's 1.07x at 64)."""
    s = SHAPES[shape]
    h, L, i, v = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    hd = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    matmul_params = L * per_layer + h * v + h
    kv_bytes = 2 * L * kv * kv_bytes_per_value * context
    return {"decode_bytes": matmul_params * bytes_per_weight + kv_bytes,
            "prefill_flops": 2 * (matmul_params - h * v) + 2 * h * v / prompt_len}


def print_limits(results, limits, costs, per_system=None):
    """Roofline shares. `per_system`: {system name: its costs} where they differ (quantized
    weights). A system's decode share is the median over its timed runs of bytes per token x
    tok/s / the bandwidth probed around that run, its prefill share the median of FLOPs per
    token x tok/s / the sgemm rate probed around that run (measure); without probes,
    `limits`' one."""
    def span(key):
        runs = [r.get(key) for v in results.values() for r in v.get("runs", ()) if r.get(key)]
        return (f" (probed around each run: {min(runs):.1f}-{max(runs):.1f}, median "
                f"{statistics.median(runs):.1f})") if runs else ""

    print(f"# machine: read {limits['read_GB_s']:.1f} GB/s{span('read_GB_s')}, sgemm "
          f"{limits['sgemm_GFLOP_s']:.0f} GFLOP/s{span('sgemm_GFLOP_s')}; roofline decode "
          f"{limits['read_GB_s'] * 1e9 / costs['decode_bytes']:.1f} tok/s, "
          f"prefill {limits['sgemm_GFLOP_s'] * 1e9 / costs['prefill_flops']:.0f} tok/s")
    for name, r in results.items():
        c = (per_system or {}).get(name, costs)
        probed = [x for x in r.get("runs", ()) if x["read_GB_s"]]
        if probed:
            bw = statistics.median(x["read_GB_s"] for x in probed)
            dec = statistics.median(x["decode_tok_s"] * c["decode_bytes"] / 1e9 / x["read_GB_s"]
                                    for x in probed)
        else:
            bw = limits["read_GB_s"]
            dec = r["decode_tok_s"] * c["decode_bytes"] / 1e9 / bw
        flops_probed = [x for x in r.get("runs", ()) if x.get("sgemm_GFLOP_s")]
        if flops_probed:
            pre = statistics.median(x["prefill_tok_s"] * costs["prefill_flops"] / 1e9
                                    / x["sgemm_GFLOP_s"] for x in flops_probed)
        else:
            pre = r["prefill_tok_s"] * costs["prefill_flops"] / 1e9 / limits["sgemm_GFLOP_s"]
        print(f"  {name:<26} decode {dec:.2f} of its bandwidth roofline ({bw * 1e9 / c['decode_bytes']:.1f} "
              f"tok/s at {bw:.1f} GB/s), prefill {pre:.2f} of sgemm peak")


def print_table(results, reference="transformers eager"):
    ref = results.get(reference)
    print(f"{'system':<28}{'prefill tok/s':>15}{'decode tok/s':>15}{'prefill x':>11}{'decode x':>10}")
    for name, r in results.items():
        rp = f"{r['prefill_tok_s'] / ref['prefill_tok_s']:.2f}" if ref else "-"
        rd = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}" if ref else "-"
        print(f"{name:<28}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.2f}{rp:>11}{rd:>10}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-110m", choices=sorted(SHAPES))
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rebuild", action="store_true", help="rebuild even if a cached build exists")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--quantization", default="fp32",
                   help="comma list of builds to measure: fp32, bf16 / fp16 (unquantized builds "
                        "with --dtype bfloat16 / float16), q8, q4 (our defaults), a format "
                        "(q8_0, q4_0, q4_1, q4_k; the build's default activations) or a format "
                        "with _a8 / _a16 / _float (int8 / int16 / float activations), e.g. "
                        "fp32,bf16,q8,q4,q4_k,q4_0_a8,q4_0_float (default fp32)")
    p.add_argument("--llamacpp", default="",
                   help="comma list of llama.cpp formats measured in the same run (F32, F16, BF16, Q8_0, "
                        "Q4_0, Q4_K_M); needs llama-cpp-python, see scripts/llamacpp_ref.py")
    p.add_argument("--arch", default=None,
                   help="llvm --arch for our builds, e.g. x86-64-v3 (AVX2, no VNNI: the integer "
                        "kernels on vpmaddubsw); default: the host CPU")
    p.add_argument("--ablation", action="store_true",
                   help="also build with each optional pass phase switched off and compare")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)

    ckpt = make_checkpoint(args.shape)
    context = args.prompt_len + args.gen_len // 2
    builds = [q.strip() for q in args.quantization.split(",") if q.strip()]
    per_system = {}
    runners = [] if args.no_transformers else [TransformersRunner(ckpt, args.threads)]
    if not args.no_transformers:  # torch in the same half dtype as a bf16/fp16 build
        for q in builds:
            if q in FLOAT_BUILDS:
                runners.append(TransformersRunner(ckpt, args.threads, FLOAT_BUILDS[q]))
                per_system[runners[-1].name] = model_costs(args.shape, context, 2.0, 2)
    for q in builds:
        if q == "fp32" and not args.arch:
            out, name = build_model(ckpt, args.shape, args.rebuild), "tvm_llm"
        else:
            entry, extra = entry_options(q)
            kw = {} if entry == "fp32" else tvm_build_options(entry)
            kw.update(extra)
            tag = q + (f"-{args.arch}" if args.arch else "")
            if args.arch:
                kw["arch"] = args.arch
            if "bits_per_weight" in CLI_RECIPES.get(entry, {}) and "bits_per_weight" not in extra:
                kw["bits_per_weight"] = cli_budget(kw)  # the CLI's, for this target's kernel layout
            out, name = build_model(ckpt, args.shape, args.rebuild, tag=file_tag(tag), **kw), f"tvm_llm {tag}"
        runners.append(TvmRunner(out, args.threads, name=name))
        costs = model_costs(args.shape, context, 0.0, kv_value_bytes(out))
        costs["decode_bytes"] += stored_decode_bytes(out, args.shape)  # KV + stored weights
        per_system[name] = costs
    if args.llamacpp:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import llamacpp_ref

        ok, why = llamacpp_ref.available()
        if not ok:
            print(f"# llama.cpp not measured: {why}")
        else:
            for qt in [q.strip() for q in args.llamacpp.split(",") if q.strip()]:
                r = llamacpp_ref.LlamaCppRunner(ckpt, qt, args.threads,
                                                n_ctx=args.prompt_len + args.gen_len + 8)
                runners.append(r)
                # llama.cpp keeps its KV cache in f16 by default: 2 bytes a value
                per_system[r.name] = model_costs(args.shape, context, BYTES_PER_WEIGHT[qt.upper()], 2)
    if args.ablation:
        for phase in ABLATION_PHASES:
            off = build_model(ckpt, args.shape, args.rebuild, tag=f"no-{phase}",
                              disabled_phases=(phase,))
            runners.append(TvmRunner(off, args.threads, name=f"tvm_llm without {phase}"))
    print(f"# {args.shape}, batch 1, prompt {args.prompt_len}, generate {args.gen_len}, "
          f"{args.threads} threads, median of {args.repeats}", flush=True)
    results = measure(runners, args.prompt_len, args.gen_len, args.repeats,
                      probe=BandwidthProbe(args.threads), flops_probe=SgemmProbe(args.threads))
    print_table(results)
    limits = machine_limits(args.threads)
    print_limits(results, limits, model_costs(args.shape, context, prompt_len=args.prompt_len),
                 per_system)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "machine": limits}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
