"""The front half every command shares: checkpoint -> transformers model -> Relax -> passes.

    lowered = lower("path/to/hf_checkpoint", BuildConfig.create(quantization="q4"), until="finalize")
    plan = plan_memory(lowered)          # the memory plan of the finalized module

`lower` reads the checkpoint's config, picks the context window, loads the weights, checks them,
calibrates the quantization (when asked), traces and imports the model, and runs the pass
pipeline (passes/pipeline.py) up to the named stage `until`:

    "load"      the transformers model only (verify, sensitivity)
    "import"    the imported Relax module, no pass run
    a phase     of passes.pipeline.PHASES: "lowering" (tune extracts its kernels there),
                "finalize" (plan, build: the static memory plan is made in that phase)

Everything it learned comes back in the `Lowered` it returns (module, weights, phase report,
quantization and tuning reports, timings); nothing is written anywhere.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

from .config import BuildConfig
from .errors import NonFiniteWarning
from .passes.pipeline import PHASES

STAGES = ("load", "import") + PHASES


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory's validated transformers config and what the front half needs
    from it."""

    model_dir: str
    config: object  # transformers PretrainedConfig
    max_position_embeddings: int | None

    @property
    def text_config(self):
        return self.config.get_text_config()


def read_checkpoint(model_dir: str) -> Checkpoint:
    """UserError when `model_dir` is not a checkpoint directory we can read."""
    from .frontend import read_config

    config = read_config(model_dir)
    text = config.get_text_config()
    max_pos = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return Checkpoint(model_dir, config, max_pos)


@dataclass
class Lowered:
    """What `lower` produced, up to the stage it stopped at (later fields stay None)."""

    checkpoint: Checkpoint
    config: BuildConfig
    until: str
    context_window: int  # the window the module is imported for (the plan may lower it)
    scheme: object = None  # the QuantScheme after calibration (None: float)
    model: object = None  # the transformers model: kept only when until == "load"
    nonfinite: list = field(default_factory=list)  # weight names holding NaN / Inf
    calibration: dict | None = None  # calibration report
    imported: object = None  # frontend.ImportedModel (its module is the imported one)
    mod: object = None  # the module after the last phase run
    weight_transforms: list = field(default_factory=list)  # lifted weight work, in order
    phases: list = field(default_factory=list)  # the pipeline's per-phase report
    quantization: dict | None = None  # what was quantized (scheme, formats, bits per weight)
    tuning: dict | None = None  # what the tuning log gave
    import_seconds: float = 0.0
    pipeline_seconds: float = 0.0

    def weights(self):
        """(names, numpy arrays) of the weights the compiled module takes: the checkpoint's,
        passed through the lifted weight transforms (folding, then packing for the kernels).
        The arrays come as an iterator, computed a chunk at a time as it is consumed
        (fold_weights.transform_weights): write each and drop it, and the build holds only a
        chunk of transformed weights at once."""
        from .passes.fold_weights import transform_weights, weight_param_names

        names = (weight_param_names(self.mod, self.imported.relax_names) if self.weight_transforms
                 else self.imported.param_names)
        return names, transform_weights(self.weight_transforms, self.imported.params)


