"""Human-readable text for figures stored in a manifest, printed the same by every command."""
from __future__ import annotations


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _cpu_lines(target: dict) -> list:
    feats = target.get("cpu_features")
    if not feats:
        return []
    amx = feats.get("amx") or {}
    if amx.get("usable"):
        amx_text = "yes (bfloat16 prefill matmuls on AMX tiles)"
    elif amx.get("llvm_feature") and "cpu_flag" not in amx:
        amx_text = ("in the target CPU, not probed (not this machine's CPU): bfloat16 prefill "
                    "matmuls on AMX tiles")
    else:
        why = [k for k, v in (("no LLVM feature amx-bf16", amx.get("llvm_feature")),
                              ("no CPU flag amx_bf16", amx.get("cpu_flag", True))) if not v]
        if amx.get("os_permission") not in (None, "granted"):
            why.append(f"OS permission {amx['os_permission']}")
        amx_text = "no (" + ", ".join(why or ["unknown"]) + ")"
    dot = feats.get("int8_dot")  # absent in builds from before stop 23
    dot_text = "" if "int8_dot" not in feats else \
        f"int8 dot products {dot or 'none (weight-only kernels)'}; "
    return [f"cpu        bf16 matmul {feats.get('bf16_matmul')}; {dot_text}AMX {amx_text}"]


def format_manifest(m: dict) -> str:
    model, kv, target = m["model"], m["kv_cache"], m["target"]
    weight_bytes = sum(p["nbytes"] for p in m["params"])
    lines = [
        f"model      {model['model_type']} ({', '.join(model.get('architectures') or []) or '-'}): "
        f"{model['num_layers']} layers, {model['num_heads']} heads / {model['num_kv_heads']} KV heads "
        f"x {model['head_dim']}, vocab {model['vocab_size']}",
        f"target     {target['name']} {target.get('arch') or ''} [{target['hw_key']}] "
        f"{target['tvm_target']}",
        *_cpu_lines(target),
        f"dtype      {m['dtype']}; weights {len(m['params'])} tensors, {_mib(weight_bytes)}",
        f"kv cache   {kv.get('dtype', m['dtype'])}, page {kv['page_size']} tokens, "
        f"{kv['max_total_seq_len']} tokens total, "
        f"batch <= {kv['max_batch_size']}, prefill chunk {kv['prefill_chunk_size']}, "
        f"context {kv['context_window']}",
        f"built by   tvm_llm {m['tvm_llm_version']}",
    ]
    if m.get("memory"):
        lines.append(format_memory(m["memory"]))
    rep = m.get("report") or {}
    if rep.get("phases"):
        lines.append("build report (phase: seconds, relax calls before -> after; slowest passes)")
        for ph in rep["phases"]:
            mark = " (skipped)" if ph.get("skipped") else ""
            before = ph.get("relax_calls_before", ph["relax_calls"])
            lines.append(f"  {ph['phase']:<15} {ph['seconds']:>8.2f}s {before:>6} -> "
                         f"{ph['relax_calls']:<6}{mark}")
            slow = sorted((ph.get("passes") or {}).items(), key=lambda kv: -kv[1])[:3]
            if slow and ph["seconds"] > 0.05:
                lines.append("      " + ", ".join(f"{k} {v:.2f}s" for k, v in slow))
            if "decode_kernels" in ph:
                lines.append(f"  kernels per call: decode {ph['decode_kernels']}, "
                             f"prefill {ph['prefill_kernels']}")
        lines.append(f"  import {rep.get('import_seconds')}s, compile {rep.get('compile_seconds')}s")
    if rep.get("build_seconds"):
        lines.append(format_build_time(rep["build_seconds"], rep.get("build_cpu_seconds")))
    if rep.get("tuning"):
        lines.append(format_tuning(rep["tuning"]))
    return "\n".join(lines)


class BuildClock:
    """Wall and CPU seconds of the build's steps: `lap(name)` charges the time since the
    previous lap (or the start) to `name`, so the steps add up to the whole build. CPU time
    (all threads of this process) tells a slow step from a machine shared with others."""

    def __init__(self):
        import time

        self._wall, self._cpu = time.perf_counter, time.process_time
        self._last = (self._wall(), self._cpu())
        self.seconds: dict = {}
        self.cpu_seconds: dict = {}

    def lap(self, name: str) -> None:
        now = (self._wall(), self._cpu())
        for table, new, old in ((self.seconds, now[0], self._last[0]),
                                (self.cpu_seconds, now[1], self._last[1])):
            table[name] = round(table.get(name, 0.0) + new - old, 2)
        self._last = now


