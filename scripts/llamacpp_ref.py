"""llama.cpp prefill and decode speed on the benchmark checkpoints, as a reference figure.

    python scripts/llamacpp_ref.py --shape llama-110m --threads 2 --qtypes F32,Q8_0,Q4_0

A benchmark reference only, never a dependency of tvm_llm: it needs `llama-cpp-python`
(built from its sdist, see INSTALL below) and, to convert a checkpoint, the llama.cpp
conversion scripts that its sdist carries (found or fetched with pip, then kept under
~/.cache/tvm_llm/llamacpp/). GGUFs are cached under ~/.cache/tvm_llm/gguf/<ckpt>-<qtype>.gguf:
the HF checkpoint is converted to F32 once, and Q8_0/Q4_0/Q4_K_M (and F16) are made from that
F32 file with llama.cpp's own quantizer (`llama_model_quantize`, its default mix: for Q4_0 that
keeps output.weight at Q6_K, as `llama-quantize` does; Q4_K_M is its k-quant mix, which falls
back to other types for tensors whose rows are not a multiple of 256).

Timing matches scripts/bench.py: the same prompt (numpy rng(0) ids in [10, 1000)), prefill =
the prompt's eval (last-token logits included), decode = `gen_len` single-token evals with a
greedy argmax each; one warm-up, then the median of `repeats`. llama.cpp's threads wait on a
spinning barrier: with another job on a 2-core machine its 2-thread figures drop 5-10x, so the
CLI reports how busy the CPUs were (and can --wait-quiet); time on a quiet machine.

As a module (for another benchmark):

    import llamacpp_ref
    ok, why = llamacpp_ref.available()
    r = llamacpp_ref.measure(ckpt_dir, "Q8_0", threads=2, prompt_len=128, gen_len=128, repeats=3)
    runner = llamacpp_ref.LlamaCppRunner(ckpt_dir, "Q4_0", threads=2)  # bench.py runner API
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2 '
           'python -m pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36 gguf')
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm")
GGUF_DIR = os.path.join(CACHE, "gguf")
SRC_DIR = os.path.join(CACHE, "llamacpp")  # sdists and the conversion scripts unpacked from them
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M")
_FTYPE = {"F16": "LLAMA_FTYPE_MOSTLY_F16", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
          "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def _log(msg: str) -> None:
    print(f"# llamacpp_ref: {msg}", file=sys.stderr, flush=True)


def available() -> tuple[bool, str]:
    """(True, 'llama-cpp-python X (lib ...)') when llama.cpp can be loaded, else (False, why)."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or OSError/RuntimeError loading the shared library
        return False, (f"llama-cpp-python not usable ({type(e).__name__}: {e}); "
                       f"install it with: {INSTALL}")
    lib = os.environ.get("LLAMA_CPP_LIB_PATH")
    return True, f"llama-cpp-python {llama_cpp.__version__}" + (f" (lib {lib})" if lib else "")


# ----------------------------------------------------------------------------- conversion

def _extract_convert(sdist: str) -> str | None:
    """Unpack convert_hf_to_gguf.py, conversion/ and gguf-py/ of a llama-cpp-python sdist
    into SRC_DIR (once); the path of the script, or None if the sdist has none."""
    base = os.path.basename(sdist)
    for suffix in (".tar.gz", ".tgz"):
        base = base[: -len(suffix)] if base.endswith(suffix) else base
    dest = os.path.join(SRC_DIR, base)
    script = os.path.join(dest, "convert_hf_to_gguf.py")
    if os.path.isfile(script):
        return script
    tmp = tempfile.mkdtemp(dir=SRC_DIR, prefix=".unpack-")
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/")
                if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or not m.isfile():
                    continue
                rest = parts[3:]
                if rest == ["convert_hf_to_gguf.py"] or rest[0] in ("conversion", "gguf-py"):
                    m.name = "/".join(rest)
                    members.append(m)
            if not any(m.name == "convert_hf_to_gguf.py" for m in members):
                return None
            tar.extractall(tmp, members=members)
        os.replace(tmp, dest)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return script


