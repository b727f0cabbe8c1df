"""One prepared check of the CUDA target on a machine with an NVIDIA GPU (written for an H200).

    bash scripts/gpu_check.sh          # sets the environment up, then runs this under a timeout
    python scripts/gpu_check.py [--skip-model] [--budget-seconds 450]

1. environment: TVM's CUDA runtime (`tvm.cuda().exist`), the device, torch, nvcc / NVRTC;
2. kernels, independent of the model pipeline: our tensor-core GEMM (prefill, symbolic n,
   fused residual add) and decode GEMV, scheduled by schedules.cuda for the device's arch,
   exported with PTX inside (CUDATarget.export_library), loaded back with the TVM runtime and
   run against torch on the GPU; kernel times vs torch (cuBLAS);
3. model: a tiny random-weight Llama (hidden 256, 4 layers) built with
   tvm_llm.build(target="cuda", arch=..., dtype="float16"), run with
   tvm_llm.Engine(device="cuda"): last-token logits vs transformers, greedy tokens, decode
   tokens/s vs transformers;
4. roofline: a random-weight Llama of a benchmark shape (--roofline-shape, default llama-1b;
   llama-110m when less than 4 minutes remain) in float16: batch-1 decode tokens/s of
   tvm_llm (decode replayed as CUDA Graphs) and of transformers on the same GPU, each against
   the HBM roofline = memory bandwidth / bytes of weights one decode step reads (every
   weight once; the embedding table only one row; KV-cache reads of the short context left
   out). The bandwidth is the device's stated figure (table below, or --bandwidth-gbs) and,
   for comparison, a measured device-to-device copy.

`--device cpu` runs phase 4 with an llvm float32 build on the CPU (bandwidth from a measured
numpy copy unless --bandwidth-gbs is given): it exercises the same code with no GPU and is
what the test suite runs (tests/test_gpu_check.py, with the tiny shape).

Prints every figure; writes them to $OUT/gpu_check.json when $OUT is set. Exit status 0 when
every correctness check that ran passed, 1 otherwise. Each phase is guarded: a failure is
reported and the next phase still runs, within the time budget.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

RESULTS: dict = {"checks": {}, "figures": {}}
# stated peak HBM bandwidth, GB/s (vendor data sheets), matched against the device name
STATED_BANDWIDTH_GBS = (("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
                        ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555),
                        ("L40S", 864), ("L40", 864), ("L4", 300), ("A10", 600),
                        ("RTX 4090", 1008), ("RTX 3090", 936))
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def check(name: str, ok: bool, detail: str = "") -> bool:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    log(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
    return ok


def figure(name: str, value) -> None:
    RESULTS["figures"][name] = value
    log(f"  {name}: {value}")


# ------------------------------------------------------------------ 1. environment
def environment() -> str | None:
    """The device's sm_XX, or None when TVM cannot see a CUDA device."""
    import tvm

    figure("tvm_version", tvm.__version__)
    dev = tvm.cuda(0)
    if not check("tvm_cuda_runtime", dev.exist,
                 "" if dev.exist else "tvm.cuda(0).exist is False: TVM's CUDA runtime "
                 "(libtvm_runtime_cuda.so) did not load or sees no GPU; see gpu_check.sh"):
        return None
    figure("device", f"{dev.device_name} (compute {dev.compute_version}, "
                     f"{dev.multi_processor_count} SMs, {dev.total_global_memory / 2**30:.0f} GiB)")
    arch = "sm_" + dev.compute_version.replace(".", "")
    figure("nvcc", shutil.which("nvcc") or "not on PATH (NVRTC via cuda-bindings is the fallback)")
    try:
        import torch

        figure("torch", f"{torch.__version__}, cuda available: {torch.cuda.is_available()}")
    except ImportError:
        figure("torch", "not installed")
    from tvm_llm.targets.cuda import CUDA_ARCHS

    if arch not in CUDA_ARCHS:
        num = lambda a: int(a.removeprefix("sm_").rstrip("af"))  # noqa: E731
        nearest = max((a for a in CUDA_ARCHS if num(a) <= num(arch)), key=num, default="sm_80")
        log(f"device arch {arch} is not one of {sorted(CUDA_ARCHS)}: building for {nearest}")
        arch = nearest
    return arch