def format_build_time(seconds: dict, cpu_seconds: dict | None = None) -> str:
    """The build's time per step (a manifest's report "build_seconds" and "build_cpu_seconds"),
    largest first; steps under 0.01 s are left out."""
    cpu_seconds = cpu_seconds or {}
    total = sum(seconds.values()) or 1.0
    lines = [f"build time {total:.1f}s wall, {sum(cpu_seconds.values()):.1f}s CPU "
             "(step: wall, share of wall, CPU)"]
    for name, sec in sorted(seconds.items(), key=lambda kv: -kv[1]):
        if sec >= 0.01:
            cpu = cpu_seconds.get(name)
            lines.append(f"  {name:<34} {sec:>8.2f}s {100 * sec / total:>5.1f}%"
                         + (f" {cpu:>8.2f}s" if cpu is not None else ""))
    return "\n".join(lines)


def format_tuning(t: dict) -> str:
    """Which kernels came from the tuning log (a manifest's report "tuning" section)."""
    kernels = t.get("kernels") or []
    lines = [f"tuning log {t.get('log')} [{t.get('hw_key')}]: {t.get('records', 0)} records, "
             f"{len(kernels)} kernels from the log, the others from our schedule rules"
             + (f" ({t['generic_kept']} tuned kernels lost to them)" if t.get("generic_kept") else "")
             + (f"; {len(t['warnings'])} warning(s)" if t.get("warnings") else "")]
    for b in t.get("buckets") or []:
        lines.append(f"  bucket {b['bucket']:<16} -> {b['function']} ({b['kernels']} tuned kernels)")
    for k in kernels:
        ms = f"{k['tuned_ms']:.4f} ms" if k.get("tuned_ms") is not None else "-"
        lines.append(f"  {k['kernel'][:72]:<72} {ms:>12}  {k.get('bucket') or ''}")
    return "\n".join(lines)


def _size(n: float) -> str:
    from .memory.kv_budget import fmt_bytes

    return fmt_bytes(n)


def format_memory(mem: dict) -> str:
    """The memory plan (a manifest's "memory" section), as build, plan and inspect print it."""
    kv, w, acts, lg = mem["kv_cache"], mem["weights"], mem["activations"], mem["logits"]
    budget = mem.get("budget")
    if budget:
        head = f"budget --max-memory {budget['spec']} = {_size(budget['bytes'])}"
        if budget.get("fraction") is not None:
            head += f" ({budget['fraction']:g} of {_size(budget['device_bytes'])})"
    else:
        head = "no --max-memory: KV pool from --kv-cache-tokens, default max(context, 4096)"
    funcs = acts.get("functions", {})

    def bounds(name, unit):
        f = funcs.get(name) or {}
        b = max((f.get("bounds") or {}).values(), default=None)
        return f"{name} {_size(f.get('bytes', 0))}" + (f" (<= {b} {unit})" if b else "")

    lines = [
        f"memory plan ({mem['device_type']}; {head})",
        f"  weights          {_size(w['bytes']):>11}  "
        + ", ".join(f"{d} {_size(n)}" for d, n in sorted(w["by_dtype"].items()))
        + f"; {w['tensors']} tensors",
        f"  activations      {_size(acts['bytes']):>11}  static plan: {bounds('prefill', 'tokens')}, "
        f"{bounds('decode', 'sequences')}; both stay in TVM's pooled allocator",
        f"  logits           {_size(lg['bytes']):>11}  1..{lg['rows']} rows x {lg['vocab_size']} "
        f"{lg['dtype']}, one pooled buffer per row count (outside the static plan)",
        f"  kv cache         {_size(kv['bytes']):>11}  {kv['pages']} pages x {kv['page_size']} tokens "
        f"x {_size(kv['bytes_per_token'])}/token ({kv['dtype']}) = {kv['tokens']} tokens",
        f"  kv workspace     {_size(kv['workspace_bytes']):>11}  staging for one prefill chunk, page tables",
        f"  runtime reserve  {_size(mem['runtime_reserve_bytes']):>11}  Python + TVM runtime + model code",
        f"  total            {_size(mem['total_bytes']):>11}"
        + (f"  of {_size(budget['bytes'])}" if budget else ""),
    ]
    fits = mem.get("sequences_that_fit") or {}
    ctx = mem["context_window"]
    lines.append(f"  context window   {ctx} tokens ({mem['context_source']}); "
                 f"{fits.get(str(ctx), 0)} sequences of {ctx} tokens fit in the pool, "
                 f"{mem['concurrent_sequences']} at once (max batch {mem['max_batch_size']})")
    for c, n in fits.items():
        if int(c) != ctx:
            lines.append(f"                   {n} sequences of {c} tokens fit")
    for note in mem.get("notes") or []:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
