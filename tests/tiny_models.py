"""Tiny random-weight checkpoints of several architectures, written as HF directories.

Weights are drawn with a large init range and perturbed norms/biases so that logits are well
separated (greedy tokens do not flip on float rounding) and every weight matters numerically.
"""
from __future__ import annotations

import os

VOCAB = 320
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=512,
              tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)


def _configs():
    import transformers as T

    return {
        "llama": lambda: T.LlamaConfig(**COMMON),
        "qwen2": lambda: T.Qwen2Config(**COMMON),
        "gemma": lambda: T.GemmaConfig(**{**COMMON, "head_dim": 16}),
        "phi3": lambda: T.Phi3Config(**{**COMMON, "pad_token_id": 0}),
        "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=512,
                                     initializer_range=0.2, bos_token_id=1, eos_token_id=2),
        "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, vocab_size=VOCAB, rotary_pct=0.25,
                                            initializer_range=0.2, tie_word_embeddings=False,
                                            bos_token_id=1, eos_token_id=2),
        "qwen3": lambda: T.Qwen3Config(**{**COMMON, "head_dim": 16}),
        "gemma2": lambda: T.Gemma2Config(**{**COMMON, "head_dim": 16, "sliding_window": 4}),
        "mistral_sw": lambda: T.MistralConfig(**{**COMMON, "sliding_window": 8}),
        # 2 local (window 4) : 1 global, as Gemma 3's 5 : 1 pattern, in three layers
        "gemma3_text": lambda: T.Gemma3TextConfig(**{
            **COMMON, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 4,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
        # mixtures of experts: 4 experts, top-2 (qwen2_moe: with a shared expert and its gate)
        "mixtral": lambda: T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48),
        "olmoe": lambda: T.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2),
        # gpt-oss: a sliding (window 4) and a full layer, per-head attention sinks, 4 experts
        # top-2 (swiglu clamped at 3, so the clamp acts: gate/up reach ~7 here; biased
        # router), YaRN rotary scaling as the released models
        "gpt_oss": lambda: T.GptOssConfig(**{**COMMON, "head_dim": 16}, sliding_window=4,
                                          layer_types=["sliding_attention", "full_attention"],
                                          num_local_experts=4, num_experts_per_tok=2,
                                          swiglu_limit=3.0,
                                          rope_parameters={
                                              "rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "rope_theta": 10000.0, "truncate": False}),
    }


ARCHS = ("llama", "qwen2", "gemma", "phi3", "gpt2", "gpt_neox")
MOE_ARCHS = ("mixtral", "qwen2_moe", "olmoe")
# half-precision builds are also tested on Qwen3 (per-head q/k RMSNorm before attention)
HALF_ARCHS = ARCHS + ("qwen3",)


def make_tokenizer(path: str) -> None:
    """A small byte-level BPE (fits VOCAB) trained on a fixed text; files in HF layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog " * 4, "def main(): return 0\n" * 4]
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def make_checkpoint(arch: str, path: str, seed: int = 0) -> str:
    """Write a tiny random `arch` checkpoint (safetensors + config + tokenizer) to `path`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    return path