def lower(checkpoint, config: BuildConfig, until: str = "finalize", *, log=print,
          dump_ir: str | None = None, disabled_phases=(), clock=None,
          prequantize: bool = False) -> Lowered:
    """Take the checkpoint (a directory or a Checkpoint) through the front half up to `until`
    (module docstring). `dump_ir`: write the IR after each phase there; `disabled_phases`:
    phases left empty (the ablation benchmark); `clock`: a report.BuildClock to charge the
    steps to; `prequantize`: start quantizing the plan's weights in a background thread right
    after calibration (quantization/prequantize.py), for a caller that will run the weight
    transform (Lowered.weights takes the results; the caller ends it with prequantize.stop)."""
    if until not in STAGES:
        raise ValueError(f"until must be one of {', '.join(STAGES)}, got {until!r}")
    from .frontend import import_model, load_model, nonfinite_weights
    from .memory import kv_budget, planner

    if not isinstance(checkpoint, Checkpoint):
        checkpoint = read_checkpoint(checkpoint)
    lap = clock.lap if clock is not None else (lambda _name: None)
    spec, dtype, scheme = config.spec, config.dtype, config.scheme
    context_window = config.default_context(checkpoint.max_position_embeddings)
    out = Lowered(checkpoint, config, until, context_window, scheme)

    log(f"[tvm-llm] loading {checkpoint.model_dir} ({checkpoint.config.model_type}, {dtype})")
    model = load_model(checkpoint.model_dir, checkpoint.config, dtype)
    lap("load checkpoint")
    if until == "load":
        out.model = model
        return out
    out.nonfinite = nonfinite_weights(model)
    lap("check weights are finite")
    if out.nonfinite:
        more = f" (and {len(out.nonfinite) - 1} more)" if len(out.nonfinite) > 1 else ""
        warnings.warn(NonFiniteWarning(
            f"{checkpoint.model_dir}: weight {out.nonfinite[0]}{more} holds NaN or Inf; the "
            "build's outputs will not be finite (re-download or fix the checkpoint)"), stacklevel=3)
    if scheme is not None and config.calibrating:
        from .quantization.calibration import calibrate_for_build

        out.scheme, out.calibration = calibrate_for_build(
            model, checkpoint.model_dir, scheme, config.calibration, config.calibrate,
            config.bits_per_weight, config.bits_count, log=log)
    lap("calibrate")
    if prequantize and until == "finalize" and getattr(out.scheme, "plan", None) is not None:
        from .quantization import prequantize as early

        early.start(model, out.scheme)
    if scheme is None:  # quantized weights are sized by the plan, after the passes
        planner.check_weights_fit(config.budget, sum(p.numel() for p in model.parameters())
                                  * kv_budget.dtype_bytes(dtype), spec.device_type)
    log("[tvm-llm] tracing with torch.export and importing into Relax")
    t0 = time.perf_counter()
    out.imported = import_model(model, dtype=dtype, context_window=context_window,
                                max_batch_size=config.max_batch_size,
                                prefill_chunk_size=config.prefill_chunk_size,
                                target=spec, page_size=config.page_size,
                                kv_dtype=config.cache_dtype)
    del model
    out.import_seconds = time.perf_counter() - t0
    out.mod = out.imported.mod
    lap("trace + import (torch.export)")
    if until == "import":
        return out

    from .passes.pipeline import run_pipeline

    log(f"[tvm-llm] compiling for {spec.name} ({spec.hw_key()})"
        + ("" if until == "finalize" else f", passes up to {until}"))
    t0 = time.perf_counter()
    out.mod, out.weight_transforms, out.phases = run_pipeline(
        out.imported.mod, spec, dump_dir=dump_ir, disabled=frozenset(disabled_phases),
        tuning_log=config.tuning_log, stop_after=None if until == "finalize" else until,
        quantization=out.scheme, checkpoint_names=out.imported.relax_names)
    out.pipeline_seconds = time.perf_counter() - t0
    # the pipeline reports these inside its phases; they come back here as fields
    out.tuning = next((ph.pop("tuning") for ph in out.phases if "tuning" in ph), None)
    quantized = next((ph.pop("quantization") for ph in out.phases if "quantization" in ph), None)
    if out.scheme is not None:
        from .quantization.report import summarize

        out.quantization = {**out.scheme.describe(), **(quantized or {}),
                            **({"calibration": out.calibration} if out.calibration else {})}
        out.quantization.update(summarize(out.quantization))
    return out


def plan_memory(lowered: Lowered):
    """The memory plan (memory.planner.MemoryPlan) of a module lowered through "finalize",
    with the options the user asked for; UserError when it cannot fit the machine."""
    from .memory import planner

    if lowered.until != "finalize":
        raise ValueError("plan_memory needs a module lowered through 'finalize' (the static "
                         f"memory plan), not {lowered.until!r}")
    config, attn = lowered.config, lowered.imported.attention
    windows = [v[0] for v in getattr(attn, "variants", {}).values() if v[0]]
    plan = planner.plan_memory(
        lowered.mod, vocab_size=lowered.imported.vocab_size, num_layers=attn.num_layers,
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        v_head_dim=attn.v_head_dim, dtype=config.dtype, kv_dtype=config.cache_dtype,
        device_type=config.spec.device_type,
        budget=config.budget, context_window=config.context_window,
        kv_cache_tokens=config.kv_cache_tokens, max_batch_size=config.max_batch_size,
        prefill_chunk_size=config.prefill_chunk_size, page_size=config.page_size,
        max_position_embeddings=lowered.checkpoint.max_position_embeddings,
        sliding_window=getattr(attn, "sliding_window", 0), sliding_layers=len(windows))
    planner.check_fits_machine(plan, config.spec.device_type)
    return plan


def plan(checkpoint, config: BuildConfig, log=print):
    """`tvm-llm plan`: the memory plan without compiling a kernel (no tvm.compile): the
    passes run through the static memory plan. Quantization options size the weights as the
    build stores them."""
    return plan_memory(lower(checkpoint, config, "finalize", log=log))
