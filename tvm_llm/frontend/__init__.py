"""Frontend: a Hugging Face checkpoint directory or a transformers model -> Relax IRModule.

    imported = import_model(model, dtype="float32", context_window=2048, ...)

No architecture is described by hand: the transformers model is traced with torch.export, its
attention routed through one custom op that becomes the paged-KV-cache attention.
"""
from __future__ import annotations

import warnings

from .checkpoint import (load_model, nonfinite_weights, read_config, safetensors_files,  # noqa: F401
                         tokenizer_files)
from .relax_import import AttentionShape, ImportedModel  # noqa: F401


def import_model(model, *, dtype: str, context_window: int, max_batch_size: int,
                 prefill_chunk_size: int, target, page_size: int = 16, kv_dtype: str | None = None):
    """Trace `model` (a transformers causal LM in eval mode) into an ImportedModel whose
    module has prefill, decode and create_paged_kv_cache (its kernels built for `page_size`).
    `target`: the TargetSpec (tvm_llm.targets), which picks the cache's attention kernels.
    `kv_dtype`: the KV cache's dtype (default `dtype`); q, k, v are cast to it before the
    cache's attention, and its output back to `dtype`."""
    import torch

    from .attention import use_paged_attention
    from .exporter import export_logits_model
    from .mla import use_latent_attention
    from .moe import use_tvm_experts
    from .relax_import import add_kv_cache_creation, specialize, to_relax

    model = model.to(getattr(torch, dtype)).eval()
    use_paged_attention(model, context_window)
    use_latent_attention(model)  # DeepSeek MLA layers: the latent goes to the cache (mla.py)
    use_tvm_experts(model)
    with warnings.catch_warnings():
        # torch's own pytree code calls its deprecated `isinstance(treespec, LeafSpec)` while
        # exporting (a FutureWarning about torch internals, nothing a user can act on)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is "
                                "deprecated", category=FutureWarning)
        ep = export_logits_model(model, max_seq=max(context_window, prefill_chunk_size))
        vocab = model.config.get_text_config().vocab_size
        imported = to_relax(ep, vocab, dtype, cache_dtype=kv_dtype)
    mod = specialize(imported.mod, max_batch=max_batch_size, max_tokens=prefill_chunk_size)
    imported.mod = add_kv_cache_creation(mod, imported.attention, kv_dtype or dtype, target, page_size)
    return imported