# ---------------------------------------------------------------------- 2. kernels
def _torch_device():
    try:
        import torch

        return torch, ("cuda" if torch.cuda.is_available() else "cpu")
    except ImportError:
        return None, None


def _kernel_modules(arch: str, K: int, N: int, load: bool = True):
    """Schedule the prefill GEMM and decode GEMV of a small Relax module for `arch`; return
    {"prefill"|"decode": (exported runtime module (its path with load=False), rule name)}."""
    import tvm
    from tvm import relax
    from tvm.script import ir as I  # noqa: F401
    from tvm.script import relax as R  # noqa: F401

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from gpu_verify import lower_for_scheduling  # tests/gpu_verify.py
    from schedules.cuda import cuda_rules
    from schedules.gpu.analysis import AnnotateSymbolicBounds
    from tvm_llm.targets import get_target

    bb = relax.BlockBuilder()
    n, b = tvm.tirx.Var("n", "int64"), tvm.tirx.Var("b", "int64")
    for name, rows, bound in (("prefill", (1, n), {"n": 4096}), ("decode", (b, 1), {"b": 8})):
        x = relax.Var("x", relax.TensorType((*rows, K), "float16"))
        w = relax.Var("w", relax.TensorType((N, K), "float16"))
        r = relax.Var("r", relax.TensorType((*rows, N), "float16"))
        with bb.function(name, [x, w, r], attrs={"tir_var_upper_bound": bound}):
            with bb.dataflow():
                y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
                out = bb.emit_output(relax.op.add(y, r))
            bb.emit_func_output(out)
    mod = AnnotateSymbolicBounds()(lower_for_scheduling(bb.get()))
    spec = get_target("cuda", arch=arch)
    target = spec.tvm_target()
    tensor_core, gemv = cuda_rules()
    found = {}
    workdir = tempfile.mkdtemp(prefix="gpu_check_kernels_")
    for gv, func in mod.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc) or "matmul" not in gv.name_hint:
            continue
        kind = "decode" if "b" in str(func.attrs.get("tir_var_upper_bound", {})) else "prefill"
        rule = tensor_core if kind == "prefill" else gemv
        with target:
            sch = rule.apply(func, target, False)
        assert sch is not None, f"{type(rule).__name__} did not claim the {kind} kernel"
        kmod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
        with tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
            ex = tvm.compile(kmod, target=target, tir_pipeline=spec.tir_pipeline())
        path = os.path.join(workdir, f"{kind}.so")
        spec.export_library(ex, path)                       # PTX inside, no compiler at load
        found[kind] = (tvm.runtime.load_module(path) if load else path, type(rule).__name__)
    return found


