"""Fuzz suite: generated bad inputs, each answered by one clear line, never a crash.

Every case below — a damaged checkpoint, an out-of-range option, a tampered output directory,
a bad prompt or token id, a bad Python API call — runs in a process of its own (forked from a
server that has the heavy imports loaded: tests/isolated.py) and must:

* exit with code 2 (the API: raise UserError), never with a signal (the process stays alive);
* print at most 2 lines on stderr and no traceback;
* leave nothing behind: no output directory, no `.tvm-llm-*` temporary directory, no file
  added to or removed from its working directory.

One good build (the session's tiny llama) and one good checkpoint are shared; each case
copies what it damages.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

import isolated

# --------------------------------------------------------------------------- checkpoint damage


def _cfg(key, value):
    def edit(d):
        path = os.path.join(d, "config.json")
        cfg = json.load(open(path))
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
        json.dump(cfg, open(path, "w"))
    return edit


_DELETE = object()


def _write(name, data: bytes):
    def edit(d):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return edit


def _remove(name):
    return lambda d: os.remove(os.path.join(d, name))


def _tensors(edit_fn):
    def edit(d):
        from safetensors.numpy import load_file, save_file

        path = os.path.join(d, "model.safetensors")
        t = load_file(path)
        edit_fn(t)
        save_file(t, path, metadata={"format": "pt"})
    return edit


def _cast(name, dtype):
    def f(t):
        t[name] = t[name].astype(dtype)
    return f


def _truncate(name, keep):
    def edit(d):
        path = os.path.join(d, name)
        data = open(path, "rb").read()
        open(path, "wb").write(data[:keep if keep >= 0 else len(data) + keep])
    return edit


def _pickle_only(d):
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "pytorch_model.bin"))


def _bad_header(d):
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(struct.pack("<Q", 1 << 62) + data[8:])


EMB = "model.embed_tokens.weight"
CHECKPOINT_CASES = {
    "config-json-list": (_write("config.json", b"[1, 2, 3]"), "JSON list"),
    "config-json-string": (_write("config.json", b'"llama"'), "JSON str"),
    "config-invalid-json": (_write("config.json", b'{"model_type": "llama",'), "not valid JSON"),
    "config-empty": (_write("config.json", b""), "not valid JSON"),
    "config-binary": (_write("config.json", bytes(range(256))), "config.json"),
    "config-missing": (_remove("config.json"), "config.json is missing"),
    "layers-zero": (_cfg("num_hidden_layers", 0), "num_hidden_layers is 0"),
    "layers-negative": (_cfg("num_hidden_layers", -2), "num_hidden_layers"),
    "layers-string": (_cfg("num_hidden_layers", "2"), "num_hidden_layers"),
    "layers-float": (_cfg("num_hidden_layers", 2.5), "num_hidden_layers"),
    "hidden-zero": (_cfg("hidden_size", 0), "hidden_size"),
    "heads-zero": (_cfg("num_attention_heads", 0), "num_attention_heads"),
    "vocab-zero": (_cfg("vocab_size", 0), "vocab_size"),
    "vocab-bool": (_cfg("vocab_size", True), "vocab_size"),
    "vocab-huge": (_cfg("vocab_size", 10**12), "vocab_size"),
    "max-pos-zero": (_cfg("max_position_embeddings", 0), "max_position_embeddings"),
    "vocab-below-tokenizer": (_cfg("vocab_size", 100), "vocab_size is 100"),
    "model-type-missing": (_cfg("model_type", _DELETE), "model_type"),
    "model-type-unknown": (_cfg("model_type", "llamazing"), "unknown model_type"),
    "model-type-number": (_cfg("model_type", 7), "model_type"),
    "no-weights": (_remove("model.safetensors"), "no *.safetensors"),
    "pickle-only": (_pickle_only, "only pickle weights"),
    "weights-empty": (_write("model.safetensors", b""), "model.safetensors"),
    "weights-garbage": (_write("model.safetensors", b"\x00garbage" * 100), "model.safetensors"),
    "weights-truncated": (_truncate("model.safetensors", -1000), "model.safetensors"),
    "weights-header-length": (_bad_header, "model.safetensors"),
    "weight-int32": (_tensors(_cast(EMB, "int32")), "is I32, not floating point"),
    "weight-int8": (_tensors(_cast("model.layers.0.mlp.up_proj.weight", "int8")), "I8"),
    "weight-bool": (_tensors(_cast("model.norm.weight", "bool")), "BOOL"),
    "weight-missing": (_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "is missing"),
    "weight-misshapen": (_tensors(lambda t: t.update({EMB: t[EMB][:, :32].copy()})), EMB),
    "tokenizer-missing": (_remove("tokenizer.json"), "tokenizer.json is missing"),
    "tokenizer-truncated": (_truncate("tokenizer.json", 200), "cannot load it"),
    "tokenizer-binary": (_write("tokenizer.json", bytes(range(256)) * 4), "cannot load it"),
    "tokenizer-wrong-json": (_write("tokenizer.json", b'{"model": 5}'), "cannot load it"),
}

# --------------------------------------------------------------------------- CLI options

BUILD_OPTION_CASES = {
    "page-size-0": (["--page-size", "0"], "--page-size"),
    "page-size-7": (["--page-size", "7"], "--page-size 7"),
    "page-size-12": (["--page-size", "12"], "--page-size 12"),
    "page-size-256": (["--page-size", "256"], "--page-size 256"),
    "page-size-text": (["--page-size", "big"], "--page-size"),
    "batch-0": (["--max-batch-size", "0"], "--max-batch-size"),
    "chunk-negative": (["--prefill-chunk-size", "-5"], "--prefill-chunk-size"),
    "context-0": (["--context-window", "0"], "--context-window"),
    "context-too-long": (["--context-window", "100000"], "max_position_embeddings"),
    "kv-tokens-float": (["--kv-cache-tokens", "1e3"], "--kv-cache-tokens"),
    "kv-tokens-huge": (["--kv-cache-tokens", "99999999999"], "--kv-cache-tokens"),
    "memory-1e30GB": (["--max-memory", "1e30GB"], "--max-memory"),
    "memory-above-machine": (["--max-memory", "1000TB"], "exceeds this machine"),
    "memory-words": (["--max-memory", "lots"], "not a size"),
    "memory-negative": (["--max-memory", "-1GB"], "--max-memory"),
    "memory-nan": (["--max-memory", "nan"], "--max-memory"),
    "dtype-unknown": (["--dtype", "float8"], "unknown dtype"),
    "target-unknown": (["--target", "tpu"], "unknown target"),
    "group-size-0": (["--quantization", "q4", "--group-size", "0"], "--group-size"),
    "unknown-option": (["--frobnicate"], "unrecognized arguments"),
}

PLAN_OPTION_CASES = {
    "plan-memory-1e30GB": (["--max-memory", "1e30GB"], "--max-memory"),
    "plan-memory-above-machine": (["--max-memory", "1000TB"], "exceeds this machine"),
    "plan-page-size-3": (["--page-size", "3"], "--page-size 3"),
}

RUN_OPTION_CASES = {  # (subcommand, options, expected text)
    "gen-max-new-tokens-neg": ("generate", ["--max-new-tokens", "-1"], "--max-new-tokens"),
    "gen-max-new-tokens-0": ("generate", ["--max-new-tokens", "0"], "--max-new-tokens"),
    "gen-threads-0": ("generate", ["--threads", "0"], "--threads"),
    "gen-threads-text": ("generate", ["--threads", "all"], "--threads"),
    "gen-temperature-neg": ("generate", ["--temperature", "-1"], "--temperature"),
    "gen-temperature-nan": ("generate", ["--temperature", "nan"], "--temperature"),
    "gen-temperature-inf": ("generate", ["--temperature", "inf"], "--temperature"),
    "gen-top-p-0": ("generate", ["--top-p", "0"], "--top-p"),
    "gen-top-p-big": ("generate", ["--top-p", "1.5"], "--top-p"),
    "gen-top-k-neg": ("generate", ["--top-k", "-1"], "--top-k"),
    "gen-seed-neg": ("generate", ["--seed", "-1"], "--seed"),
    "gen-stop-id-text": ("generate", ["--stop-token-id", "eos"], "--stop-token-id"),
    "verify-min-cosine-nan": ("verify", ["--min-cosine", "nan"], "--min-cosine"),
    "verify-min-cosine-2": ("verify", ["--min-cosine", "2"], "--min-cosine"),
    "verify-min-top1-neg": ("verify", ["--min-top1", "-0.1"], "--min-top1"),
    "ppl-window-0": ("perplexity", ["--window", "0"], "--window"),
    "ppl-max-windows-neg": ("perplexity", ["--max-windows", "-2"], "--max-windows"),
    "ppl-text-missing": ("perplexity", ["--text", "nope.txt"], "not found"),
    "ppl-window-too-big": ("perplexity", ["--window", "100000"], "prefill chunk size"),
}

# --------------------------------------------------------------------------- output damage


def _manifest(edit_fn):
    def edit(d):
        path = os.path.join(d, "manifest.json")
        m = json.load(open(path))
        edit_fn(m)
        json.dump(m, open(path, "w"))
    return edit


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def f(m):
        node = m
        for k in keys[:-1]:
            node = node[k]
        if value is _DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return f


OUTPUT_CASES = {
    "page-size-0": (_manifest(_set("kv_cache", "page_size", 0)), "page_size"),
    "page-size-7": (_manifest(_set("kv_cache", "page_size", 7)), "page_size"),
    "page-size-string": (_manifest(_set("kv_cache", "page_size", "16")), "page_size"),
    "kv-cache-missing": (_manifest(_set("kv_cache", _DELETE)), "kv_cache"),
    "kv-dtype-int8": (_manifest(_set("kv_cache", "dtype", "int8")), "kv_cache.dtype"),
    "batch-0": (_manifest(_set("kv_cache", "max_batch_size", 0)), "max_batch_size"),
    "total-negative": (_manifest(_set("kv_cache", "max_total_seq_len", -16)), "max_total_seq_len"),
    "vocab-negative": (_manifest(_set("model", "vocab_size", -1)), "vocab_size"),
    "eos-out-of-range": (_manifest(_set("tokenizer", "eos_token_ids", [10**9])), "eos_token_ids"),
    "dtype-unknown": (_manifest(_set("dtype", "float8")), "dtype"),
    "param-dtype-changed": (_manifest(lambda m: m["params"][1].update(dtype="float16")),
                            "params[1]"),
    "param-shape-changed": (_manifest(lambda m: m["params"][1].update(shape=[3, 3])), "params[1]"),
    "param-offset-negative": (_manifest(lambda m: m["params"][0].update(offset=-64)), "offset"),
    "params-empty": (_manifest(_set("params", [])), "params"),
    "manifest-list": (_write("manifest.json", b"[]"), "must be an object"),
    "manifest-corrupt": (_truncate("manifest.json", 100), "corrupt manifest"),
    "manifest-missing": (_remove("manifest.json"), "not a tvm-llm output directory"),
    "model-so-empty": (_write("model.so", b""), "model.so"),
    "model-so-garbage": (_write("model.so", b"garbage" * 1000), "model.so"),
    "model-so-fake-elf": (_write("model.so", b"\x7fELF" + b"\x00" * 4000), "model.so"),
    "model-so-missing": (_remove("model.so"), "model.so is missing"),
    "weights-truncated": (_truncate("weights.bin", -4096), "weights.bin"),
    "weights-grown": (lambda d: open(os.path.join(d, "weights.bin"), "ab").write(b"\0" * 64),
                      "weights.bin"),
    "weights-missing": (_remove("weights.bin"), "weights.bin is missing"),
    "tokenizer-missing": (_remove("tokenizer.json"), "tokenizer.json is missing"),
    "tokenizer-corrupt": (_truncate("tokenizer.json", 300), "tokenizer.json"),
    "tokenizer-binary": (_write("tokenizer.json", bytes(range(256))), "tokenizer.json"),
}

# --------------------------------------------------------------------------- Python API

API_CASES = {
    # token ids are validated by the Engine (runtime/engine.py, the serving work)
    "engine-token-id-too-big": ("Engine(OUT).generate([[5, 100000000]])", "token"),
    "engine-token-id-negative": ("Engine(OUT).generate([[5, -3]])", "token"),
    "engine-no-directory": ("Engine('missing-dir')", "not a tvm-llm output directory"),
    "build-context-0": ("tvm_llm.build(CK, 'out', context_window=0)", "context_window"),
    "build-kv-tokens-huge": ("tvm_llm.build(CK, 'out', kv_cache_tokens=2**40)", "kv_cache_tokens"),
    "build-page-size-12": ("tvm_llm.build(CK, 'out', page_size=12)", "page"),
    "build-page-size-0": ("tvm_llm.build(CK, 'out', page_size=0)", "page_size"),
    "build-batch-0": ("tvm_llm.build(CK, 'out', max_batch_size=0)", "max_batch_size"),
    "build-dtype": ("tvm_llm.build(CK, 'out', dtype='int4')", "unknown dtype"),
    "build-memory-too-big": ("tvm_llm.build(CK, 'out', max_memory='1e30GB')", "--max-memory"),
    "build-no-checkpoint": ("tvm_llm.build('missing-ck', 'out')", "no such directory"),
}


# --------------------------------------------------------------------------- the checks

def _listing(root):
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, n), root))
    return found


def _check(case_dir, kind, payload, expect, code=2):
    before = _listing(case_dir)
    r = isolated.run(kind, payload, str(case_dir))
    assert r.exitcode >= 0, f"killed by signal {-r.exitcode}: {r.stderr}"
    assert r.exitcode == code, (r.exitcode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert 1 <= len(r.err_lines) <= 2, r.err_lines
    assert expect.lower() in r.stderr.lower(), (expect, r.err_lines)
    after = _listing(case_dir)
    assert after == before, f"left behind: {sorted(after - before)}, removed: {sorted(before - after)}"
    assert not [n for n in os.listdir(case_dir) if n.startswith(".tvm-llm")]


@pytest.fixture(scope="module")
def good(built, checkpoint):
    return {"out": built("llama"), "ck": checkpoint("llama")}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_damaged_checkpoint(case, good, tmp_path):
    damage, expect = CHECKPOINT_CASES[case]
    ck = tmp_path / "ck"
    shutil.copytree(good["ck"], ck)
    damage(str(ck))
    _check(tmp_path, "cli", ["build", "ck", "-o", "out"], expect)


@pytest.mark.parametrize("case", sorted(BUILD_OPTION_CASES))
def test_bad_build_option(case, good, tmp_path):
    options, expect = BUILD_OPTION_CASES[case]
    _check(tmp_path, "cli", ["build", good["ck"], "-o", "out", *options], expect)


@pytest.mark.parametrize("case", sorted(PLAN_OPTION_CASES))
def test_bad_plan_option(case, good, tmp_path):
    options, expect = PLAN_OPTION_CASES[case]
    _check(tmp_path, "cli", ["plan", good["ck"], *options], expect)


@pytest.mark.parametrize("case", sorted(RUN_OPTION_CASES))
def test_bad_run_option(case, good, tmp_path):
    command, options, expect = RUN_OPTION_CASES[case]
    _check(tmp_path, "cli", [command, good["out"], *options], expect)


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
@pytest.mark.parametrize("command", ["generate"])
def test_damaged_output_directory(case, command, good, tmp_path):
    damage, expect = OUTPUT_CASES[case]
    out = tmp_path / "out"
    shutil.copytree(good["out"], out)
    damage(str(out))
    _check(tmp_path, "cli", [command, "out", "--prompt", "the", "--max-new-tokens", "4"], expect)


@pytest.mark.parametrize("command", ["perplexity", "verify", "inspect"])
def test_damaged_output_other_commands(command, good, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(good["out"], out)
    _manifest(_set("kv_cache", "page_size", 0))(str(out))
    _check(tmp_path, "cli", [command, "out"], "page_size")


@pytest.mark.parametrize("prompt", ["\udcff\udcfe", "ok \udc80 then"])
@pytest.mark.parametrize("command", ["generate", "verify"])
def test_non_utf8_prompt(command, prompt, good, tmp_path):
    _check(tmp_path, "cli", [command, good["out"], "--prompt", prompt], "UTF-8")


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"\xff\xfe\x00\x00" * 100,
                                     b"text\x00with nul bytes" * 20, b"   \n"])
def test_bad_perplexity_text(content, good, tmp_path):
    (tmp_path / "t.bin").write_bytes(content)
    _check(tmp_path, "cli", ["perplexity", good["out"], "--text", "t.bin"], "t.bin")


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_bad_api_call(case, good, tmp_path):
    source, expect = API_CASES[case]
    prelude = (f"import tvm_llm\nfrom tvm_llm import Engine\nOUT = {good['out']!r}\n"
               f"CK = {good['ck']!r}\n")
    _check(tmp_path, "api", prelude + source, expect)


def test_the_suite_is_large_enough():
    n = (len(CHECKPOINT_CASES) + len(BUILD_OPTION_CASES) + len(PLAN_OPTION_CASES)
         + len(RUN_OPTION_CASES) + len(OUTPUT_CASES) + 3 + 4 + 4 + len(API_CASES))
    assert n >= 60, n


def test_non_utf8_prompt_from_a_real_command_line(good, tmp_path):
    """The bytes as a shell passes them (argv decoded with surrogateescape by Python)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable.encode(), b"-m", b"tvm_llm.cli", b"generate",
                           good["out"].encode(), b"--prompt", b"\xff\xfe bad"],
                          capture_output=True, cwd=tmp_path, timeout=300)
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and "UTF-8" in err and "Traceback" not in err, err
    assert len([l for l in err.splitlines() if l.strip()]) == 1, err
