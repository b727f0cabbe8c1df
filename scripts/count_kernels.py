"""Kernels per decode step: our imported graph versus a Llama written by hand in Relax.

    python scripts/count_kernels.py [--layers 12 --hidden 768 --heads 12 --kv-heads 4]

The hand-written model is what one writes with tvm.relax.frontend.nn (the way MLC-LLM models
are written): separate q/k/v and gate/up linears, RMSNorm ops, RoPE applied inside the paged
KV cache. It is lowered with the same lowering and finalize phases as ours (FuseTransposeMatmul,
LegalizeOps, FuseOps, FuseTIR), so the counts compare graph rewriting, not lowering.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def hand_written_llama(layers, hidden, heads, kv_heads, inter, vocab, target):
    from tvm import tirx
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

    from tvm_llm.frontend.relax_import import (CACHE_CREATION_SPEC, AttentionShape,
                                               tir_paged_kv_cache)

    hd = hidden // heads
    shape = AttentionShape(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                           head_dim=hd, v_head_dim=hd)

    class Layer(nn.Module):
        def __init__(self):
            self.input_norm = nn.RMSNorm(hidden, -1, 1e-6, bias=False)
            self.q = nn.Linear(hidden, heads * hd, bias=False)
            self.k = nn.Linear(hidden, kv_heads * hd, bias=False)
            self.v = nn.Linear(hidden, kv_heads * hd, bias=False)
            self.o = nn.Linear(heads * hd, hidden, bias=False)
            self.post_norm = nn.RMSNorm(hidden, -1, 1e-6, bias=False)
            self.gate = nn.Linear(hidden, inter, bias=False)
            self.up = nn.Linear(hidden, inter, bias=False)
            self.down = nn.Linear(inter, hidden, bias=False)

        def forward(self, x, cache, i):
            b, s, _ = x.shape
            h = self.input_norm(x)
            qkv = op.concat([self.q(h), self.k(h), self.v(h)], dim=-1)
            qkv = op.reshape(qkv, (b, s, heads + 2 * kv_heads, hd))
            a = cache.attention_with_fused_qkv(i, qkv, heads, hd ** -0.5)
            x = x + self.o(op.reshape(a, (b, s, heads * hd)))
            h = self.post_norm(x)
            return x + self.down(op.silu(self.gate(h)) * self.up(h))

    class Model(nn.Module):
        def __init__(self):
            self.embed = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleList([Layer() for _ in range(layers)])
            self.norm = nn.RMSNorm(hidden, -1, 1e-6, bias=False)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def decode(self, ids: nn.Tensor, cache: PagedKVCache):
            x = self.embed(ids)
            for i, layer in enumerate(self.layers):
                x = layer(x, cache, i)
            return self.lm_head(self.norm(x))

        def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
            return tir_paged_kv_cache(
                (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                 support_sliding_window), shape, "float32", target, rope=True)

    spec = {"decode": {"ids": nn.spec.Tensor(["batch", 1], "int32"),
                       "cache": nn.spec.Object(object_type=PagedKVCache),
                       "$": {"param_mode": "packed", "effect_mode": "none"}},
            "create_paged_kv_cache": CACHE_CREATION_SPEC}
    mod, _ = Model().export_tvm(spec=spec)
    return mod


def count_hand_written(args, spec):
    import tvm
    from tvm import relax

    from tvm_llm.passes.pipeline import kernels_per_call, phase_passes

    mod = hand_written_llama(args.layers, args.hidden, args.heads, args.kv_heads, args.inter,
                             args.vocab, spec.tvm_target())
    with spec.tvm_target(), tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.FuseTransposeMatmul()(mod)
        for name, passes in phase_passes(spec):
            if name in ("lowering", "finalize"):
                mod = tvm.transform.Sequential(passes)(mod)
    return kernels_per_call(mod, "decode")


def count_ours(args, spec):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tvm_llm.frontend import import_model
    from tvm_llm.passes.pipeline import run_pipeline

    cfg = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=args.inter, vocab_size=args.vocab,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    imported = import_model(model, dtype="float32", context_window=512, max_batch_size=8,
                            prefill_chunk_size=128, target=spec)
    _, _, report = run_pipeline(imported.mod, spec)
    return report[-1]["decode_kernels"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args(argv)
    from tvm_llm.targets import get_target

    spec = get_target("llvm")
    ours, hand = count_ours(args, spec), count_hand_written(args, spec)
    print(f"# Llama, {args.layers} layers: kernels per decode step (PrimFunc calls + attention)")
    print(f"{'tvm_llm (imported from transformers, our passes)':<55}{ours:>6}")
    print(f"{'hand-written relax.frontend.nn Llama (RoPE in cache)':<55}{hand:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
