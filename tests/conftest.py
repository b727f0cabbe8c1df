"""Shared fixtures: tiny checkpoints and their builds, made once per test session."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny_models  # noqa: E402
import torch  # noqa: E402

# The reference models in these tests are tiny: torch on one thread is as fast, and a second
# OpenMP thread contends with TVM's spinning worker pool on a 2-core machine (100x slower forwards).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> path of a tiny random checkpoint of that architecture."""
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = tiny_models.make_checkpoint(arch, str(tmp_path_factory.mktemp(f"ck_{arch}")))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def built(tmp_path_factory, checkpoint):
    """built(arch) -> output directory of a CPU build of the tiny `arch` checkpoint."""
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            import tvm_llm

            out = str(tmp_path_factory.mktemp(f"out_{arch}") / "out")
            tvm_llm.build(checkpoint(arch), out, target="llvm", max_batch_size=4,
                          prefill_chunk_size=64, log=lambda *a: None)
            made[arch] = out
        return made[arch]

    return get


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """hf_model(arch) -> the transformers model of the tiny checkpoint, eager attention."""
    made = {}

    def get(arch: str):
        if arch not in made:
            from transformers import AutoModelForCausalLM

            made[arch] = AutoModelForCausalLM.from_pretrained(
                checkpoint(arch), attn_implementation="eager").eval()
        return made[arch]

    return get
