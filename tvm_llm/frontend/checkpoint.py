"""Read a Hugging Face checkpoint directory: config, tokenizer files and safetensors weights.

Every way a checkpoint can be wrong is turned into one UserError line here, before anything is
traced or compiled. Weights come from safetensors only: a pickle (.bin/.pt) is never loaded.
"""
from __future__ import annotations

import json
import os

from ..errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_config(model_dir: str):
    """The transformers config of a causal LM checkpoint, validated."""
    if not os.path.isdir(model_dir):
        raise UserError(f"{model_dir}: no such directory; pass a Hugging Face checkpoint directory")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{model_dir}: config.json is missing; a Hugging Face checkpoint directory "
                        "needs config.json, *.safetensors and tokenizer files")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e}); fix or re-download the config") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: holds a JSON {type(raw).__name__}, not an object of config "
                        "fields; fix or re-download the config")
    from transformers import CONFIG_MAPPING, AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{path}: unknown model_type {model_type!r}; tvm_llm imports the decoder "
                        "architectures that transformers knows (e.g. llama, qwen2, gemma, phi3, gpt2)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{path}: model_type {model_type!r} has no causal-LM head in transformers; "
                        "tvm_llm compiles decoder-only language models")
    check_config_sizes(raw, path)  # before transformers, which may divide by them
    if isinstance(raw.get("text_config"), dict):
        check_config_sizes(raw["text_config"], path)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types for a malformed config
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: transformers cannot read this config ({first})") from None
    text = config.get_text_config()
    check_config_sizes({k: getattr(text, k, None) for k in SIZE_FIELDS}, path)
    return config


# config fields that size the model: each, where the config has it, must be a positive integer
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "head_dim", "max_position_embeddings",
               "n_embd", "n_layer", "n_head", "n_positions")
MAX_SIZE = 1 << 24  # far above any real model's dimension, below what would overflow int32 math


def check_config_sizes(values: dict, path: str) -> None:
    """Types and ranges of the sizes in `values` (config fields): a zero, negative, fractional,
    boolean, string or absurd value is refused here instead of failing (or allocating) deep in
    transformers or the trace."""
    for name in SIZE_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
            raise UserError(f"{path}: {name} is {value!r}; it must be a positive integer (at most "
                            f"{MAX_SIZE}): fix config.json")


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if files:
        return files
    pickles = sorted(f for f in os.listdir(model_dir) if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UserError(f"{model_dir}: only pickle weights ({pickles[0]}) found; tvm_llm loads "
                        "safetensors only: convert the checkpoint to *.safetensors first")
    raise UserError(f"{model_dir}: no *.safetensors weight files found")


def load_model(model_dir: str, config, dtype: str):
    """The transformers model with every weight taken from the directory's safetensors.

    transformers' own loader maps checkpoint names to modules (prefixes, tied embeddings,
    renamed keys); a tensor it reports missing or misshapen is an error here, never a random init.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # our own errors below say what is wrong; transformers' tables and progress bars would not
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    check_weight_dtypes(model_dir)
    torch_dtype = getattr(torch, dtype)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype=torch_dtype, use_safetensors=True,
            local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "size mismatch" in str(e) or "shape" in str(e).lower():
            raise UserError(f"{model_dir}: a weight has the wrong shape for config.json ({first})") from None
        raise UserError(f"{model_dir}: cannot load the safetensors weights ({first})") from None
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        key, found, expected = _mismatch_parts(sorted(mismatched, key=str)[0])
        raise UserError(f"{model_dir}: tensor {key} has shape {found} but config.json implies "
                        f"{expected}; the weights and config.json do not match")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{model_dir}: tensor {missing[0]} is missing from the safetensors "
                        f"files{more}; the checkpoint is incomplete")
    return model.eval()


def _mismatch_parts(entry):
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        key, found, expected = entry
        return key, tuple(found), tuple(expected)
    return str(entry), "?", "?"


def tokenizer_files(model_dir: str, vocab_size: int | None = None) -> list[str]:
    """Tokenizer files to ship with the build; tokenizer.json is required by the runtime, must
    load, and (given the config's `vocab_size`) must not produce ids past the embedding table."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(f"{model_dir}: tokenizer.json is missing; the runtime needs a fast "
                        "tokenizer file (save it with tokenizer.save_pretrained)")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception for bad files
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: the tokenizers library cannot load it ({first}); fix or "
                        "re-download tokenizer.json") from None
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise UserError(f"{path}: the tokenizer has {n} tokens but config.json's vocab_size is "
                        f"{vocab_size}: ids >= {vocab_size} would read past the embedding table; "
                        "use the checkpoint's own tokenizer or fix vocab_size")
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def check_weight_dtypes(model_dir: str) -> None:
    """Every tensor in the safetensors files must be floating point: an integer tensor (a
    quantized or corrupted checkpoint) would be silently cast to float and change the output.
    Read from the files' JSON headers, without loading any tensor."""
    import struct

    for name in safetensors_files(model_dir):
        path = os.path.join(model_dir, name)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100 * 2**20:
                    raise ValueError("header length out of range")
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error, UnicodeDecodeError):
            raise UserError(f"{path}: not a readable safetensors file; re-download or "
                            "re-save the weights") from None
        if not isinstance(header, dict):
            raise UserError(f"{path}: not a readable safetensors file; re-download or "
                            "re-save the weights")
        ends = [info["data_offsets"][1] for key, info in header.items()
                if key != "__metadata__" and isinstance(info, dict)
                and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
                and isinstance(info["data_offsets"][1], int)]
        if 8 + n + max(ends, default=0) > os.path.getsize(path):
            raise UserError(f"{path}: truncated ({os.path.getsize(path)} bytes, its header "
                            f"describes {8 + n + max(ends)}); re-download the weights")
        for key, info in sorted(header.items()):
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            if info.get("dtype") not in FLOAT_DTYPES:
                raise UserError(f"{path}: tensor {key} is {info.get('dtype')}, not floating "
                                "point; tvm_llm builds float checkpoints (quantize with "
                                "--quantization instead of loading pre-quantized weights)")


def nonfinite_weights(model) -> list[str]:
    """Names of the parameters holding NaN or Inf (each would poison every output).

    One min/max reduction per tensor (NaN propagates into both, an Inf is the min or the max):
    no boolean tensor the size of the weight as torch.isfinite(p).all() makes, about half its
    time (llama-110m: 0.5 s vs 1.1 s CPU once the weights are in memory)."""
    import torch

    def finite(p):
        if p.numel() == 0:
            return True
        lo, hi = torch.aminmax(p.detach().reshape(-1))
        return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))

    return [name for name, p in model.named_parameters() if not finite(p)]
