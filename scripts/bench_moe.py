"""Decode speed of a mixture-of-experts model against a dense model of the same total size,
built and measured in one run.

    python scripts/bench_moe.py --threads 2

MoE: Mixtral shape, 8 experts, top-2, hidden 1024, expert intermediate --expert-inter, a few
layers. Dense: the same shape as a Llama (Mixtral without experts) whose one MLP has 8x the
expert intermediate size, so both hold the same number of parameters. A decode step of the MoE
model reads the attention weights and 2 of the 8 experts: if the expert kernel reads only the
selected experts, it decodes several times faster than the dense one (the ideal ratio is
printed beside the measured one). Random fp32 weights (speed does not depend on values);
batch 1. Never a test: figures, not assertions.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def shapes(args):
    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048,
                  tie_word_embeddings=False)
    moe = dict(common, intermediate_size=args.expert_inter, num_local_experts=args.experts,
               num_experts_per_tok=args.top_k)
    dense = dict(common, intermediate_size=args.expert_inter * args.experts)
    return moe, dense


def make_checkpoint(kind: str, cfg: dict, root: str) -> tuple[str, int, int]:
    """(path, total parameters, parameters a decode step reads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if kind == "moe":
        model = MixtralForCausalLM(MixtralConfig(**cfg)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    read = total - embed - experts + (experts * cfg.get("num_experts_per_tok", 1)
                                      // cfg.get("num_local_experts", 1))
    path = os.path.join(root, kind)
    model.save_pretrained(path, safe_serialization=True)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import make_tokenizer

    make_tokenizer(path)  # the benchmark feeds token ids; any tokenizer will do
    return path, total, read


def decode_tok_s(out: str, prompt_len: int, gen_len: int, threads: int) -> float:
    import numpy as np

    from tvm_llm import Engine

    eng = Engine(out, num_threads=threads)
    prompt = np.random.default_rng(0).integers(3, 900, size=prompt_len)
    sid = eng.cache.add()
    row = eng.prefill_positions([sid], [prompt_len], prompt[None], np.arange(prompt_len)[None],
                                np.array([prompt_len - 1]))[0][-1]
    tok = int(row.argmax())
    for _ in range(3):  # warm-up
        tok = int(eng.decode_step([sid], [tok])[0].argmax())
    t0 = time.perf_counter()
    for _ in range(gen_len):
        tok = int(eng.decode_step([sid], [tok])[0].argmax())
    dt = time.perf_counter() - t0
    eng.cache.remove(sid)
    return gen_len / dt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-inter", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", metavar="DIR", help="build into DIR and keep the builds (e.g. for "
                   "scripts/profile_step.py DIR/moe-out)")
    args = p.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm_llm

    moe_cfg, dense_cfg = shapes(args)
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        root = args.keep or tmp
        models = {}
        for kind, cfg in (("moe", moe_cfg), ("dense", dense_cfg)):
            path, total, read = make_checkpoint(kind, cfg, root)
            out = os.path.join(root, f"{kind}-out")
            t0 = time.perf_counter()
            tvm_llm.build(path, out, max_batch_size=1, prefill_chunk_size=64,
                          context_window=512, log=lambda *a: None)
            print(f"# {kind}: {total / 1e6:.1f}M parameters, {read / 1e6:.1f}M read per decode "
                  f"step; built in {time.perf_counter() - t0:.0f}s", flush=True)
            models[kind] = (out, total, read)
        speeds = {k: [] for k in models}
        for _ in range(args.repeats):  # interleaved, medians
            for kind, (out, _, _) in models.items():
                speeds[kind].append(decode_tok_s(out, args.prompt_len, args.gen_len, args.threads))
        med = {k: statistics.median(v) for k, v in speeds.items()}
        ideal = models["dense"][2] / models["moe"][2]
        print(f"decode tok/s (batch 1, {args.threads} threads, median of {args.repeats}): "
              f"moe {med['moe']:.1f}, dense {med['dense']:.1f}; ratio moe/dense "
              f"{med['moe'] / med['dense']:.2f}x (weights read per step: {ideal:.2f}x fewer)")


if __name__ == "__main__":
    main()
