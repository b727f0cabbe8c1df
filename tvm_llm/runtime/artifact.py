"""The output directory a build writes and the runtime reads: one place defines its files.

    OUT/model.so        the compiled module (kernels + Relax VM bytecode)
    OUT/weights.bin     all weights, raw, 64-byte aligned, in parameter order
    OUT/manifest.json   model, target, KV-cache config, parameter table, build report
    OUT/tokenizer.json  (+ tokenizer_config.json ...) copied from the checkpoint
    OUT/chat_template.jinja  the checkpoint's chat template, when it has one (chat_template.py)
    OUT/source/         generated code, with --emit-source

Only numpy and the standard library are used, so a deployment needs no torch.
"""
from __future__ import annotations

import json
import os

import numpy as np

LIBRARY = "model.so"
WEIGHTS = "weights.bin"
MANIFEST = "manifest.json"
ALIGN = 64


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def save_weights(path: str, names: list, arrays) -> list:
    """Write arrays back to back (aligned) and return the parameter table for the manifest.
    `arrays` may be an iterator (the build's chunked weight transform): each array is written
    as it comes and not kept."""
    table, offset = [], 0
    with open(path, "wb") as f:
        for name, arr in zip(names, arrays, strict=True):
            arr = np.ascontiguousarray(arr)
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(arr.reshape(-1).view(np.uint8).data)  # no copy (tobytes() made one)
            table.append({"name": name, "dtype": str(arr.dtype), "shape": list(arr.shape),
                          "offset": offset, "nbytes": int(arr.nbytes)})
            offset += arr.nbytes
    return table


def load_weights(path: str, table: list) -> list:
    """Memory-map the weights file and return one numpy view per parameter."""
    from ..errors import UserError

    blob = np.memmap(path, dtype=np.uint8, mode="r")
    if blob.size < (table[-1]["offset"] + table[-1]["nbytes"] if table else 0):
        raise UserError(f"{path}: file is shorter than the manifest's parameter table says; "
                        "rebuild the output directory")
    out = []
    for entry in table:
        dt = _np_dtype(entry["dtype"])
        raw = blob[entry["offset"]: entry["offset"] + entry["nbytes"]]
        out.append(raw.view(dt).reshape(entry["shape"]))
    return out


def write_manifest(path: str, manifest: dict) -> None:
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


PARAM_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64")
KV_PAGE_SIZES = (8, 16, 32, 64, 128)
BUILD_DTYPES = ("float32", "float16", "bfloat16")  # a build's dtype and its KV cache's
DEVICE_TYPES = ("cpu", "cuda", "rocm")


def read_manifest(out_dir: str, load_check: bool = True) -> dict:
    """The manifest of a build directory, validated: its schema (types and ranges), the
    parameter table against weights.bin (shape x dtype = bytes, in bounds, in order), and with
    `load_check` that model.so and tokenizer.json load. Any fault is one UserError line naming
    the file; a build whose checkpoint held NaN/Inf weights costs a NonFiniteWarning."""
    from ..errors import UserError

    if not os.path.isdir(out_dir):
        raise UserError(f"{out_dir}: not a tvm-llm output directory (no such directory); "
                        "create one with `tvm-llm build MODEL_DIR -o OUT`")
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(f"{out_dir}: not a tvm-llm output directory (no {MANIFEST}); "
                        "create one with `tvm-llm build MODEL_DIR -o OUT`")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: corrupt manifest ({first}); rebuild the output directory") from None
    for name in (LIBRARY, WEIGHTS):
        if not os.path.isfile(os.path.join(out_dir, name)):
            raise UserError(f"{out_dir}: {name} is missing; rebuild the output directory")
    check_manifest(manifest, path)
    check_weights_file(os.path.join(out_dir, WEIGHTS), manifest["params"])
    if load_check:
        check_library(os.path.join(out_dir, LIBRARY), manifest)
        check_tokenizer(os.path.join(out_dir, "tokenizer.json"))
    bad = manifest.get("nonfinite_weights") or []
    if bad:
        import warnings

        from ..errors import NonFiniteWarning

        warnings.warn(NonFiniteWarning(
            f"{out_dir}: built from a checkpoint whose weight {bad[0]} holds NaN or Inf; its "
            "logits are not numbers and generated text will be empty or garbage"), stacklevel=2)
    return manifest


