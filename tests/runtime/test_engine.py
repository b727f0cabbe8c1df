"""Runtime behaviour: fresh process without torch, sampling, stop tokens, streaming, queueing."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tvm_llm.runtime.sampling import SamplingParams, sample

PROMPTS = [[5, 9, 33, 41, 7], [100, 3, 250, 17, 18, 19, 60, 61], [11, 12]]


@pytest.fixture(scope="module")
def engine(built):
    from tvm_llm import Engine

    return Engine(built("llama"))


def test_fresh_process_reproduces_tokens_without_torch(built, engine):
    out = built("llama")
    expected = engine.generate_ids(PROMPTS, max_new_tokens=16, ignore_eos=True)
    # torch and transformers are made unimportable: the runtime must not need them at all
    code = f"""
import importlib.abc, json, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, NoTorch())
from tvm_llm import Engine
eng = Engine({out!r})
ids = eng.generate_ids({PROMPTS!r}, max_new_tokens=16, ignore_eos=True)
text = eng.generate("the quick", max_new_tokens=4)
banned = [m for m in ("torch", "transformers") if m in sys.modules]
print(json.dumps({{"ids": ids, "banned": banned, "text": text}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["banned"] == []
    assert result["ids"] == expected
    assert isinstance(result["text"], str)


def test_more_prompts_than_batch_slots_queue_and_match(engine):
    # the build allows 4 sequences at once: 7 prompts must wait their turn and still match
    prompts = [[3 + i, 40 + 2 * i, 77] for i in range(7)]
    together = engine.generate_ids(prompts, max_new_tokens=6, ignore_eos=True)
    alone = [engine.generate_ids([p], max_new_tokens=6, ignore_eos=True)[0] for p in prompts]
    assert together == alone
    assert engine.cache.free_pages() == engine.cache.total_pages


def test_stop_token_ends_generation(engine):
    greedy = engine.generate_ids([PROMPTS[0]], max_new_tokens=12, ignore_eos=True)[0]
    stop = greedy[4]
    cut = engine.generate_ids([PROMPTS[0]], max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop])[0]
    assert cut == greedy[: greedy.index(stop) + 1]


def test_max_new_tokens_is_respected(engine):
    assert [len(x) for x in engine.generate_ids(PROMPTS, max_new_tokens=3, ignore_eos=True)] == [3, 3, 3]


def test_sampling_is_seeded_and_varies(engine):
    kw = dict(max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.95, ignore_eos=True)
    a = engine.generate_ids(PROMPTS, seed=7, **kw)
    b = engine.generate_ids(PROMPTS, seed=7, **kw)
    c = engine.generate_ids(PROMPTS, seed=8, **kw)
    assert a == b
    assert a != c


def test_stream_pieces_concatenate_to_generate(engine):
    prompts = ["the quick brown", "def main"]
    pieces = {0: "", 1: ""}
    for i, piece in engine.stream(prompts, max_new_tokens=10, ignore_eos=True):
        pieces[i] += piece
    assert [pieces[0], pieces[1]] == engine.generate(prompts, max_new_tokens=10, ignore_eos=True)


def test_bad_generation_parameters(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("x", top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate("x", max_new_tokens=0)


def test_greedy_sampling_picks_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, SamplingParams(), np.random.default_rng(0)) == 1


def test_top_k_and_top_p_restrict_the_choices():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    top1 = {sample(logits, SamplingParams(temperature=1.0, top_k=1), rng) for _ in range(50)}
    assert top1 == {0}
    nucleus = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), rng) for _ in range(300)}
    assert nucleus == {0, 1}  # 0.5 + 0.3 covers 0.7
    every = {sample(logits, SamplingParams(temperature=1.0), rng) for _ in range(2000)}
    assert every == {0, 1, 2, 3}


def test_temperature_sharpens_the_distribution():
    rng = np.random.default_rng(1)
    logits = np.array([1.0, 0.0])
    cold = sum(sample(logits, SamplingParams(temperature=0.1), rng) == 0 for _ in range(500))
    hot = sum(sample(logits, SamplingParams(temperature=5.0), rng) == 0 for _ in range(500))
    assert cold > 490 and 200 < hot < 350


def test_a_prefill_call_longer_than_the_chunk_is_a_user_error(engine):
    """The low-level prefill takes at most one chunk (its activations are planned for that);
    more is a UserError naming both sizes, and the engine still serves afterwards."""
    from tvm_llm.errors import UserError

    chunk = engine.cache.prefill_chunk_size
    sid = engine.cache.add()
    try:
        with pytest.raises(UserError, match=f"got {chunk + 1} tokens.*prefill chunk is {chunk}"):
            engine.prefill([(sid, [5] * (chunk + 1))])
        assert engine.prefill([(sid, [5] * chunk)]).shape[0] == 1
    finally:
        engine.cache.remove(sid)
    assert len(engine.generate_ids([PROMPTS[0]], max_new_tokens=4, ignore_eos=True)[0]) == 4