def convert_script() -> str:
    """Path of llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/ beside it),
    matching the installed llama-cpp-python when possible. Looked for, in order: $LLAMA_CPP_CONVERT;
    a copy already unpacked under SRC_DIR; a llama-cpp-python sdist in SRC_DIR or $LLAMA_CPP_SDIST;
    else the sdist is fetched with `pip download` into SRC_DIR."""
    env = os.environ.get("LLAMA_CPP_CONVERT")
    if env:
        if not os.path.isfile(env):
            raise FileNotFoundError(f"LLAMA_CPP_CONVERT={env} does not exist")
        return env
    os.makedirs(SRC_DIR, exist_ok=True)
    try:
        import llama_cpp
        version = llama_cpp.__version__
    except Exception:
        version = None
    pattern = f"llama_cpp_python-{version or '*'}"
    found = sorted(glob.glob(os.path.join(SRC_DIR, pattern, "convert_hf_to_gguf.py")))
    if found:
        return found[-1]
    sdists = [os.environ["LLAMA_CPP_SDIST"]] if os.environ.get("LLAMA_CPP_SDIST") else []
    sdists += sorted(glob.glob(os.path.join(SRC_DIR, pattern + ".tar.gz")))
    if not sdists:
        spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
        _log(f"fetching the {spec} sdist for convert_hf_to_gguf.py")
        # the sdist only: with --no-binary :all: pip also took the build backend's own build
        # dependencies as sources (it compiled cmake to read the package's metadata)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        "-d", SRC_DIR, spec], check=True, stdout=subprocess.DEVNULL)
        sdists = sorted(glob.glob(os.path.join(SRC_DIR, pattern + ".tar.gz")))
    for sdist in reversed(sdists):
        script = _extract_convert(sdist)
        if script:
            return script
    raise FileNotFoundError(f"no convert_hf_to_gguf.py in {sdists or 'any llama-cpp-python sdist'}")


# Runs convert_hf_to_gguf.main() in a child process, with two patches for the benchmark
# checkpoints, which carry only a small byte-level BPE tokenizer.json: a checkpoint without
# tokenizer.model skips the SentencePiece path without importing sentencepiece (not installed
# here), and a BPE tokenizer whose hash the script does not know is written with GPT-2's
# byte-level pre-tokenizer, which is what it has (the vocabulary does not matter to a speed
# measurement, which feeds token ids).
_CONVERT_WRAPPER = r"""
import os, sys
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
sys.argv = [script] + sys.argv[2:]
import convert_hf_to_gguf as c
from conversion import base
_orig_sp = base.TextModel._create_vocab_sentencepiece
def _sp(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_sp(self, *a, **k)
base.TextModel._create_vocab_sentencepiece = _sp
_orig = base.TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = _pre
c.main()
"""


def _convert_f32(ckpt_dir: str, out: str) -> None:
    script = convert_script()
    tmp = out + f".tmp{os.getpid()}"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _CONVERT_WRAPPER, script, ckpt_dir,
                               "--outtype", "f32", "--outfile", tmp],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0 or not os.path.isfile(tmp):
            raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n"
                               + proc.stdout[-4000:])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _log(f"converted {ckpt_dir} -> {out} (F32) in {time.perf_counter() - t0:.1f}s")


def _quantize(src: str, out: str, qtype: str, threads: int) -> None:
    import llama_cpp

    tmp = out + f".tmp{os.getpid()}"
    t0 = time.perf_counter()
    try:
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, _FTYPE[qtype])
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params)
        if rc != 0 or not os.path.isfile(tmp):
            raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) returned {rc}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _log(f"quantized {os.path.basename(src)} -> {out} ({qtype}) in {time.perf_counter() - t0:.1f}s")


def gguf_path(ckpt_dir: str, qtype: str, threads: int | None = None) -> str:
    """Cached GGUF of the HF checkpoint `ckpt_dir` at `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_K_M), made on
    first use: ~/.cache/tvm_llm/gguf/<basename>-<qtype>.gguf. A GGUF older than the checkpoint's
    weights is remade. Files are written to a temporary name and renamed."""
    qtype = qtype.upper()
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r}: one of {', '.join(QTYPES)}")
    ckpt_dir = os.path.abspath(ckpt_dir)
    os.makedirs(GGUF_DIR, exist_ok=True)
    name = os.path.basename(ckpt_dir.rstrip(os.sep))
    out = os.path.join(GGUF_DIR, f"{name}-{qtype}.gguf")
    weights = [os.path.getmtime(p) for p in glob.glob(os.path.join(ckpt_dir, "*.safetensors"))
               + glob.glob(os.path.join(ckpt_dir, "*.bin"))]
    stamp = max(weights, default=0.0)
    if os.path.isfile(out) and os.path.getmtime(out) >= stamp:
        return out
    if qtype == "F32":
        _convert_f32(ckpt_dir, out)
    else:
        src = gguf_path(ckpt_dir, "F32")
        _quantize(src, out, qtype, threads or len(os.sched_getaffinity(0)))
    return out


# ----------------------------------------------------------------------------- timing

