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
    from transformers import CONFIG_MAPPING, AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{path}: unknown model_type {model_type!r}; tvm_llm imports the decoder "
                        "architectures that transformers knows (e.g. llama, qwen2, gemma, phi3, gpt2)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{path}: model_type {model_type!r} has no causal-LM head in transformers; "
                        "tvm_llm compiles decoder-only language models")
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types for a malformed config
        raise UserError(f"{path}: transformers cannot read this config ({str(e).splitlines()[0]})") from None


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
    safetensors_files(model_dir)
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


def tokenizer_files(model_dir: str) -> list[str]:
    """Tokenizer files to ship with the build; tokenizer.json is required by the runtime."""
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        raise UserError(f"{model_dir}: tokenizer.json is missing; the runtime needs a fast "
                        "tokenizer file (save it with tokenizer.save_pretrained)")
    return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
