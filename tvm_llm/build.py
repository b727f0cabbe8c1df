"""The build, in order: import -> passes -> plan -> schedule -> codegen -> export.

`build()` writes the output directory atomically: everything goes into a temporary sibling
directory that is renamed at the end, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

from . import __version__
from .errors import NonFiniteWarning, UserError
from .runtime import artifact, chat_template

DTYPES = ("float32", "float16", "bfloat16")


def _check_output(output_dir: str, force: bool) -> str:
    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and not force:
        raise UserError(f"{output_dir} already exists; pass --force (force=True) to replace it")
    parent = os.path.dirname(output_dir)
    if not os.path.isdir(parent):
        raise UserError(f"{parent}: parent directory of the output does not exist; create it first")
    return output_dir


TMP_PREFIXES = (".tvm-llm-build-", ".tvm-llm-old-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours
        return True
    return True


def remove_stale_temp_dirs(parent: str, started: float) -> list:
    """Remove the temporary directories that killed builds left in `parent`: ours only (our
    prefixes, with the pid of the build that made them), stale only (that process is gone and
    the directory is older than this build). Returns the removed paths."""
    removed = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for name in entries:
        prefix = next((p for p in TMP_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        path = os.path.join(parent, name)
        try:
            stale = (pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))
                     and os.path.isdir(path) and not os.path.islink(path)
                     and os.stat(path).st_mtime < started)
        except OSError:
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _tmp_prefix(kind: str) -> str:
    return f".tvm-llm-{kind}-{os.getpid()}-"


def _tokenizer_info(model_dir: str, config) -> dict:
    """eos ids and whether the runtime must prepend bos (what transformers' tokenizer does)."""
    eos = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    text_cfg = config.get_text_config()
    if eos is None:
        eos = getattr(text_cfg, "eos_token_id", None)
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    bos = getattr(text_cfg, "bos_token_id", None)
    add_bos = False
    try:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        sample = "Hello world"
        hf_ids = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)(sample)["input_ids"]
        raw_ids = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).encode(sample).ids
        add_bos = bos is not None and list(hf_ids) == [bos] + list(raw_ids)
    except Exception:  # a tokenizer transformers cannot load: use tokenizer.json as it is
        pass
    return {"eos_token_ids": eos_ids, "bos_token_id": bos, "add_bos": add_bos}