def kernels(arch: str, dry_run: bool = False) -> None:
    import numpy as np
    import tvm

    torch, tdev = _torch_device()
    K = N = 4096
    log(f"building the GEMM and GEMV kernels for {arch} (K = N = {K})")
    mods = _kernel_modules(arch, K, N, load=not dry_run)
    if dry_run:
        for kind, (path, rule) in mods.items():
            check(f"{kind}_{rule}_built", os.path.getsize(path) > 0, path)
        return
    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype("float16")
    w_tvm = tvm.runtime.tensor(w, dev)
    for kind, sizes in (("prefill", (1, 77, 512, 2048)), ("decode", (1, 4, 8))):
        lib, rule = mods[kind]
        f = lib["main"]
        for m in sizes:
            shape_x = (1, m, K) if kind == "prefill" else (m, 1, K)
            shape_o = shape_x[:-1] + (N,)
            x = rng.standard_normal(shape_x).astype("float16")
            r = rng.standard_normal(shape_o).astype("float16")
            args = [tvm.runtime.tensor(x, dev), w_tvm, tvm.runtime.tensor(r, dev),
                    tvm.runtime.tensor(np.zeros(shape_o, "float16"), dev)]
            f(*args)
            dev.sync()
            got = args[-1].numpy().astype("float32")
            ref = x.astype("float32").reshape(-1, K) @ w.astype("float32").T
            ref = ref.reshape(shape_o) + r.astype("float32")
            err = float(np.abs(got - ref).max())
            check(f"{kind}_{rule}_m{m}_matches_fp32_reference", err < 0.05 + 0.01 * np.abs(ref).max(),
                  f"max abs err {err:.4f} (|ref| max {np.abs(ref).max():.2f})")
            timer = lib.time_evaluator("main", dev, number=20, repeat=3)
            t_tvm = float(np.median(timer(*args).results))
            flops = 2.0 * m * N * K
            bytes_moved = 2.0 * (N * K + m * K + 2 * m * N)
            line = {"tvm_ms": round(t_tvm * 1e3, 4), "tvm_TFLOPs": round(flops / t_tvm / 1e12, 2),
                    "tvm_GBs": round(bytes_moved / t_tvm / 1e9, 1)}
            if torch is not None and tdev == "cuda":
                tx, tw, tr = (torch.from_numpy(a).cuda() for a in (x, w, r))
                for _ in range(3):
                    torch.matmul(tx, tw.T).add_(tr)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    torch.matmul(tx, tw.T).add_(tr)
                end.record()
                torch.cuda.synchronize()
                t_torch = start.elapsed_time(end) / 20 / 1e3
                line.update(torch_ms=round(t_torch * 1e3, 4),
                            torch_TFLOPs=round(flops / t_torch / 1e12, 2),
                            tvm_over_torch_time=round(t_tvm / t_torch, 2))
            figure(f"{kind}_m{m}", line)


# ------------------------------------------------------------------------ 3. model
TINY = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=688, vocab_size=4096)