class _Schema:
    """Checks of one manifest: each failure is one UserError line with the field's path."""

    def __init__(self, path: str):
        self.path = path

    def fail(self, where: str, why: str):
        from ..errors import UserError

        raise UserError(f"{self.path}: {where} {why}; the manifest is damaged or was edited: "
                        "rebuild the output directory")

    def obj(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            self.fail(where, f"must be an object, got {type(value).__name__}")
        return value

    def int_(self, d: dict, key: str, where: str, lo: int = 0, hi: int = 1 << 40,
             optional: bool = False, choices=None):
        if key not in d or (optional and d[key] is None):
            if optional:
                return None
            self.fail(f"{where}.{key}", "is missing")
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f"{where}.{key}", f"must be an integer, got {v!r}")
        if choices is not None and v not in choices:
            self.fail(f"{where}.{key}", f"is {v}, not one of {', '.join(map(str, choices))}")
        if not lo <= v <= hi:
            self.fail(f"{where}.{key}", f"is {v}, outside [{lo}, {hi}]")
        return v

    def str_(self, d: dict, key: str, where: str, choices=None) -> str:
        v = d.get(key)
        if not isinstance(v, str):
            self.fail(f"{where}.{key}", f"must be a string, got {v!r}")
        if choices is not None and v not in choices:
            self.fail(f"{where}.{key}", f"is {v!r}, not one of {', '.join(choices)}")
        return v


def check_manifest(manifest, path: str) -> None:
    """The fields the runtime reads, with their types and ranges."""
    sc = _Schema(path)
    m = sc.obj(manifest, "the manifest")
    model = sc.obj(m.get("model"), "model")
    for key in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        sc.int_(model, key, "model", lo=1, hi=1 << 24)
    sc.str_(m, "dtype", "manifest", BUILD_DTYPES)
    target = sc.obj(m.get("target"), "target")
    sc.str_(target, "device_type", "target", DEVICE_TYPES)
    kv = sc.obj(m.get("kv_cache"), "kv_cache")
    sc.int_(kv, "page_size", "kv_cache", choices=KV_PAGE_SIZES)
    batch = sc.int_(kv, "max_batch_size", "kv_cache", lo=1, hi=1 << 16)
    chunk = sc.int_(kv, "prefill_chunk_size", "kv_cache", lo=1, hi=1 << 24)
    total = sc.int_(kv, "max_total_seq_len", "kv_cache", lo=1, hi=1 << 31)
    ctx = sc.int_(kv, "context_window", "kv_cache", lo=1, hi=1 << 31)
    del batch, chunk
    if "dtype" in kv:  # older manifests have none: the cache holds the build dtype
        sc.str_(kv, "dtype", "kv_cache", BUILD_DTYPES)
    if "sliding_window" in kv:  # older manifests have none: no sliding window
        sc.int_(kv, "sliding_window", "kv_cache", lo=0, hi=1 << 31)
    if ctx > total + kv["page_size"] and not kv.get("sliding_window"):  # a window: pages bounded
        sc.fail("kv_cache.context_window", f"({ctx}) exceeds the KV cache ({total} tokens)")
    tok = sc.obj(m.get("tokenizer"), "tokenizer")
    eos = tok.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < model["vocab_size"] for t in eos):
        sc.fail("tokenizer.eos_token_ids", f"must be a list of token ids below the vocabulary "
                                           f"({model['vocab_size']}), got {eos!r}")
    bos = tok.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)
                            or not 0 <= bos < model["vocab_size"]):
        sc.fail("tokenizer.bos_token_id", f"must be a token id or null, got {bos!r}")
    if not isinstance(tok.get("add_bos", False), bool):
        sc.fail("tokenizer.add_bos", "must be true or false")
    params = m.get("params")
    if not isinstance(params, list) or not params:
        sc.fail("params", "must be a non-empty list of weight entries")
    end = 0
    for i, e in enumerate(params):
        where = f"params[{i}]"
        e = sc.obj(e, where)
        if not isinstance(e.get("name"), str):
            sc.fail(f"{where}.name", "must be a string")
        dtype = sc.str_(e, "dtype", where, PARAM_DTYPES)
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < (1 << 40) for d in shape):
            sc.fail(f"{where}.shape", f"must be a list of non-negative integers, got {shape!r}")
        offset = sc.int_(e, "offset", where, lo=end)
        nbytes = sc.int_(e, "nbytes", where)
        expect = int(np.prod(shape, dtype=object) if shape else 1) * _np_dtype(dtype).itemsize
        if nbytes != expect:
            sc.fail(f"{where} ({e['name']})", f"has {nbytes} bytes but shape {shape} x {dtype} "
                                             f"is {expect}")
        end = offset + nbytes


