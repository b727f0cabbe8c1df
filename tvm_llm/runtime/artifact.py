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


def save_weights(path: str, names: list, arrays: list) -> list:
    """Write arrays back to back (aligned) and return the parameter table for the manifest."""
    table, offset = [], 0
    with open(path, "wb") as f:
        for name, arr in zip(names, arrays):
            arr = np.ascontiguousarray(arr)
            pad = (-offset) % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(arr.tobytes())
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


def read_manifest(out_dir: str) -> dict:
    from ..errors import UserError

    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(f"{out_dir}: not a tvm-llm output directory (no {MANIFEST}); "
                        "create one with `tvm-llm build MODEL_DIR -o OUT`")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: corrupt manifest ({e}); rebuild the output directory") from None
    for name in (LIBRARY, WEIGHTS):
        if not os.path.isfile(os.path.join(out_dir, name)):
            raise UserError(f"{out_dir}: {name} is missing; rebuild the output directory")
    return manifest