def bench_prompt(prompt_len: int) -> list[int]:
    """The prompt scripts/bench.py feeds every system."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(0).integers(10, 1000, size=prompt_len)]


class LlamaCppRunner:
    """One loaded GGUF; `run(prompt, gen_len)` -> (prefill seconds, decode seconds), the runner
    interface of scripts/bench.py, so it can be measured interleaved with the other systems."""

    def __init__(self, ckpt_dir: str, qtype: str, threads: int, n_ctx: int = 2048,
                 name: str | None = None):
        import llama_cpp

        self.name = name or f"llama.cpp {qtype.upper()}"
        self.path = gguf_path(ckpt_dir, qtype, threads)
        self.llm = llama_cpp.Llama(model_path=self.path, n_threads=threads,
                                   n_threads_batch=threads, n_ctx=n_ctx, n_batch=min(n_ctx, 2048),
                                   verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _last_logits(self):
        # Llama.eval() no longer fills llm.scores unless logits_all=True (sampling moved into
        # llama.cpp's sampler), so read the last token's logits from the context directly.
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def run(self, prompt, gen_len):
        import numpy as np

        llm = self.llm
        if len(prompt) + gen_len > llm.n_ctx():
            raise ValueError(f"prompt {len(prompt)} + {gen_len} tokens exceed n_ctx {llm.n_ctx()}")
        llm.reset()  # n_tokens = 0; eval() drops the KV cache past it
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = int(np.argmax(self._last_logits()))
        t2 = time.perf_counter()
        for _ in range(gen_len):
            llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
        t3 = time.perf_counter()
        self.last_token = tok
        return t1 - t0, t3 - t2

    def close(self):
        self.llm.close()


def measure(ckpt_dir: str, qtype: str, threads: int, prompt_len: int = 128, gen_len: int = 128,
            repeats: int = 3, warmup: int = 1) -> dict:
    """{'prefill_tok_s', 'decode_tok_s'}: medians over `repeats` after `warmup` runs (plus
    'gguf', the file measured, and 'gguf_bytes'). Converts/quantizes first if not cached."""
    runner = LlamaCppRunner(ckpt_dir, qtype, threads, n_ctx=prompt_len + gen_len + 8)
    try:
        prompt = bench_prompt(prompt_len)
        pre, dec = [], []
        for rep in range(warmup + repeats):
            p, d = runner.run(prompt, gen_len)
            if rep >= warmup:
                pre.append(prompt_len / p)
                dec.append(gen_len / d)
    finally:
        runner.close()
    return {"prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec),
            "gguf": runner.path, "gguf_bytes": os.path.getsize(runner.path)}


def _cpu_sample():
    """(all CPUs' time, their busy time, this process's CPU time), in seconds."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz, t = os.sysconf("SC_CLK_TCK"), os.times()
    return sum(v) / hz, (sum(v) - v[3] - v[4]) / hz, t.user + t.system


def others_busy(before, after) -> float:
    """Fraction of all CPUs that other processes kept busy between two _cpu_sample()s."""
    total = max(after[0] - before[0], 1e-9)
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / total


def machine_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over `seconds` (this process sleeps meanwhile): other jobs on a
    2-core machine make llama.cpp's spinning thread barrier collapse at 2 threads, 5-10x slower."""
    before = _cpu_sample()
    time.sleep(seconds)
    return others_busy(before, _cpu_sample())


def wait_quiet(max_wait: float, threshold: float = 0.1) -> float:
    """Wait up to `max_wait` s for the machine's busy fraction to fall under `threshold`;
    returns the last fraction seen."""
    deadline = time.monotonic() + max_wait
    busy = machine_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = machine_busy(2.0)
    return busy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-110m", help="a scripts/bench.py shape")
    p.add_argument("--ckpt", help="an HF checkpoint dir instead of --shape")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--qtypes", default="F32,Q8_0,Q4_0")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wait-quiet", type=float, default=0, metavar="S",
                   help="wait up to S seconds for other jobs to leave the CPUs before timing")
    args = p.parse_args(argv)

    ok, why = available()
    if not ok:
        print(f"# llama.cpp not available: {why}")
        return 1
    if args.ckpt:
        ckpt, label = args.ckpt, os.path.basename(os.path.abspath(args.ckpt))
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench

        ckpt, label = bench.make_checkpoint(args.shape), args.shape
    qtypes = [q.strip().upper() for q in args.qtypes.split(",") if q.strip()]
    for q in qtypes:  # convert/quantize first, so that the timing below runs on a quiet machine
        gguf_path(ckpt, q, args.threads)
    busy = wait_quiet(args.wait_quiet) if args.wait_quiet else machine_busy()
    print(f"# {label}, {why}, batch 1, prompt {args.prompt_len}, generate {args.gen_len}, "
          f"{args.threads} threads, median of {args.repeats}; CPUs {busy:.0%} busy before",
          flush=True)
    if busy > 0.1:
        print("# warning: other jobs are running; figures at >1 thread may be far too low")
    print(f"{'system':<20}{'GGUF MB':>9}{'prefill tok/s':>15}{'decode tok/s':>15}"
          f"{'others busy':>13}")
    for q in qtypes:
        before = _cpu_sample()
        r = measure(ckpt, q, args.threads, args.prompt_len, args.gen_len, args.repeats)
        others = others_busy(before, _cpu_sample())
        print(f"{'llama.cpp ' + q:<20}{r['gguf_bytes'] / 1e6:>9.0f}{r['prefill_tok_s']:>15.1f}"
              f"{r['decode_tok_s']:>15.2f}{others:>13.0%}", flush=True)
    print("# others busy: the share of all CPUs that other processes used during that row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