def check_weights_file(path: str, table: list) -> None:
    from ..errors import UserError

    size = os.path.getsize(path)
    end = table[-1]["offset"] + table[-1]["nbytes"]
    if size != end:
        raise UserError(f"{path}: {size} bytes, but the manifest's parameter table ends at byte "
                        f"{end}; the weights are truncated or do not belong to this manifest: "
                        "rebuild the output directory")


def check_library(path: str, manifest: dict) -> None:
    """model.so must be a shared library the TVM runtime loads (dlopen is cached: the engine's
    own load of the same file costs nothing more)."""
    from ..errors import UserError
    from .tvm_import import import_tvm

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"\x7fELF":
        raise UserError(f"{path}: not a shared library (empty or overwritten); rebuild the "
                        "output directory")
    tvm = import_tvm()
    try:
        tvm.runtime.load_module(path)
    except Exception as e:
        first = str(e).strip().splitlines()[-1][:160] if str(e).strip() else type(e).__name__
        device = manifest["target"]["device_type"]
        hint = ("rebuild the output directory" if device == "cpu" else
                f"it was built for {device}: run it where the TVM runtime has {device} enabled")
        raise UserError(f"{path}: the TVM runtime cannot load it ({first}); {hint}") from None


def check_cpu(manifest: dict) -> None:
    """A CPU build runs only on CPUs with the instructions its target has (the build host's by
    default): refuse, with the fix, what would otherwise die by SIGILL at the first kernel."""
    from ..errors import UserError

    target = manifest["target"]
    if target.get("device_type", "cpu") != "cpu" or not target.get("tvm_target"):
        return
    from .cpu_probe import missing_cpu_features

    missing = missing_cpu_features(target["tvm_target"])
    if missing:
        raise UserError(f"this build is for {target.get('arch') or 'its build machine'}'s CPU, and this CPU "
                        f"lacks {', '.join(missing)}; rebuild it here, or with --arch naming an older CPU "
                        "(x86-64-v3 runs on every x86 CPU with AVX2)")


def check_amx(manifest: dict) -> None:
    """A bfloat16 build for an AMX CPU runs its prefill matmuls on AMX tiles: Linux must grant
    this process the tile state before the first tile instruction, which would otherwise end
    the process with SIGILL. Asks for it; a clear error where it is refused."""
    from ..errors import UserError

    amx = (manifest["target"].get("cpu_features") or {}).get("amx") or {}
    if manifest.get("dtype") != "bfloat16" or not amx.get("llvm_feature"):
        return
    from .cpu_probe import request_amx_permission

    granted, why = request_amx_permission()
    if not granted:
        raise UserError(f"this bfloat16 build uses AMX tiles, and Linux gives this process none "
                        f"({why}: no AMX in this CPU, or a kernel older than 5.16); rebuild it "
                        "on this machine, or with --arch naming a CPU without AMX")


def check_tokenizer(path: str) -> None:
    from ..errors import UserError

    if not os.path.isfile(path):
        raise UserError(f"{path} is missing; copy the checkpoint's tokenizer.json into the output "
                        "directory or rebuild it")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception for bad files
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: the tokenizers library cannot load it ({first}); copy the "
                        "checkpoint's tokenizer.json again or rebuild") from None
