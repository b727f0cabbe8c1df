"""Cross-compile every architecture of the extended test matrix for CUDA and ROCm, one table.

    python scripts/cross_compile_matrix.py [--archs gemma2,mixtral] [--targets cuda:sm_90,rocm:gfx942]

The suite cross-compiles the new attention and expert kernels on their own and a few whole
models (gpt-oss for CUDA, DeepSeek-V3 with dense layers for both); building every tiny model
for both GPUs (16 builds, ~4 minutes on 2 cores) would add that much to CI, so this script does
it on demand.
Each checkpoint is the tests' own (tests/tiny_models.py, tests/test_mla.py's MoE variant); a
build that fails prints its one-line error and the script exits 1. No GPU is needed (nor used).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

ARCHS = ("gemma2", "gemma3_text", "mistral_sw", "mixtral", "qwen2_moe", "olmoe", "gpt_oss",
         "deepseek_v3_moe")


def checkpoint(arch: str, path: str) -> str:
    if arch == "deepseek_v3_moe":
        import test_mla

        return test_mla._make(path, q_lora_rank=24, rope_parameters=test_mla.YARN, moe=True)
    from tiny_models import make_checkpoint

    return make_checkpoint(arch, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--targets", default="cuda:sm_90,rocm:gfx942")
    args = p.parse_args()

    import tvm_llm

    targets = [t.split(":") for t in args.targets.split(",")]
    rows, failed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            ck = checkpoint(arch, os.path.join(tmp, arch))
            for kind, gpu in targets:
                t0 = time.perf_counter()
                try:
                    tvm_llm.build(ck, os.path.join(tmp, f"{arch}-{kind}"), target=kind, arch=gpu,
                                  max_batch_size=4, log=lambda *a: None)
                    status = "ok"
                except Exception as e:  # a failure is a row of the table, then exit 1
                    status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    failed += 1
                rows.append((arch, f"{kind} {gpu}", status, time.perf_counter() - t0))
                print(f"# {arch} {kind} {gpu}: {status} ({rows[-1][3]:.0f} s)", flush=True)
    print("\n| architecture | target | build | seconds |\n|---|---|---|---|")
    for arch, target, status, secs in rows:
        print(f"| {arch} | {target} | {status} | {secs:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