def test_weights_uploaded_into_the_huge_page_arena_keep_their_bytes(tmp_path, monkeypatch):
    """engine._upload_weights on the CPU: weights of several dtypes and sizes written by
    artifact.save_weights come back with their shapes, dtypes and bytes from the one arena, and
    where the kernel offers THP on request ([madvise] or [always]) the process holds at least
    a 2 MiB huge page more after loading 6 MiB of them."""
    import re

    import tvm

    from tvm_llm.runtime import artifact
    from tvm_llm.runtime.engine import _upload_weights

    def huge_kb():
        with open("/proc/self/smaps_rollup") as f:
            return int(re.search(r"AnonHugePages:\s+(\d+)", f.read()).group(1))

    monkeypatch.delenv("TVM_LLM_HUGE_PAGES", raising=False)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((768, 2048)).astype("float32"),  # 6 MiB
              rng.integers(-128, 127, size=(3, 5), dtype=np.int8),
              rng.standard_normal((7,)).astype("float16"),
              rng.integers(0, 255, size=(33, 64), dtype=np.uint8)]
    path = str(tmp_path / "weights.bin")
    table = artifact.save_weights(path, [f"w{i}" for i in range(len(arrays))], arrays)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        offered = "[never]" not in f.read()
    before = huge_kb()
    tensors = _upload_weights(path, table, tvm, tvm.cpu())
    for t, a in zip(tensors, arrays):
        assert tuple(t.shape) == a.shape and str(t.dtype) == str(a.dtype)
        assert t.data_ptr() % 64 == 0
        np.testing.assert_array_equal(t.numpy(), a)
    if offered:
        assert huge_kb() >= before + 2048


def test_amx_build_asks_for_the_tile_state_and_refusal_is_a_user_error(monkeypatch):
    """A bfloat16 build whose target has AMX runs prefill on tiles: the engine asks Linux for the
    tile state before loading it, and a refusal is a clear UserError, not a SIGILL later. Float32
    builds and targets without AMX ask nothing."""
    from tvm_llm.errors import UserError
    from tvm_llm.runtime import artifact, cpu_probe

    asked = []

    def refuse():
        asked.append(1)
        return False, "refused (EINVAL)"

    monkeypatch.setattr(cpu_probe, "request_amx_permission", refuse)
    amx = {"target": {"cpu_features": {"amx": {"llvm_feature": True}}}, "dtype": "bfloat16"}
    with pytest.raises(UserError, match=r"uses AMX tiles.*refused \(EINVAL\).*rebuild"):
        artifact.check_amx(amx)
    artifact.check_amx({**amx, "dtype": "float32"})
    artifact.check_amx({"target": {"cpu_features": {"amx": {"llvm_feature": False}}},
                        "dtype": "bfloat16"})
    artifact.check_amx({"target": {"device_type": "cuda"}, "dtype": "bfloat16"})
    assert asked == [1]


def test_a_build_for_a_cpu_with_more_instructions_is_refused_before_it_runs(built, tmp_path, monkeypatch):
    """An x86 build whose target has instructions this CPU lacks (built on an AVX-512 machine,
    run on an AVX2 one) would die by SIGILL at its first kernel: the engine refuses it first,
    naming what is missing and the fix (--arch x86-64-v3). The flags are this CPU's as
    /proc/cpuinfo would give them on an AVX2-only machine."""
    import json
    import os
    import shutil

    from tvm_llm import Engine
    from tvm_llm.errors import UserError
    from tvm_llm.runtime import cpu_probe

    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds only")
    out = str(tmp_path / "out")
    shutil.copytree(built("llama"), out)
    path = os.path.join(out, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    target = json.loads(manifest["target"]["tvm_target"])
    avx2_only = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    monkeypatch.setattr(cpu_probe, "host_cpu_flags", lambda: avx2_only)
    for mcpu, refused in (("skylake-avx512", True), ("x86-64-v3", False)):
        manifest["target"]["tvm_target"] = json.dumps({**target, "mcpu": mcpu, "mattr": []})
        with open(path, "w") as f:
            json.dump(manifest, f)
        if refused:
            with pytest.raises(UserError, match=r"lacks avx512f.*--arch.*x86-64-v3"):
                Engine(out)
        else:
            Engine(out)  # x86-64-v3 needs nothing this CPU lacks: loads
    x86_64_v3 = json.dumps({**target, "mcpu": "x86-64-v3", "mattr": []})  # no host extras (AMX...)
    assert cpu_probe.missing_cpu_features(x86_64_v3, avx2_only) == []