def _tiny_llama(path: str, shape: dict | None = None) -> None:
    """A random-weight Llama checkpoint of `shape` (Llama config fields; TINY by default)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from tiny_models import make_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(**(shape or TINY), max_position_embeddings=1024, tie_word_embeddings=False,
                      initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)


def model(arch: str, deadline: float, dry_run: bool = False) -> None:
    import numpy as np

    import tvm_llm

    torch, tdev = _torch_device()
    work = tempfile.mkdtemp(prefix="gpu_check_model_")
    ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "out")
    _tiny_llama(ckpt)
    t = time.perf_counter()
    tvm_llm.build(ckpt, out, target="cuda", arch=arch, dtype="float16", max_batch_size=4,
                  prefill_chunk_size=256, emit_source=True)
    figure("model_build_seconds", round(time.perf_counter() - t, 1))
    ptx = open(os.path.join(out, "source", "device.ptx")).read()
    from tvm_llm.targets.cuda import count_instructions

    figure("model_ptx_tensor_core_instructions", count_instructions(ptx))
    if dry_run:
        check("model_built", True, out)
        return
    engine = tvm_llm.Engine(out, device="cuda")
    rng = np.random.default_rng(1)
    prompt = [1] + rng.integers(3, 4096, 63).tolist()

    sid = engine.cache.add()
    try:
        logits = engine.prefill([(sid, prompt)])[0]
    finally:
        engine.cache.remove(sid)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float16 if tdev == "cuda" else torch.float32).to(tdev).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device=tdev)).logits[0, -1].float().cpu().numpy()
    err = float(np.abs(logits - ref).max())
    scale = float(np.abs(ref).max())
    top5 = len(set(np.argsort(-logits)[:5]) & set(np.argsort(-ref)[:5]))
    check("model_logits_match_transformers", err < 0.02 * scale + 0.05 and int(np.argmax(logits)) == int(np.argmax(ref)),
          f"max abs err {err:.4f} of |logit| max {scale:.2f}; top-5 overlap {top5}/5")

    gen = 32
    ours = engine.generate_ids([prompt], max_new_tokens=gen, ignore_eos=True)[0]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt], device=tdev), max_new_tokens=gen,
                             min_new_tokens=gen, do_sample=False)[0, len(prompt):].tolist()
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), gen)
    check("model_greedy_tokens_agree", same >= 8,
          f"first {same}/{gen} greedy tokens identical (fp16 rounding may flip later ones)")

    if time.perf_counter() > deadline:
        log("time budget reached: skipping the speed comparison")
        return
    steps = 256
    engine.generate_ids([prompt], max_new_tokens=4, ignore_eos=True)         # warm-up
    t = time.perf_counter()
    engine.generate_ids([prompt], max_new_tokens=steps, ignore_eos=True)
    ours_s = time.perf_counter() - t
    sync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
    with torch.no_grad():
        hf.generate(torch.tensor([prompt], device=tdev), max_new_tokens=4, min_new_tokens=4,
                    do_sample=False)
        sync()
        t = time.perf_counter()
        hf.generate(torch.tensor([prompt], device=tdev), max_new_tokens=steps,
                    min_new_tokens=steps, do_sample=False)
        sync()
        hf_s = time.perf_counter() - t
    figure("decode_tokens_per_s", {"tvm_llm": round(steps / ours_s, 1),
                                   f"transformers_{tdev}": round(steps / hf_s, 1),
                                   "ratio": round(hf_s / ours_s, 2),
                                   "note": f"batch 1, 64-token prompt, {steps} greedy tokens"})


# ----------------------------------------------------------------------- 4. roofline
def decode_bytes_per_token(params: list, tied_embeddings: bool) -> int:
    """Bytes of weights one batch-1 decode step reads, from a manifest's parameter table:
    every weight once, except the embedding table (named *embed*), of which a step reads one
    row, unless it is tied to the LM head (then all of it). The LM head of an untied model may
    be stored packed under another name: it is counted like any weight."""
    total = 0
    for p in params:
        if "embed" in p["name"] and not tied_embeddings:
            total += p["nbytes"] // max(1, p["shape"][0])
        else:
            total += p["nbytes"]
    return total


def stated_bandwidth_gbs(device_name: str) -> float | None:
    for key, gbs in STATED_BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return float(gbs)
    return None


def measured_bandwidth_gbs(device: str) -> float:
    """Read + write bytes per second of a large device-to-device copy (torch on CUDA, numpy on
    the CPU): what a memory-bound kernel can reach, usually 85-93% of the stated figure."""
    if device == "cuda":
        import torch

        x = torch.empty(2**28, dtype=torch.float32, device="cuda")   # 1 GiB
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize()
        return 2 * x.numel() * 4 * 10 / (time.perf_counter() - t) / 1e9
    import numpy as np

    x = np.ones(2**25, np.float32)                                       # 128 MiB
    y = np.empty_like(x)
    np.copyto(y, x)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(y, x)
    return 2 * x.nbytes * 5 / (time.perf_counter() - t) / 1e9


def _decode_seconds(generate, prompt, steps: int, sync) -> float:
    """Seconds of `steps - 1` decode steps: a generation of `steps` tokens minus one of a single
    token (that one is the prefill), each the faster of two runs."""
    def timed(n):
        best = float("inf")
        for _ in range(2):
            sync()
            t = time.perf_counter()
            generate(prompt, n)
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    generate(prompt, 4)   # warm-up: CUDA Graphs are captured on the first decode per batch size
    return max(timed(steps) - timed(1), 1e-9)


def profile_decode(engine, prompt: list, steps: int, sync) -> dict:
    """Where a decode step's time goes on the GPU, from torch's profiler (CUPTI records every
    kernel of the process, TVM's and those replayed from CUDA Graphs included): the GPU's busy
    time per step (the union of kernel intervals) against the wall time, the kernels per step,
    and the kernels that take the most time. The profiler slows the host side: wall time here
    is an upper bound; a busy share far below 1 means the step waits on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine.generate_ids([prompt], max_new_tokens=2, ignore_eos=True)
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        engine.generate_ids([prompt], max_new_tokens=steps + 1, ignore_eos=True)
        sync()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    per_name: dict = {}
    for e in kernels:
        count, us = per_name.get(e.name, (0, 0.0))
        per_name[e.name] = (count + 1, us + e.time_range.elapsed_us())
    n = steps + 1   # the prefill of the prompt is one of them
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"steps": n, "wall_ms_per_step": round(wall / n * 1e3, 3),
            "gpu_busy_ms_per_step": round(busy / n / 1e3, 3),
            "gpu_busy_share": round(busy / 1e6 / wall, 3),
            "kernels_per_step": round(len(kernels) / n, 1),
            "top_kernels": [{"name": name[:90], "per_step": round(c / n, 2),
                             "us_per_step": round(us / n, 1)} for name, (c, us) in top]}


