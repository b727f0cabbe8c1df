"""Human-readable text for figures stored in a manifest, printed the same by every command."""
from __future__ import annotations


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_manifest(m: dict) -> str:
    model, kv, target = m["model"], m["kv_cache"], m["target"]
    weight_bytes = sum(p["nbytes"] for p in m["params"])
    lines = [
        f"model      {model['model_type']} ({', '.join(model.get('architectures') or []) or '-'}): "
        f"{model['num_layers']} layers, {model['num_heads']} heads / {model['num_kv_heads']} KV heads "
        f"x {model['head_dim']}, vocab {model['vocab_size']}",
        f"target     {target['name']} {target.get('arch') or ''} [{target['hw_key']}] "
        f"{target['tvm_target']}",
        f"dtype      {m['dtype']}; weights {len(m['params'])} tensors, {_mib(weight_bytes)}",
        f"kv cache   page {kv['page_size']} tokens, {kv['max_total_seq_len']} tokens total, "
        f"batch <= {kv['max_batch_size']}, prefill chunk {kv['prefill_chunk_size']}, "
        f"context {kv['context_window']}",
        f"built by   tvm_llm {m['tvm_llm_version']}",
    ]
    rep = m.get("report") or {}
    if rep.get("phases"):
        lines.append("build report (phase: seconds, relax calls after it)")
        for ph in rep["phases"]:
            mark = " (skipped)" if ph.get("skipped") else ""
            lines.append(f"  {ph['phase']:<15} {ph['seconds']:>8.2f}s {ph['relax_calls']:>6}{mark}")
        lines.append(f"  import {rep.get('import_seconds')}s, compile {rep.get('compile_seconds')}s")
    return "\n".join(lines)
