"""Serving under load: `tvm-llm serve` against llama.cpp's `llama-server`, in one run.

    python scripts/bench_serve.py --shape llama-110m --threads 2 --quantization q8 \
        --clients 1,4,8,16 --rates 0.5,1,2 --plot serve.png

Both servers get the same model (random weights of a Llama shape, as scripts/bench.py makes
it; llama.cpp reads it converted to GGUF at the same quantization width: fp32/F32, q8/Q8_0,
q4/Q4_0), the same thread count, and the same seeded request trace, sent over HTTP with the
official `openai` client, streamed:
  - trace: prompt lengths uniform in [P/2, 3P/2] and output lengths uniform in [G/2, 3G/2]
    (P = --prompt-len, G = --gen-len), prompt token ids uniform in [10, vocab); every request
    runs to its output length (ignore_eos), greedy.
  - loads: a closed loop of N concurrent clients (each sends its next request when the last
    one ends) for N in --clients, then Poisson arrivals at each rate in --rates (req/s).
Printed per system and load: output tokens/s, requests/s, time to first token p50/p99,
inter-token latency p50/p99, ITL p99/p50 and the server's CPU milliseconds per output token
(all its threads; the figure to compare on a shared machine, with --threads 1); plotted
(matplotlib, the 'report' extra) as latency-throughput curves. llama.cpp's server runs at
each --llamacpp-parallel slot count and its best per load is reported too. llama.cpp is a
benchmark reference only, never a dependency: scripts/llamacpp_server.py builds llama-server
from llama-cpp-python's sdist.

The checkpoint's tokenizer is a byte-level BPE trained to the full vocabulary (on seeded
random words), so each generated token streams as one non-empty text chunk on both servers
(the benchmark tokenizer of scripts/bench.py covers only ~1000 ids; a token without text would
hide its timing).
Figures, not assertions: on a shared machine they move 2-3x between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "tvm_llm", "bench")
LLAMACPP_QTYPE = {"fp32": "F32", "q8": "Q8_0", "q4": "Q4_0"}


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model
def serve_checkpoint(shape: str) -> str:
    """scripts/bench.py's random checkpoint of `shape` with a tokenizer over its whole vocabulary."""
    import bench

    base = bench.make_checkpoint(shape)
    path = os.path.join(CACHE, f"{shape}-serve")
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(os.path.join(base, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(base):
        if name.endswith((".json", ".safetensors")) and not name.startswith("tokenizer"):
            shutil.copy(os.path.join(base, name), os.path.join(tmp, name))
    # a byte-level BPE trained to the full vocabulary on seeded random words
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 12))) for _ in range(150000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(words[i:i + 1000]) for i in range(0, len(words), 1000)],
                            trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, the model {vocab}")
    tok.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "model_max_length": 2048}, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def tvm_build(ckpt: str, shape: str, quantization: str, max_batch: int, context: int) -> str:
    import tvm_llm

    out = os.path.join(CACHE, f"{shape}-serve-{quantization}-b{max_batch}-c{context}-out")
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        t0 = time.perf_counter()
        tvm_llm.build(ckpt, out, force=True, log=lambda *a: None, max_batch_size=max_batch,
                      context_window=context, kv_cache_tokens=max_batch * context,
                      prefill_chunk_size=256,
                      quantization=None if quantization == "fp32" else quantization)
        log(f"built {shape} {quantization} in {time.perf_counter() - t0:.0f}s -> {out}")
    return out