def roofline(arch: str, shape_name: str, device: str, deadline: float, steps: int,
             bandwidth_gbs: float | None = None, profile_steps: int = 0) -> None:
    """Phase 4 (see the module docstring)."""
    import numpy as np

    import tvm_llm

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from bench import SHAPES

    torch, tdev = _torch_device()
    if device == "cuda" and shape_name == "llama-1b" and deadline - time.perf_counter() < 240:
        log("less than 4 minutes left: roofline on llama-110m instead of llama-1b")
        shape_name = "llama-110m"
    shape = SHAPES[shape_name]
    work = tempfile.mkdtemp(prefix="gpu_check_roofline_")
    ckpt, out = os.path.join(work, "ckpt"), os.path.join(work, "out")
    _tiny_llama(ckpt, shape)
    dtype = "float16" if device == "cuda" else "float32"
    t = time.perf_counter()
    manifest = tvm_llm.build(ckpt, out, target="cuda" if device == "cuda" else "llvm",
                             arch=arch if device == "cuda" else None, dtype=dtype,
                             max_batch_size=1, prefill_chunk_size=64, context_window=256,
                             log=lambda *a: None)
    figure("roofline_build_seconds", round(time.perf_counter() - t, 1))
    total = manifest["report"]["phases"][-1]
    figure("roofline_decode_kernels", {"per_step": total.get("decode_kernels"),
                                       **(total.get("decode_graph_capture") or {})})
    per_token = decode_bytes_per_token(manifest["params"], tied_embeddings=False)  # _tiny_llama
    if device == "cuda":
        import tvm

        name = tvm.cuda(0).device_name
        stated = bandwidth_gbs or stated_bandwidth_gbs(name)
    else:
        name, stated = "cpu", bandwidth_gbs
    measured = measured_bandwidth_gbs(device)
    bandwidth = stated or measured
    limit = bandwidth * 1e9 / per_token
    figure("roofline", {"shape": shape_name, "dtype": dtype, "device": name,
                        "weight_bytes_per_token": per_token,
                        "bandwidth_GBs": round(bandwidth, 1),
                        "bandwidth_source": ("--bandwidth-gbs" if bandwidth_gbs else
                                             "stated" if stated else "measured copy"),
                        "measured_copy_GBs": round(measured, 1),
                        "roofline_tokens_per_s": round(limit, 1)})
    if time.perf_counter() > deadline:
        log("time budget reached: skipping the roofline decode runs")
        return
    engine = tvm_llm.Engine(out, device=device)
    rng = np.random.default_rng(2)
    prompt = [1] + rng.integers(3, shape["vocab_size"], 31).tolist()
    sync = (torch.cuda.synchronize if device == "cuda" and torch is not None else (lambda: None))
    ours = _decode_seconds(lambda p, n: engine.generate_ids([p], max_new_tokens=n, ignore_eos=True),
                           prompt, steps, sync)
    rates = {"tvm_llm": (steps - 1) / ours}
    if torch is not None:
        from transformers import AutoModelForCausalLM

        hf_dev = "cuda" if device == "cuda" else "cpu"
        hf = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=getattr(torch, dtype)).to(hf_dev).eval()
        ids = torch.tensor([prompt], device=hf_dev)

        def hf_generate(_p, n):
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        rates[f"transformers_{hf_dev}"] = (steps - 1) / _decode_seconds(hf_generate, prompt, steps,
                                                                        sync)
    table = {k: {"tokens_per_s": round(v, 1), "share_of_roofline": round(v / limit, 3)}
             for k, v in rates.items()}
    if len(rates) == 2:
        table["tvm_llm_over_transformers"] = round(rates["tvm_llm"] / list(rates.values())[1], 2)
    figure("roofline_decode", table)
    check("roofline_decode_measured", all(v > 0 for v in rates.values()),
          f"batch 1, {len(prompt)}-token prompt, {steps - 1} decode steps")
    log(f"decode {shape_name} {dtype} on {name}: " + ", ".join(
        f"{k} {v:.1f} tok/s ({v / limit:.0%} of the {limit:.0f} tok/s roofline)"
        for k, v in rates.items()))
    if profile_steps and device == "cuda" and torch is not None:
        try:
            figure("decode_profile", profile_decode(engine, prompt, profile_steps, sync))
        except Exception:  # noqa: BLE001  (a diagnostic: its failure fails no check)
            log("decode profile failed: " + traceback.format_exc(limit=3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-model", action="store_true", help="kernel checks only")
    parser.add_argument("--budget-seconds", type=float, default=450.0,
                        help="stop starting new work after this many seconds")
    parser.add_argument("--dry-run", metavar="ARCH", default=None,
                        help="no GPU: build and export everything for ARCH (e.g. sm_90), run nothing")
    parser.add_argument("--skip-kernels", action="store_true", help="no kernel checks")
    parser.add_argument("--skip-roofline", action="store_true", help="no roofline phase")
    parser.add_argument("--roofline-shape", default="llama-1b",
                        help="benchmark shape of phase 4 (scripts/bench.py SHAPES)")
    parser.add_argument("--roofline-steps", type=int, default=129, help="decode steps timed")
    parser.add_argument("--profile-steps", type=int, default=32,
                        help="cuda: profile this many decode steps of the roofline model "
                             "(GPU busy time per step, top kernels); 0: no profile")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="memory bandwidth for the roofline instead of the stated figure")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the roofline phase on the CPU (llvm build), no GPU needed")
    args = parser.parse_args()
    deadline = T0 + args.budget_seconds
    arch = args.dry_run
    if args.device == "cpu":
        arch = arch or "cpu"
    elif arch is None:
        try:
            arch = environment()
        except Exception:  # noqa: BLE001
            check("environment", False, traceback.format_exc(limit=3))
    dry = args.dry_run is not None
    on_gpu = args.device == "cuda"
    phases = []
    if not args.skip_kernels and on_gpu:
        phases.append(("kernels", lambda: kernels(arch, dry)))
    if not args.skip_model and on_gpu:
        phases.append(("model", lambda: model(arch, deadline - 60, dry)))
    if not args.skip_roofline and not dry:
        phases.append(("roofline", lambda: roofline(arch, args.roofline_shape, args.device,
                                                    deadline - 20, args.roofline_steps,
                                                    args.bandwidth_gbs, args.profile_steps)))
    for name, run in phases:
        if arch is None:
            log(f"skipping {name}: no usable CUDA device")
            continue
        if time.perf_counter() > deadline:
            log(f"skipping {name}: time budget reached")
            continue
        try:
            run()
        except Exception:  # noqa: BLE001
            check(f"{name}_phase_ran", False, traceback.format_exc())
    RESULTS["seconds"] = round(time.perf_counter() - T0, 1)
    ok = all(c["ok"] for c in RESULTS["checks"].values()) and bool(RESULTS["checks"])
    RESULTS["ok"] = ok
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    log(f"{'ALL PASSED' if ok else 'SOME CHECKS FAILED'} "
        f"({sum(c['ok'] for c in RESULTS['checks'].values())}/{len(RESULTS['checks'])} checks)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
