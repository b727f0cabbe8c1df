"""The build: the front half (front.py: load -> import -> passes), then plan -> codegen -> export.

`build()` writes the output directory atomically: everything goes into a temporary sibling
directory that is renamed at the end, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

from .config import BuildConfig
from .errors import UserError
from .runtime import artifact, chat_template
from .version import __version__


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


class _Cancelled(Exception):
    """The build failed elsewhere: WeightWriter stops between two weights."""


class WeightWriter:
    """Writes the transformed weights (an iterator that runs compiled code only:
    fold_weights.transform_weights) to `path` on a thread of its own, started at once;
    `result()` waits and returns artifact.save_weights' table or raises its error, `cancel()`
    stops it after the weight it is on and waits (the caller then removes the file).
    `seconds`: its wall time from start to end."""

    def __init__(self, path: str, names: list, weights):
        self._stop = threading.Event()
        self._table, self._error, self.seconds = None, None, 0.0
        self._thread = threading.Thread(target=self._run, args=(path, names, weights),
                                        name="tvm-llm-weights", daemon=True)
        self._thread.start()

    def _run(self, path, names, weights) -> None:
        t0 = time.perf_counter()
        try:
            self._table = artifact.save_weights(path, names, self._until_cancelled(weights))
        except BaseException as e:  # handed to the build's thread by result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def _until_cancelled(self, weights):
        for w in weights:
            if self._stop.is_set():
                raise _Cancelled
            yield w

    def result(self) -> list:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._table

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()


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


def build(model_dir: str, output_dir: str, config: BuildConfig | None = None, *,
          force: bool = False, emit_source: bool = False, dump_ir: str | None = None,
          disabled_phases=(), log=print, **options) -> dict:
    """Compile the Hugging Face checkpoint in `model_dir` into `output_dir`; return the manifest.
    `config`: a BuildConfig (tvm_llm/config.py: target, dtype, KV cache, memory budget, tuning
    log, quantization and calibration); `options`: its fields by name, overriding `config`'s
    (`build(ck, out, target="cuda", quantization="q4")`). `force` replaces an existing
    `output_dir`, `emit_source` also writes the generated code, `dump_ir` the IR after each
    phase, `disabled_phases` leaves phases empty (the ablation benchmark)."""
    from .quantization import prequantize

    try:
        return _build(model_dir, output_dir, config, force=force, emit_source=emit_source,
                      dump_ir=dump_ir, disabled_phases=disabled_phases, log=log, **options)
    finally:  # whatever happened: no background quantization outlives the build
        prequantize.stop()


def _build(model_dir: str, output_dir: str, config: BuildConfig | None, *, force: bool,
           emit_source: bool, dump_ir: str | None, disabled_phases, log, **options) -> dict:
    from .front import lower, plan_memory, read_checkpoint
    from .frontend import tokenizer_files
    from .report import BuildClock, format_build_time, format_memory

    t_start = time.perf_counter()
    clock = BuildClock()  # per-step wall time for the report
    started = time.time()
    if config is None:
        config = BuildConfig.create(**options)
    elif options:
        config = config.with_options(**options)
    spec, dtype = config.spec, config.dtype
    output_dir = _check_output(output_dir, force)
    tvm_target = spec.tvm_target()
    clock.lap("start-up (imports, target)")

    checkpoint = read_checkpoint(model_dir)
    tok_files = tokenizer_files(model_dir, getattr(checkpoint.text_config, "vocab_size", None))
    from .quantization import prequantize

    # weights are quantized in a background thread from calibration on (prequantize.py), beside
    # the single-threaded trace, passes, codegen and export; the weight transform runs beside
    # codegen and export (WeightWriter)
    lowered = lower(checkpoint, config, "finalize", log=log, dump_ir=dump_ir,
                    disabled_phases=disabled_phases, clock=clock, prequantize=True)
    clock.lap("passes (quantize, fuse, schedule)")
    quant_report, tuning = lowered.quantization, lowered.tuning
    if quant_report is not None:
        log(f"[tvm-llm] quantized {len(quant_report.get('quantized', {}))} weights "
            f"({', '.join(f'{k}: {v}' for k, v in quant_report['format_counts'].items())}), "
            f"{quant_report['bits_per_weight']:.3f} bits per weight, activations "
            f"{lowered.scheme.activations}; kept {len(quant_report.get('kept_float', {}))} float")
    if tuning is not None:
        from .report import format_tuning

        log(format_tuning(tuning))
    import tvm

    memory = plan_memory(lowered)
    log(format_memory(memory.to_dict()))
    context_window, kv_cache_tokens = memory.context_window, memory.kv.max_total_seq_len
    clock.lap("memory plan")

    imported, hf_config = lowered.imported, checkpoint.config
    remove_stale_temp_dirs(os.path.dirname(output_dir), started)
    tmp = tempfile.mkdtemp(prefix=_tmp_prefix("build"), dir=os.path.dirname(output_dir))
    writer = None
    try:
        # the weight transform is compiled here; a second thread computes it chunk by chunk
        # and writes weights.bin while this one generates and links the code (each mostly one
        # core's work; llama-1b on a 2-core AMD EPYC: 3-8 s less wall time, README "Build time")
        names, weights = lowered.weights()
        from .quantization.kernels import prepare_quantizers

        prepare_quantizers()  # the writer's quantize calls compile nothing
        clock.lap("weight transform (compile)")
        writer = WeightWriter(os.path.join(tmp, artifact.WEIGHTS), names, weights)
        t0 = time.perf_counter()
        with tvm.transform.PassContext(opt_level=3, config=spec.pass_context_config()):
            executable = tvm.compile(lowered.mod, target=tvm_target, relax_pipeline=None,
                                     tir_pipeline=spec.tir_pipeline() or "default")
        t_compile = lowered.pipeline_seconds + time.perf_counter() - t0
        clock.lap("codegen (tvm.compile)")
        objects = os.path.join(tmp, ".objects")  # object files: inside our own temp dir
        os.mkdir(objects)
        spec.export_library(executable, os.path.join(tmp, artifact.LIBRARY), workspace_dir=objects)
        shutil.rmtree(objects)
        clock.lap("export library (compile, link)")
        table = writer.result()
        log(f"[tvm-llm] weight transform + save: {writer.seconds:.1f}s beside codegen and export")
        early = prequantize.counts()
        if early["queued"]:
            log(f"[tvm-llm] {early['taken']} of {early['queued']} quantized weights came from "
                "the quantizer run beside trace, passes and codegen")
        prequantize.stop()
        clock.lap("weight transform + save (after export)")
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
            "model": {"model_type": hf_config.model_type,
                      "architectures": list(getattr(hf_config, "architectures", None) or []),
                      "vocab_size": imported.vocab_size, "num_layers": attn.num_layers,
                      "num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
                      "head_dim": attn.head_dim,
                      "max_position_embeddings": checkpoint.max_position_embeddings,
                      "source": os.path.abspath(model_dir)},
            "dtype": dtype,
            "quantization": quant_report,
            "target": spec.describe(),
            "kv_cache": {"dtype": config.cache_dtype,
                         "page_size": config.page_size, "max_batch_size": config.max_batch_size,
                         "max_total_seq_len": kv_cache_tokens,
                         "prefill_chunk_size": config.prefill_chunk_size,
                         "context_window": context_window,
                         # every layer slides with this window: sequences drop older pages
                         "sliding_window": attn.sliding_window},
            "memory": memory.to_dict(),
            "tokenizer": _tokenizer_info(model_dir, hf_config),
            "nonfinite_weights": lowered.nonfinite,
            "params": table,
            "report": {"phases": lowered.phases, "import_seconds": round(lowered.import_seconds, 2),
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
        if writer is not None:
            writer.cancel()  # stops after the chunk it is on: then the directory can go
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(format_build_time(clock.seconds, clock.cpu_seconds))
    log(f"[tvm-llm] wrote {output_dir} in {time.perf_counter() - t_start:.1f}s")
    return manifest