def gguf(ckpt: str, qtype: str, threads: int) -> str:
    """The checkpoint as GGUF at `qtype`: converted with llama.cpp's script (scripts/llamacpp_ref.py),
    quantized with the llama-quantize built beside llama-server. Cached."""
    import llamacpp_ref
    import llamacpp_server

    os.makedirs(llamacpp_ref.GGUF_DIR, exist_ok=True)
    name = os.path.basename(ckpt.rstrip(os.sep))
    out = os.path.join(llamacpp_ref.GGUF_DIR, f"{name}-{qtype}.gguf")
    if os.path.isfile(out):
        return out
    f32 = os.path.join(llamacpp_ref.GGUF_DIR, f"{name}-F32.gguf")
    if not os.path.isfile(f32):
        llamacpp_ref._convert_f32(ckpt, f32)
    if qtype != "F32":
        proc = subprocess.run([llamacpp_server.quantize_exe(), f32, out + ".tmp", qtype,
                               str(threads)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
        os.replace(out + ".tmp", out)
    return out


# ----------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


class TvmServer:
    def __init__(self, out: str, threads: int, max_batch: int, step_prefill: int | None = None,
                 extra: tuple = ()):
        self.name = "tvm_llm serve"
        wt = os.path.dirname(HERE)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([wt, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tvm_llm.cli", "serve", out, "--port", "0", "--threads",
             str(threads), "--max-batch-size", str(max_batch), "--model-name", "model"]
            + (["--step-prefill-tokens", str(step_prefill)] if step_prefill else []) + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if not m:
            raise RuntimeError(f"tvm-llm serve did not start: {line}")
        self.url = f"http://127.0.0.1:{m.group(1)}"
        _wait_healthy(self.url, self.proc)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


class LlamaServer:
    def __init__(self, model: str, threads: int, parallel: int, slot_ctx: int):
        import llamacpp_server

        self.name = f"llama.cpp server -np {parallel}"
        port = _free_port()
        self.log = open(os.path.join(CACHE, f"llama-server-{port}.log"), "w")
        self.proc = subprocess.Popen(
            [llamacpp_server.build(), "-m", model, "--host", "127.0.0.1", "--port", str(port),
             "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
             "-c", str(parallel * slot_ctx), "-a", "model", "--no-warmup"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        _wait_healthy(self.url, self.proc)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ----------------------------------------------------------------------------- load
def make_trace(n: int, prompt_len: int, gen_len: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    trace = []
    for _ in range(n):
        p = int(rng.integers(max(1, prompt_len // 2), prompt_len * 3 // 2 + 1))
        g = int(rng.integers(max(1, gen_len // 2), gen_len * 3 // 2 + 1))
        trace.append(([int(t) for t in rng.integers(10, vocab, size=p)], g))
    return trace


def one_request(client, prompt: list, max_tokens: int) -> dict:
    """Stream one completion; times of the request and of each text chunk (one per token)."""
    t0 = time.perf_counter()
    times = []
    stream = client.completions.create(model="model", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return {"start": t0, "end": time.perf_counter(), "token_times": times}


def closed_loop(url: str, trace: list, clients: int, requests: int) -> list:
    from openai import OpenAI

    jobs = list(range(requests))
    lock = threading.Lock()
    results, errors = [], []

    def worker():
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop(0)
            try:
                r = one_request(client, *trace[i % len(trace)])
                with lock:
                    results.append(r)
            except Exception as e:
                errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        log(f"{len(errors)} failed requests, first: {errors[0]}")
    return results


def poisson(url: str, trace: list, rate: float, requests: int, seed: int) -> list:
    from openai import OpenAI

    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=requests))
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    results, errors = [], []
    t0 = time.perf_counter()

    def fire(i):
        try:
            results.append(one_request(client, *trace[i % len(trace)]))
        except Exception as e:
            errors.append(repr(e))

    threads = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=fire, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        log(f"{len(errors)} failed requests, first: {errors[0]}")
    return results


def summarize(results: list) -> dict:
    if not results:
        return {}
    tokens = sum(len(r["token_times"]) for r in results)
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttft = [r["token_times"][0] - r["start"] for r in results if r["token_times"]]
    itl = [b - a for r in results for a, b in zip(r["token_times"], r["token_times"][1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    s = {"requests": len(results), "tokens": tokens, "seconds": span,
         "tok_s": tokens / span, "req_s": len(results) / span,
         "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
         "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}
    s["itl_ratio"] = s["itl_p99"] / s["itl_p50"] if s["itl_p50"] else float("nan")
    return s


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_loads(url: str, trace: list, args, pid: int) -> dict:
    """Each load's figures, with the server's CPU milliseconds per output token: on a shared
    machine that moves far less than tokens/s (with --threads 1, no thread spins while it waits
    for another, so it is close to the work done per token)."""
    out = {}
    one_request(__import__("openai").OpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
                trace[0][0], 4)  # warm-up

    def measured(results, cpu0):
        s = summarize(results)
        if s:
            s["cpu_ms_tok"] = (cpu_seconds(pid) - cpu0) * 1e3 / max(1, s["tokens"])
        return s

    for n in args.clients:
        count = max(args.requests, 2 * n)
        cpu0 = cpu_seconds(pid)
        out[f"closed N={n}"] = measured(closed_loop(url, trace, n, count), cpu0)
        log(f"  closed N={n}: {out[f'closed N={n}']['tok_s']:.1f} tok/s")
    for rate in args.rates:
        cpu0 = cpu_seconds(pid)
        out[f"poisson {rate:g}/s"] = measured(poisson(url, trace, rate, args.requests, args.seed), cpu0)
        log(f"  poisson {rate:g}/s: {out[f'poisson {rate:g}/s']['tok_s']:.1f} tok/s")
    return out


# ----------------------------------------------------------------------------- report
def print_table(results: dict) -> None:
    cols = ("tok_s", "req_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_ratio",
            "cpu_ms_tok")
    head = ["system", "load", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "ITL p99/p50", "server CPU ms/tok"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for system, loads in results.items():
        for load, s in loads.items():
            if not s:
                continue
            vals = [s.get(c, float("nan")) * (1000 if c.startswith(("ttft", "itl_p")) else 1)
                    for c in cols]
            print(f"| {system} | {load} | " + " | ".join(f"{v:.2f}" if v < 10 else f"{v:.1f}"
                                                      for v in vals) + " |")


def best_llamacpp(results: dict) -> dict:
    """Per load, the llama.cpp run (of the --parallel settings tried) with the most tok/s."""
    best: dict = {}
    for system, loads in results.items():
        if not system.startswith("llama.cpp"):
            continue
        for load, s in loads.items():
            if s and (load not in best or s["tok_s"] > best[load]["tok_s"]):
                best[load] = {**s, "system": system}
    return best


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, loads in results.items():
        for kind, style in (("closed", "o-"), ("poisson", "s--")):
            pts = [(s["tok_s"], s["itl_p99"] * 1e3, s["ttft_p99"] * 1e3, load.split(" ", 1)[1])
                   for load, s in loads.items() if s and load.startswith(kind)]
            if not pts:
                continue
            pts.sort()
            x = [p[0] for p in pts]
            for ax, k in ((axes[0], 1), (axes[1], 2)):
                ax.plot(x, [p[k] for p in pts], style, label=f"{system} ({kind})")
                for p in pts:
                    ax.annotate(p[3], (p[0], p[k]), fontsize=6, xytext=(3, 3),
                                textcoords="offset points")
    for ax, what in zip(axes, ("inter-token latency p99 (ms)", "time to first token p99 (ms)")):
        ax.set_xlabel("output tokens/s (aggregate)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot -> {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-110m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="q8", choices=sorted(LLAMACPP_QTYPE))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--rates", default="0.5,1,2", help="Poisson arrival rates, requests/s")
    ap.add_argument("--requests", type=int, default=32, help="requests per load (closed: >= 2N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llamacpp-parallel", default="4,16",
                    help="llama-server --parallel settings to try ('' = skip llama.cpp)")
    ap.add_argument("--step-prefill-tokens", type=int, default=None,
                    help="tvm-llm serve --step-prefill-tokens (default: the server's, sized by "
                    "--step-prefill-ratio)")
    ap.add_argument("--step-prefill-ratio", type=float, default=None,
                    help="tvm-llm serve --step-prefill-ratio (default: the server's, 1)")
    ap.add_argument("--no-mixed-steps", action="store_true", help="tvm-llm serve --no-mixed-steps")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="tvm_llm build's and server's max batch (default: the most --clients)")
    ap.add_argument("--no-amx", action="store_true", help="llama.cpp build without AMX (Intel)")
    ap.add_argument("--plot", default=None, help="write the latency-throughput curves to this PNG")
    ap.add_argument("--json", default=None, help="write all figures to this JSON file")
    args = ap.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",") if x]
    args.rates = [float(x) for x in args.rates.split(",") if x]
    parallel = [int(x) for x in args.llamacpp_parallel.split(",") if x]
    max_batch = args.max_batch_size or max(args.clients)
    context = 2 * (args.prompt_len + args.gen_len) + 16  # the longest trace request fits

    print(f"# cpu: {_cpu_name()}; threads {args.threads}; {args.shape} {args.quantization}; "
          f"prompt U[{args.prompt_len // 2}, {args.prompt_len * 3 // 2}], output "
          f"U[{args.gen_len // 2}, {args.gen_len * 3 // 2}] tokens; {args.requests} requests per "
          f"load; seed {args.seed}", flush=True)
    ckpt = serve_checkpoint(args.shape)
    with open(os.path.join(ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    trace = make_trace(max(args.requests, 2 * max(args.clients)), args.prompt_len, args.gen_len,
                       vocab, args.seed)
    results = {}

    out = tvm_build(ckpt, args.shape, args.quantization, max_batch, context)
    extra = (["--step-prefill-ratio", str(args.step_prefill_ratio)]
             if args.step_prefill_ratio else []) + (["--no-mixed-steps"] if args.no_mixed_steps else [])
    server = TvmServer(out, args.threads, max_batch, args.step_prefill_tokens, extra)
    log(f"{server.name} at {server.url}")
    try:
        results[server.name] = run_loads(server.url, trace, args, server.proc.pid)
    finally:
        server.stop()

    if parallel:
        import llamacpp_server

        llamacpp_server.build(args.no_amx)
        model = gguf(ckpt, LLAMACPP_QTYPE[args.quantization], args.threads)
        for p in parallel:
            server = LlamaServer(model, args.threads, p, context)
            log(f"{server.name} at {server.url}")
            try:
                results[server.name] = run_loads(server.url, trace, args, server.proc.pid)
            finally:
                server.stop()

    print_table(results)
    tvm = results["tvm_llm serve"]
    solo, eight = tvm.get("closed N=1"), tvm.get("closed N=8")
    if solo and eight:
        print(f"# batched decode: tvm_llm at 8 clients {eight['tok_s']:.1f} tok/s = "
              f"{eight['tok_s'] / solo['tok_s']:.2f}x one client's {solo['tok_s']:.1f}; server "
              f"CPU per token {solo['cpu_ms_tok']:.2f} -> {eight['cpu_ms_tok']:.2f} ms "
              f"({solo['cpu_ms_tok'] / eight['cpu_ms_tok']:.2f}x less)")
    best = best_llamacpp(results)
    for load, s in best.items():
        if load in tvm and tvm[load]:
            print(f"# {load}: tvm_llm / llama.cpp best ({s['system']}) output tok/s = "
                  f"{tvm[load]['tok_s'] / s['tok_s']:.2f}x; CPU per token "
                  f"{tvm[load]['cpu_ms_tok']:.2f} vs {s['cpu_ms_tok']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
