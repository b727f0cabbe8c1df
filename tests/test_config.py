"""BuildConfig (tvm_llm/config.py): one constructor and checks for the CLI and the API; the
front half (tvm_llm/front.py) stops at the stage asked for; tune sees the quantization."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tvm_llm.cli import make_parser
from tvm_llm.config import BuildConfig
from tvm_llm.errors import UserError


def test_create_resolves_target_dtype_scheme_and_budget():
    c = BuildConfig.create(quantization="q4_0", max_memory="4GB", page_size=32)
    assert c.spec.name == "llvm" and c.dtype == "float32"
    # an exact format name: 16-bit activations where the host has int8 dot products (VNNI)
    assert c.scheme.format == "q4_0" and c.scheme.activations == ("int16" if c.spec.supports_int8_dot() else "float")
    assert BuildConfig.create(quantization="q4_0", target="cuda", arch="sm_90").scheme.activations == "float"
    assert c.budget.bytes == 4 * 10**9 and c.page_size == 32
    assert BuildConfig.create(target="cuda", arch="sm_90").dtype == "float16"  # the GPU default
    assert c.cache_dtype == "float32"  # the cache takes the build dtype unless asked
    assert BuildConfig.create(kv_dtype="float16").cache_dtype == "float16"
    with pytest.raises(Exception):
        c.dtype = "float16"  # frozen


@pytest.mark.parametrize("options, expect", [
    (dict(dtype="int4"), "unknown dtype"),
    (dict(kv_dtype="int8"), "unknown --kv-dtype 'int8'"),
    (dict(max_batch_size=0), "max_batch_size must be a positive integer"),
    (dict(context_window=2**31), "context_window must be a positive integer below 2^31"),
    (dict(page_size=12), "--page-size 12"),
    (dict(quantization="q3"), "unknown --quantization"),
    (dict(activations="int8"), "need --quantization"),
    (dict(calibrate="awq"), "--calibration/--calibrate/--bits-per-weight need --quantization"),
    (dict(max_memory="4GB", kv_cache_tokens=4096), "not both"),
    (dict(target="tpu"), "unknown target"),
])
def test_bad_options_are_one_line_user_errors(options, expect):
    with pytest.raises(UserError) as e:
        BuildConfig.create(**options)
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_unknown_option_name_is_a_programming_error():
    with pytest.raises(TypeError, match="context_windw"):
        BuildConfig.create(context_windw=128)


def test_cli_and_api_give_the_same_config():
    args = make_parser().parse_args(["plan", "ck", "--quantization", "q8_0", "--keep-float", "0,lm_head",
                                     "--max-batch-size", "4", "--page-size", "32"])
    api = BuildConfig.create(quantization="q8_0", keep_float="0,lm_head", max_batch_size=4,
                             page_size=32)
    assert BuildConfig.from_args(args) == api
    assert api.scheme.keep_float == ("0", "lm_head")


def test_build_cli_q4_means_the_calibrated_mix_and_the_api_q4_stays_plain():
    args = make_parser().parse_args(["build", "ck", "-o", "out", "--quantization", "q4"])
    assert BuildConfig.from_args(args).bits_per_weight is not None
    assert BuildConfig.create(quantization="q4").bits_per_weight is None
    none = make_parser().parse_args(["build", "ck", "-o", "out", "--quantization", "q4",
                                     "--calibrate", "none"])
    assert BuildConfig.from_args(none).bits_per_weight is None
    # the API's recommended() is the CLI's reading (scripts/bench_quality.py builds with it)
    assert BuildConfig.recommended(quantization="q4") == BuildConfig.from_args(args)
    assert BuildConfig.recommended(quantization="q8").calibrate == "awq"
    assert BuildConfig.recommended(quantization="q4", calibrate="none").bits_per_weight is None
    assert BuildConfig.recommended(quantization="q4_k").bits_per_weight is None
    recipe = BuildConfig.recommended(quantization="q4")
    assert BuildConfig.create(**recipe.options()) == recipe  # the stamp bench_quality caches by
    # the default budget is in stored bits: 4.6 where q4_k takes 4.5 (int8 activations), the
    # same 0.1 above an all-q4_k build in the weight-only layout (q4_k stored at 6.0 bits there)
    for act, budget in (("int8", 4.6), ("float", 6.1)):
        a = make_parser().parse_args(["build", "ck", "-o", "out", "--quantization", "q4", "--activations", act])
        assert BuildConfig.from_args(a).bits_per_weight == budget


def test_build_cli_q4_and_q8_take_a_float16_kv_cache_and_exact_names_keep_the_dtype():
    for q in ("q4", "q8"):
        args = make_parser().parse_args(["build", "ck", "-o", "out", "--quantization", q])
        assert BuildConfig.from_args(args).cache_dtype == "float16"
        assert BuildConfig.recommended(quantization=q, calibrate="none").cache_dtype == "float16"
        assert BuildConfig.create(quantization=q).cache_dtype == "float32"  # the API's plain q4 / q8
    asked = make_parser().parse_args(["build", "ck", "-o", "out", "--quantization", "q4",
                                      "--kv-dtype", "float32"])
    assert BuildConfig.from_args(asked).cache_dtype == "float32"
    assert BuildConfig.recommended(quantization="q4_k").cache_dtype == "float32"
    assert BuildConfig.recommended().cache_dtype == "float32"  # float builds match transformers
    assert BuildConfig.recommended(quantization="q4", dtype="bfloat16").cache_dtype == "bfloat16"
    plan = make_parser().parse_args(["plan", "ck", "--quantization", "q4"])  # plans what build makes
    assert BuildConfig.from_args(plan).cache_dtype == "float16"


def test_with_options_checks_again_and_takes_the_new_targets_dtype():
    c = BuildConfig.create(max_batch_size=4)
    assert c.with_options(prefill_chunk_size=64).prefill_chunk_size == 64
    assert c.with_options(target="cuda", arch="sm_90").dtype == "float16"
    # the cache follows a new dtype or target unless it was asked for
    assert c.with_options(target="cuda", arch="sm_90").cache_dtype == "float16"
    assert c.with_options(dtype="bfloat16").cache_dtype == "bfloat16"
    assert c.with_options(kv_dtype="float16").with_options(dtype="bfloat16").cache_dtype == "float16"
    with pytest.raises(UserError):
        c.with_options(page_size=0)


def test_tune_refuses_a_bad_quantization_before_loading_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tvm_llm.cli", "tune", str(tmp_path / "missing"),
                           "--quantization", "q3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("tvm-llm: error: unknown --quantization 'q3'")


def test_front_half_stops_where_asked_and_tune_sees_quantized_kernels(checkpoint):
    from tvm_llm.front import lower
    from tvm_llm.tune.buckets import parse_buckets
    from tvm_llm.tune.tuner import kernel_tasks

    config = BuildConfig.create(quantization="q8_0", activations="float", max_batch_size=4,
                                prefill_chunk_size=64)
    loaded = lower(checkpoint("llama"), config, "load", log=lambda *a: None)
    assert loaded.model is not None and loaded.imported is None and loaded.mod is None
    lowered = lower(checkpoint("llama"), config, "lowering", log=lambda *a: None)
    assert [p["phase"] for p in lowered.phases] == ["import_cleanup", "fusion", "folding",
                                                    "lowering"]
    assert lowered.quantization["quantized"]  # the report comes back as a field
    assert not any("quantization" in p for p in lowered.phases)
    tasks = kernel_tasks(lowered.mod, config.spec, parse_buckets(["decode:b=1"]),
                         log=lambda *a: None)
    assert any("q8_0" in t.name for t in tasks), [t.name for t in tasks]
