"""What a build is asked for, parsed and checked once: `BuildConfig`.

    config = BuildConfig.create(target="llvm", dtype="float16", quantization="q4")
    config = BuildConfig.recommended(quantization="q4")  # q8 / q4 as `tvm-llm build` means them
    config = BuildConfig.from_args(args)          # the CLI: the same checks, argparse's names

`build`, `plan`, `tune`, `verify` and `sensitivity` take one; the front half (front.py) reads
everything it needs from it. Every bad value is a UserError naming the option and the fix, raised
here before any checkpoint is read. The fields the user gave are kept as given (the memory plan
needs to know which of context window / KV tokens were asked for); what is derived from them
(the target spec, the default dtype, the quantization scheme, the memory budget) is resolved here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .errors import UserError

DTYPES = ("float32", "float16", "bfloat16")
# the KV cache of q8 / q4 on the command line in a float32 build (BuildConfig.recommended,
# from_args): float16, as llama.cpp's default cache. Attention reads half the bytes: on
# llama-110m q4 (AMD EPYC znver4, 2 threads) a decode step's 12 attention calls took 0.39 ->
# 0.23 ms in all at 128 cached tokens, 1.20 -> 0.60 ms at 512; SmolLM2-135M perplexity moved
# +0.003% (fp32), +0.04% (q8), +0.12% (q4) (README "KV cache dtype"). Exact format names keep
# the build dtype.
RECOMMENDED_KV_DTYPE = {"q8": "float16", "q4": "float16"}
MAX_TOKENS = 2**31  # TVM's KV cache indexes tokens with int32


@dataclass(frozen=True)
class BuildConfig:
    # target
    target: str = "llvm"
    arch: str | None = None
    dtype: str | None = None  # None: the target's default (resolved by create)
    kv_dtype: str | None = None  # the KV cache's as given; None: the build dtype (cache_dtype)
    # KV cache and batching (context_window / kv_cache_tokens None: not asked for)
    context_window: int | None = None
    max_batch_size: int = 8
    prefill_chunk_size: int = 512
    page_size: int = 16
    kv_cache_tokens: int | None = None
    max_memory: object = None  # "4GB", "50%", 0.5 ... (memory.kv_budget.parse_budget)
    # kernels
    tuning_log: str | None = None
    # quantization (quantization/scheme.py) and its calibration (quantization/calibration.py)
    quantization: str | None = None
    group_size: int = 32
    activations: str | None = None
    keep_float: object = None
    quant_plan: object = None  # a quantization.plan.QuantPlan replacing the plain one
    calibration: str | None = None
    calibrate: str | None = None
    bits_per_weight: float | None = None
    bits_count: str = "body"
    # resolved by create(), not given
    spec: object = field(default=None, compare=False)  # targets.TargetSpec of target, arch
    scheme: object = None  # quantization.scheme.QuantScheme or None (float build)
    budget: object = None  # memory.kv_budget.Budget or None

    @classmethod
    def create(cls, **options) -> "BuildConfig":
        """The one constructor: checks every option, resolves the target, dtype, scheme and
        budget. Unknown option names are a TypeError (a programming error, not user input)."""
        names = {f.name for f in fields(cls)} - _RESOLVED
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown build option(s): {', '.join(unknown)}")
        return cls(**options)._resolved()

    @classmethod
    def from_args(cls, args, **overrides) -> "BuildConfig":
        """From an argparse namespace: the options its command defines (others keep their
        defaults). `tvm-llm build` (a command with --calibrate) reads them as `recommended`
        does; the other commands as `create` does."""
        names = {f.name for f in fields(cls)} - _RESOLVED
        options = {n: getattr(args, n) for n in names if hasattr(args, n)}
        options.update(overrides)
        if hasattr(args, "calibrate"):
            return cls.recommended(**options)
        return _recommended_kv_dtype(cls.create(**options), options)  # plan, tune: as build

    @classmethod
    def recommended(cls, **options) -> "BuildConfig":
        """`options` as `tvm-llm build --quantization q8|q4` means them: without calibration
        options, our best recipe (quantization.calibration.CLI_DEFAULTS: q4 the automatic mix
        under 4.6 stored bits, q8 AWQ-scaled); `calibrate="none"` keeps them plain, as
        `create` (the API's plain q8 / q4) does. A float32 q8 / q4 build also gets a float16
        KV cache unless `kv_dtype` is given (RECOMMENDED_KV_DTYPE), calibrated or not."""
        defaulted = []
        if options.get("calibrate") != "none" and options.get("calibration") is None \
                and options.get("bits_per_weight") is None:
            from .quantization.calibration import CLI_DEFAULTS

            for key, value in CLI_DEFAULTS.get(options.get("quantization"), {}).items():
                if options.get(key) is None:
                    options[key] = value
                    defaulted.append(key)
        config = _recommended_kv_dtype(cls.create(**options), options)
        if "bits_per_weight" in defaulted and config.scheme is not None:
            from .quantization.calibration import layout_budget

            budget = layout_budget(config.bits_per_weight, config.scheme.format, config.scheme.activations)
            if budget != config.bits_per_weight:  # weight-only: its layout's stored bits
                config = config.with_options(bits_per_weight=budget)
        return config

    def options(self) -> dict:
        """The options as given (every field but the resolved ones), by name: what `create`
        takes to make this configuration again."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _RESOLVED}

    def with_options(self, **options) -> "BuildConfig":
        """This configuration with some options changed, checked again (a new target without
        a dtype gets that target's default dtype)."""
        given = self.options()
        given.update(options)
        if ("target" in options or "arch" in options) and "dtype" not in options:
            given["dtype"] = None
        return BuildConfig.create(**given)

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype: kv_dtype when given, else the build dtype (kept unresolved, so
        that a new dtype or target through with_options moves the cache with it)."""
        return self.kv_dtype or self.dtype

    @property
    def calibrating(self) -> bool:
        return bool(self.calibration or self.calibrate or self.bits_per_weight is not None)

    def default_context(self, max_position_embeddings: int | None) -> int:
        """The context window the module is imported for: the one asked for, else
        min(max_position_embeddings, 2048). UserError when it exceeds the model's."""
        from .memory.planner import default_context

        return default_context(self.context_window, max_position_embeddings)

    def _resolved(self) -> "BuildConfig":
        from .memory import kv_budget, planner
        from .quantization import parse_scheme
        from .quantization.plan import INTEGER_ACTIVATIONS
        from .targets import get_target

        spec = get_target(self.target, arch=self.arch)
        dtype = self.dtype or spec.default_dtype
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.kv_dtype is not None and self.kv_dtype not in DTYPES:
            raise UserError(f"unknown --kv-dtype {self.kv_dtype!r}: choose one of {', '.join(DTYPES)}")
        for name in ("max_batch_size", "prefill_chunk_size", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        for name in ("context_window", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value < MAX_TOKENS):
                raise UserError(f"{name} must be a positive integer below 2^31, got {value!r}")
        spec.check_page_size(self.page_size)
        scheme = parse_scheme(self.quantization, self.group_size, self.activations,
                              self.keep_float, int8_dot=spec.supports_int8_dot(),
                              plan=self.quant_plan)
        if scheme is not None and scheme.activations in INTEGER_ACTIVATIONS and not spec.supports_int8_dot():
            raise UserError(f"--activations {scheme.activations} needs int8 dot-product instructions; "
                            f"target {spec.describe()} has none (use weight-only --quantization)")
        if scheme is None and self.calibrating:
            raise UserError("--calibration/--calibrate/--bits-per-weight need --quantization")
        if self.bits_count not in ("all", "body"):
            raise UserError(f"--bits-count must be all or body, got {self.bits_count!r}")
        budget = None if self.max_memory is None else kv_budget.parse_budget(
            self.max_memory, lambda: kv_budget.device_memory_bytes(spec.device_type))
        planner.check_options(budget, self.kv_cache_tokens)
        return replace(self, dtype=dtype, spec=spec, scheme=scheme, budget=budget)


_RESOLVED = {"spec", "scheme", "budget"}


def _recommended_kv_dtype(config: BuildConfig, options: dict) -> BuildConfig:
    """`config` with RECOMMENDED_KV_DTYPE's cache when `options` name q8 / q4 in a float32
    build and no kv_dtype: what the command line's build, plan and tune mean by them."""
    q = options.get("quantization")
    if options.get("kv_dtype") is None and q in RECOMMENDED_KV_DTYPE and config.dtype == "float32":
        return config.with_options(kv_dtype=RECOMMENDED_KV_DTYPE[q])
    return config