def build(model_dir: str, output_dir: str, target: str = "llvm", arch: str | None = None,
          dtype: str | None = None, force: bool = False, emit_source: bool = False,
          context_window: int | None = None, max_batch_size: int = 8,
          prefill_chunk_size: int = 512, page_size: int = 16, kv_cache_tokens: int | None = None,
          max_memory=None, dump_ir: str | None = None, disabled_phases=(), log=print,
          tuning_log: str | None = None, quantization: str | None = None, group_size: int = 32,
          activations: str | None = None, keep_float=None, quant_plan=None,
          calibration: str | None = None, calibrate: str | None = None,
          bits_per_weight: float | None = None, bits_count: str = "body") -> dict:
    """Compile the Hugging Face checkpoint in `model_dir` into `output_dir`; return the manifest.
    `tuning_log`: a MetaSchedule log directory (tvm-llm tune) whose kernels replace our
    default schedules; bad or foreign records are warned about and skipped.
    `quantization` a weight format name (q8_0, q4_0, q4_1, q4_k) or q8 / q4 (our best),
    `activations` "int8" / "float" (unset: int8 for q8 / q4 where the target has int8 dot
    products), `keep_float`: layer indices / weight-name globs left float, `quant_plan`: a
    quantization.plan.QuantPlan (per-weight formats, importance) replacing the plain one
    (see tvm_llm/quantization/scheme.py). `calibration` (a text file; None = the bundled one),
    `calibrate` ("awq,importance" / "none") and `bits_per_weight` (the automatic mix's budget,
    counted over `bits_count` "all" or "body") calibrate the quantization on the float model
    before export (tvm_llm/quantization/calibration.py); calibration runs when any is given."""
    from .quantization import parse_scheme
    from .frontend import import_model, load_model, nonfinite_weights, read_config, tokenizer_files
    from .passes.pipeline import run_pipeline
    from .report import BuildClock, format_build_time
    from .targets import get_target

    t_start = time.perf_counter()
    clock = BuildClock()  # per-step wall time for the report
    started = time.time()
    spec = get_target(target, arch=arch)
    dtype = dtype or spec.default_dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    for name, value in (("max_batch_size", max_batch_size), ("prefill_chunk_size", prefill_chunk_size),
                        ("page_size", page_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("context_window", context_window), ("kv_cache_tokens", kv_cache_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value < 2**31):
            raise UserError(f"{name} must be a positive integer below 2^31, got {value!r}")
    spec.check_page_size(page_size)
    scheme = parse_scheme(quantization, group_size, activations, keep_float,
                          int8_dot=spec.supports_int8_dot(), plan=quant_plan)
    if scheme is not None and scheme.activations == "int8" and not spec.supports_int8_dot():
        raise UserError(f"--activations int8 needs int8 dot-product instructions; target "
                        f"{spec.describe()} has none (use weight-only --quantization)")
    output_dir = _check_output(output_dir, force)
    tvm_target = spec.tvm_target()
    clock.lap("start-up (imports, target)")

    config = read_config(model_dir)
    text_cfg = config.get_text_config()
    tok_files = tokenizer_files(model_dir, getattr(text_cfg, "vocab_size", None))
    max_pos = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
    from .memory import kv_budget, planner

    # the memory plan needs what the user asked for, before defaults fill it in
    asked = {"context_window": context_window, "kv_cache_tokens": kv_cache_tokens}
    budget = None if max_memory is None else kv_budget.parse_budget(
        max_memory, lambda: kv_budget.device_memory_bytes(spec.device_type))
    planner.check_options(budget, kv_cache_tokens)
    if context_window is None:
        context_window = min(max_pos or 2048, 2048)
    if max_pos and context_window > max_pos:
        raise UserError(f"--context-window {context_window} exceeds the model's "
                        f"max_position_embeddings ({max_pos})")
    kv_cache_tokens = kv_cache_tokens or max(context_window, 4096)

    log(f"[tvm-llm] loading {model_dir} ({config.model_type}, {dtype})")
    model = load_model(model_dir, config, dtype)
    clock.lap("load checkpoint")
    nonfinite = nonfinite_weights(model)
    clock.lap("check weights are finite")
    if nonfinite:
        import warnings

        more = f" (and {len(nonfinite) - 1} more)" if len(nonfinite) > 1 else ""
        warnings.warn(NonFiniteWarning(
            f"{model_dir}: weight {nonfinite[0]}{more} holds NaN or Inf; the build's outputs "
            "will not be finite (re-download or fix the checkpoint)"), stacklevel=2)
    calib_report = None
    if scheme is not None and (calibration or calibrate or bits_per_weight is not None):
        from .quantization.calibration import calibrate_for_build

        scheme, calib_report = calibrate_for_build(model, model_dir, scheme, calibration, calibrate,
                                                   bits_per_weight, bits_count, log=log)
    elif calibration or calibrate or bits_per_weight is not None:
        raise UserError("--calibration/--calibrate/--bits-per-weight need --quantization")
    clock.lap("calibrate")
    if scheme is None:  # quantized weights are sized by the plan, after the passes
        planner.check_weights_fit(budget, sum(p.numel() for p in model.parameters())
                                  * kv_budget.dtype_bytes(dtype), spec.device_type)
    log("[tvm-llm] tracing with torch.export and importing into Relax")
    t0 = time.perf_counter()
    imported = import_model(model, dtype=dtype, context_window=context_window,
                            max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                            target=spec, page_size=page_size)
    del model
    t_import = time.perf_counter() - t0
    clock.lap("trace + import (torch.export)")

    log(f"[tvm-llm] compiling for {spec.name} ({spec.hw_key()})")
    t0 = time.perf_counter()
    mod, weight_transforms, report = run_pipeline(imported.mod, spec, dump_dir=dump_ir,
                                                 disabled=frozenset(disabled_phases),
                                                 tuning_log=tuning_log, quantization=scheme,
                                                 checkpoint_names=imported.relax_names)
    tuning = next((ph.pop("tuning") for ph in report if "tuning" in ph), None)
    quant_report = next((ph.pop("quantization") for ph in report if "quantization" in ph), None)
    if scheme is not None:
        from .quantization.report import summarize

        quant_report = {**scheme.describe(), **(quant_report or {}),
                        **({"calibration": calib_report} if calib_report else {})}
        quant_report.update(summarize(quant_report))
        log(f"[tvm-llm] quantized {len(quant_report.get('quantized', {}))} weights "
            f"({', '.join(f'{k}: {v}' for k, v in quant_report['format_counts'].items())}), "
            f"{quant_report['bits_per_weight']:.3f} bits per weight, activations "
            f"{scheme.activations}; kept {len(quant_report.get('kept_float', {}))} float")
    if tuning is not None:
        from .report import format_tuning

        log(format_tuning(tuning))
    import tvm

    from .passes.fold_weights import apply_weight_transform, weight_param_names

    clock.lap("passes (quantize, fuse, schedule)")

    weights = imported.params
    for transform in weight_transforms:  # folded graph work, then packing for the kernels
        weights = apply_weight_transform(transform, weights)
    names = (weight_param_names(mod, imported.relax_names) if weight_transforms
             else imported.param_names)
    clock.lap("weight transform (fold, pack)")

    attn = imported.attention
    memory = planner.plan_memory(
        mod, vocab_size=imported.vocab_size, num_layers=attn.num_layers, num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, v_head_dim=attn.v_head_dim,
        dtype=dtype, device_type=spec.device_type, budget=budget, max_batch_size=max_batch_size,
        prefill_chunk_size=prefill_chunk_size, page_size=page_size,
        max_position_embeddings=max_pos, **asked, **planner.sliding_of(attn))
    from .report import format_memory

    log(format_memory(memory.to_dict()))
    planner.check_fits_machine(memory, spec.device_type)
    context_window, kv_cache_tokens = memory.context_window, memory.kv.max_total_seq_len
    clock.lap("memory plan")

    with tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
        executable = tvm.compile(mod, target=tvm_target, relax_pipeline=None,
                                 tir_pipeline=spec.tir_pipeline() or "default")
    t_compile = time.perf_counter() - t0
    clock.lap("codegen (tvm.compile)")

    remove_stale_temp_dirs(os.path.dirname(output_dir), started)
    tmp = tempfile.mkdtemp(prefix=_tmp_prefix("build"), dir=os.path.dirname(output_dir))
    try:
        objects = os.path.join(tmp, ".objects")  # object files: inside our own temp dir
        os.mkdir(objects)
        spec.export_library(executable, os.path.join(tmp, artifact.LIBRARY), workspace_dir=objects)
        shutil.rmtree(objects)
        clock.lap("export library (compile, link)")
        table = artifact.save_weights(os.path.join(tmp, artifact.WEIGHTS), names, weights)
        clock.lap("save weights")
        for name in tok_files:
            shutil.copy(os.path.join(model_dir, name), os.path.join(tmp, name))
        template = chat_template.find(model_dir)  # rendered by `serve` and `generate --chat`
        if template is not None:
            with open(os.path.join(tmp, chat_template.FILE), "w", encoding="utf-8") as f:
                f.write(template)
        sources = spec.emit_source(executable, os.path.join(tmp, "source")) if emit_source else []
        attn = imported.attention
        clock.lap("tokenizer, sources")
        manifest = {
            "tvm_llm_version": __version__,
            "model": {"model_type": config.model_type,
                      "architectures": list(getattr(config, "architectures", None) or []),
                      "vocab_size": imported.vocab_size, "num_layers": attn.num_layers,
                      "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
                      "head_dim": attn.head_dim, "max_position_embeddings": max_pos,
                      "source": os.path.abspath(model_dir)},
            "dtype": dtype,
            "quantization": quant_report,
            "target": spec.describe(),
            "kv_cache": {"page_size": page_size, "max_batch_size": max_batch_size,
                         "max_total_seq_len": kv_cache_tokens,
                         "prefill_chunk_size": prefill_chunk_size,
                         "context_window": context_window,
                         # every layer slides with this window: sequences drop older pages
                         "sliding_window": attn.sliding_window},
            "memory": memory.to_dict(),
            "tokenizer": _tokenizer_info(model_dir, config),
            "nonfinite_weights": nonfinite,
            "params": table,
            "report": {"phases": report, "import_seconds": round(t_import, 2),
                       "compile_seconds": round(t_compile, 2),
                       "build_seconds": clock.seconds, "build_cpu_seconds": clock.cpu_seconds,
                       **({"tuning": tuning} if tuning is not None else {})},
            "sources": [os.path.relpath(p, tmp) for p in sources],
        }
        artifact.write_manifest(os.path.join(tmp, artifact.MANIFEST), manifest)
        if os.path.exists(output_dir):  # only reached with force=True
            old = tempfile.mkdtemp(prefix=_tmp_prefix("old"), dir=os.path.dirname(output_dir))
            os.rename(output_dir, os.path.join(old, "out"))
            os.rename(tmp, output_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(format_build_time(clock.seconds, clock.cpu_seconds))
    log(f"[tvm-llm] wrote {output_dir} in {time.perf_counter() - t_start:.1f}s")
    return manifest
