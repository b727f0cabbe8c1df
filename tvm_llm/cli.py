"""tvm-llm command line: parses arguments and calls the Python API (no logic of its own)."""
from __future__ import annotations

import argparse
import math
import os
import sys

from .errors import UserError

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def _build(args) -> None:
    from .build import build
    from .config import BuildConfig

    build(args.model_dir, args.output, BuildConfig.from_args(args), force=args.force,
          emit_source=args.emit_source, dump_ir=args.dump_ir)


def _tune(args) -> None:
    from .config import BuildConfig
    from .tune import tune

    tune(args.model_dir, BuildConfig.from_args(args), trials=args.trials, log_dir=args.log_dir,
         buckets=args.bucket, kernels=args.kernels, rpc_tracker=args.rpc_tracker,
         rpc_key=args.rpc_key, trials_per_batch=args.trials_per_batch,
         compare_generic=not args.no_rules_baseline, rule_grid=not args.no_rule_grid,
         log=lambda *a: print(*a, flush=True))


def _plan(args) -> None:
    import json

    from .config import BuildConfig
    from .front import plan
    from .report import format_memory

    memory = plan(args.model_dir, BuildConfig.from_args(args),
                  log=(lambda *a: print(*a, file=sys.stderr)))
    print(json.dumps(memory.to_dict(), indent=2) if args.json else format_memory(memory.to_dict()))


def _generate(args) -> None:
    from .runtime.engine import Engine

    engine = Engine(args.output_dir, num_threads=args.threads)
    prompts = args.prompt or ["The "]
    shown = prompts
    if getattr(args, "chat", False):  # each prompt: one user message through the chat template
        from .runtime import chat_template

        template = chat_template.load(args.output_dir)
        if template is None:
            raise UserError(chat_template.no_template_message(args.output_dir))
        prompts = [chat_template.encode(engine, template.render([{"role": "user", "content": p}]))
                   for p in prompts]
        shown = [""] * len(prompts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                  stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos)
    if len(prompts) == 1:  # stream the text as it is produced
        sys.stdout.write(shown[0])
        for _, piece in engine.stream(prompts, **kwargs):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return
    for i, text in enumerate(engine.generate(prompts, **kwargs)):
        print(f"--- [{i}] {shown[i]}{text}")


def _serve(args) -> None:
    from .serve.app import serve

    serve(args.output_dir, host=args.host, port=args.port, api_key=args.api_key,
          max_batch_size=args.max_batch_size, threads=args.threads, max_waiting=args.max_waiting,
          model_name=args.model_name, step_prefill_tokens=args.step_prefill_tokens,
          step_prefill_ratio=args.step_prefill_ratio, mixed_steps=not args.no_mixed_steps,
          log=lambda *a: print(*a, flush=True))


def _verify(args) -> int:
    from .verify import verify

    report = verify(args.output_dir, reference=args.reference, prompts=args.prompt,
                    min_cosine=args.min_cosine, min_top1=args.min_top1, num_threads=args.threads)
    print(report.format())
    return 1 if report.flagged else 0


def _perplexity(args) -> None:
    from .perplexity import engine_perplexity, read_text
    from .runtime.engine import Engine

    text = read_text(args.text)
    engine = Engine(args.output_dir, num_threads=args.threads)
    r = engine_perplexity(engine, text, window=args.window, max_windows=args.max_windows)
    if not math.isfinite(r["perplexity"]):
        raise UserError(f"{args.output_dir}: perplexity is {r['perplexity']}: the model's logits "
                        "are not finite (NaN/Inf weights? run `tvm-llm verify`)")
    q = engine.manifest.get("quantization") or {}
    label = q.get("tag", engine.manifest.get("dtype", "float32"))
    print(f"{args.output_dir} ({label}): perplexity {r['perplexity']:.3f} over {r['tokens']} "
          f"tokens ({r['windows']} windows of {args.window})")


def _sensitivity(args) -> None:
    from .config import BuildConfig
    from .perplexity import read_text
    from .quantization.sensitivity import sensitivity

    # weight-only unless --activations int8 is asked for, whatever the CPU has
    scheme = BuildConfig.from_args(args, activations=args.activations or "float").scheme
    report = sensitivity(args.model_dir, scheme, read_text(args.text), window=args.window,
                         max_windows=args.max_windows,
                         log=lambda *a: print(*a, file=sys.stderr, flush=True))
    print(report.format())


def _inspect(args) -> None:
    from .report import format_manifest
    from .runtime.artifact import read_manifest

    print(format_manifest(read_manifest(args.output_dir, load_check=False)))


def _demo(args) -> None:
    out = args.output
    print(f"$ tvm-llm build {DEFAULT_MODEL_DIR} -o {out} --force")
    from .build import build

    build(DEFAULT_MODEL_DIR, out, force=True)
    for prompt in args.prompt or ["The for statement", "A class definition"]:
        print(f'$ tvm-llm generate {out} --prompt "{prompt}"')
        gen = argparse.Namespace(output_dir=out, prompt=[prompt], max_new_tokens=args.max_new_tokens,
                                 temperature=0.0, top_k=0, top_p=1.0, seed=None, stop_token_id=None,
                                 ignore_eos=False, threads=None)
        _generate(gen)


# ---- option values: every numeric option's type and range, checked here and nowhere else.
# A bad value is one line (`tvm-llm: error: argument --x: ...`) and exit code 2 (_Parser).
def _number(kind, lo=None, hi=None, lo_open=False, what=None):
    """An argparse type: `kind` (int or float) within [lo, hi] (lo excluded with lo_open);
    floats must be finite."""
    import math

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if (lo is not None and (value < lo or (lo_open and value == lo))) or \
                (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


MAX_INT = 1 << 31  # no count, size or id of ours is larger (TVM indexes with int32)
_positive_int = _number(int, 1, MAX_INT, what="a positive integer")
_non_negative_int = _number(int, 0, MAX_INT, what="an integer >= 0")
_temperature = _number(float, 0.0, 100.0, what="a temperature in [0, 100] (0 = greedy)")
_top_p = _number(float, 0.0, 1.0, lo_open=True, what="a probability in (0, 1]")
_cosine = _number(float, -1.0, 1.0, what="a cosine in [-1, 1]")
_fraction = _number(float, 0.0, 1.0, what="a fraction in [0, 1]")
_step_ratio = _number(float, 0.0, 100.0, lo_open=True, what="a ratio in (0, 100]")
_page_size = _number(int, 1, MAX_INT, what="a power of two from 8 to 128")
_bits_per_weight = _number(float, 1.0, 32.0, what="bits per weight in [1, 32]")
_port = _number(int, 0, 65535, what="a TCP port in [0, 65535]")


def _text_arg(text: str) -> str:
    """Text from the command line must be UTF-8 (a prompt, a path): Python hands undecodable
    bytes over as lone surrogates, which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8 ({ascii(text)[:60]}); pass UTF-8 "
                                         "text") from None
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one `tvm-llm: error:` line (no usage block) and exit
    code 2, like every other bad input."""

    def error(self, message):
        self.exit(2, f"tvm-llm: error: {message} (see `{self.prog} --help`)\n")


_MAX_MEMORY_HELP = ("memory budget for the running model: a size (4GB = 4e9 bytes, 4GiB or 4G = "
                    "4*2^30) or a fraction of the device memory (0.5, 50%%); the KV cache gets "
                    "what weights, activations and the runtime leave")


def _add_quantization_args(p, default=None) -> None:
    p.add_argument("--quantization", default=default, metavar="q8|q4|q8_0|q4_0|q4_1|q3_k|q4_k|q5_k|q6_k",
                   help="weight format of the linear layers (and 8-bit embedding table): q8 / q4 "
                        "our best 8 / 4-bit (q8_0 / q4_k, int8 activations where the CPU has "
                        "integer dot products: x86 with AVX2 or AVX-512), or exactly one format: "
                        "q8_0, q4_0, q4_1, q3_k, q4_k, q5_k, q6_k (README)")
    p.add_argument("--group-size", type=_positive_int, default=32,
                   help="weights per scale along the input dimension (32; every format uses 32)")
    p.add_argument("--activations", default=None, metavar="float|int8|int16",
                   help="int8: quantize each linear's input with one scale per 32 inputs and "
                        "multiply with integer dot products (AVX-512 VNNI; vpmaddubsw on AVX2 and "
                        "AVX-512 without VNNI); int16: the same at 16 bits per input (as two int8 "
                        "halves: float activations' accuracy, twice the dot products); float: "
                        "weight-only. Default on x86 CPUs with AVX2 or AVX-512: int8 for q8/q4, "
                        "int16 for exact format names; else float")


def _add_model_dir_arg(p) -> None:
    """The checkpoint a command compiles, plans, tunes or measures."""
    p.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face checkpoint directory")


def _add_output_dir_arg(p) -> None:
    """The build a command runs or inspects."""
    p.add_argument("output_dir", metavar="OUT", help="directory written by `tvm-llm build`")


def _add_threads_arg(p) -> None:
    """CPU threads of the runtime (generate, serve, verify, perplexity)."""
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads (default: all cores, or $TVM_NUM_THREADS)")


def _add_config_args(p, memory: bool) -> None:
    """The build configuration's flags (tvm_llm/config.py BuildConfig.from_args) that build,
    tune and plan share; `memory`: also the KV-cache capacity and memory budget (build, plan)."""
    p.add_argument("--target", default="llvm", help="llvm (CPU, default), cuda or rocm")
    p.add_argument("--arch", default=None,
                   help="llvm: host (default) or aarch64; cuda: sm_80, sm_90; rocm: gfx90a, gfx942")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), float16 (GPU default), bfloat16")
    p.add_argument("--kv-dtype", default=None,
                   help="the KV cache's dtype: float32, float16 or bfloat16 (default: --dtype); "
                        "float16 halves the cache's bytes, which attention reads every step")
    p.add_argument("--context-window", type=_positive_int, default=None,
                   help="longest sequence in tokens (default: min(max_position_embeddings, 2048)"
                        + (", bounded by --max-memory)" if memory else ")"))
    p.add_argument("--max-batch-size", type=_positive_int, default=8,
                   help="sequences decoded together (default 8)")
    p.add_argument("--prefill-chunk-size", type=_positive_int, default=512,
                   help="tokens per prefill call (default 512)")
    p.add_argument("--page-size", type=_page_size, default=16, help="KV cache page size in tokens")
    if memory:
        p.add_argument("--kv-cache-tokens", type=_positive_int, default=None,
                       help="KV cache capacity in tokens, all sequences together")
        p.add_argument("--max-memory", default=None, metavar="SIZE", help=_MAX_MEMORY_HELP)
    _add_quantization_args(p)
    p.add_argument("--keep-float", default=None, metavar="LAYERS",
                   help="comma list of what stays float under --quantization: decoder layer "
                        "indices (0,3) and/or weight-name globs (lm_head, *down_proj*); see "
                        "`tvm-llm sensitivity`")


def _add_text_args(p) -> None:
    p.add_argument("--text", default=None, metavar="FILE",
                   help="text to evaluate (default: the bundled model's heldout.txt)")
    p.add_argument("--window", type=_positive_int, default=256, help="tokens per window (default 256)")
    p.add_argument("--max-windows", type=_positive_int, default=None,
                   help="evaluate only the first N windows")


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tvm-llm", description=(
        "Compile a Hugging Face causal LM checkpoint into a native TVM module and run it."))
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("build", help="compile a checkpoint directory into an output directory",
                       description="Compile MODEL_DIR (config.json + *.safetensors + tokenizer.json) "
                                   "into OUT: model.so, weights.bin, manifest.json, tokenizer.")
    _add_model_dir_arg(b)
    b.add_argument("-o", "--output", required=True, metavar="OUT", help="output directory to create")
    _add_config_args(b, memory=True)
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    b.add_argument("--emit-source", action="store_true", help="also write generated code to OUT/source/")
    b.add_argument("--dump-ir", metavar="DIR", default=None, help="write the IR after each pass phase")
    b.add_argument("--tuning-log", default=None, metavar="DIR",
                   help="apply a `tvm-llm tune` log (DIR or DIR/<hw-key>); kernels without a "
                        "record keep our default schedules")
    b.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibrate the quantization on this text (default when calibrating: a "
                        "text bundled with tvm_llm, Python's pydoc topics)")
    b.add_argument("--calibrate", default=None, metavar="METHODS",
                   help="comma list: awq (activation-aware channel scaling, SmoothQuant-style "
                        "for int8 activations), importance (importance-weighted rounding), "
                        "or none (default when calibrating: awq)")
    b.add_argument("--bits-per-weight", type=_bits_per_weight, default=None, metavar="BITS",
                   help="automatic mix: raise the most sensitive linears (by a calibration "
                        "estimate) to 8 bits while the average stays within BITS")
    b.add_argument("--bits-count", default="body", choices=("all", "body"),
                   help="what --bits-per-weight averages over: the decoder layers' linears "
                        "(default; the LM head then gets 8 bits) or all linears incl. the LM "
                        "head (a tied embedding counted once); the report prints both")
    b.set_defaults(func=_build)

    t = sub.add_parser("tune", help="tune the model's kernels with MetaSchedule into a log",
                       description="Tune MODEL_DIR's kernels (after our fusion pipeline, at static "
                                   "shape buckets) with MetaSchedule and the XGBoost cost model; "
                                   "records are appended to LOG_DIR as they are measured, so an "
                                   "interrupted run resumes where it stopped.")
    _add_model_dir_arg(t)
    _add_config_args(t, memory=False)
    t.add_argument("--trials", type=_positive_int, default=32,
                   help="measured trials per kernel (default 32), counting those already in the log")
    t.add_argument("--log-dir", default=None, metavar="DIR",
                   help="MetaSchedule JSON database directory (default autotune_logs/<hw-key>)")
    t.add_argument("--bucket", action="append", metavar="FUNC:VAR=N",
                   help="static shape to tune, e.g. decode:b=1, prefill:n=128 (repeatable; "
                        "default decode:b=1, decode:b=4, prefill:n=32, prefill:n=128, prefill:n=512)")
    t.add_argument("--kernels", action="append", metavar="SUBSTR",
                   help="only kernels whose name contains SUBSTR (repeatable)")
    t.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                   help="measure on TVM RPC servers registered at this tracker")
    t.add_argument("--rpc-key", default=None, metavar="KEY", help="the RPC servers' key")
    t.add_argument("--trials-per-batch", type=_positive_int, default=16,
                   help="candidates built and measured per search round (default 16)")
    t.add_argument("--no-rules-baseline", action="store_true",
                   help="do not measure our rules' kernel at each size (the build then uses every "
                        "tuned kernel, even one slower than our rules)")
    t.add_argument("--no-rule-grid", action="store_true",
                   help="do not measure our matmul rules at each register tile of the CPU's "
                        "row of schedules/cpu/microarch.py")
    t.set_defaults(func=_tune)

    pl = sub.add_parser("plan", help="print the memory plan of a checkpoint without compiling",
                        description="Import MODEL_DIR and run the Relax passes up to TVM's static "
                                    "memory plan (no kernel is compiled), then print weights, "
                                    "activations, KV pages and what fits in --max-memory.")
    _add_model_dir_arg(pl)
    _add_config_args(pl, memory=True)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.set_defaults(func=_plan)

    g = sub.add_parser("generate", help="generate text with a built output directory")
    _add_output_dir_arg(g)
    g.add_argument("--prompt", action="append", type=_text_arg,
                   help="prompt text (repeat for several prompts)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=_non_negative_int, default=0, help="0 = all tokens (default)")
    g.add_argument("--top-p", type=_top_p, default=1.0)
    g.add_argument("--seed", type=_non_negative_int, default=None)
    g.add_argument("--stop-token-id", type=_non_negative_int, action="append", help="extra stop token id")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    _add_threads_arg(g)
    g.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template")
    g.set_defaults(func=_generate)

    sv = sub.add_parser("serve", help="serve a build over an OpenAI-compatible HTTP API",
                        description="OpenAI-compatible server (/v1/completions, "
                        "/v1/chat/completions, /v1/models, /health, /metrics) with continuous "
                        "batching. SIGTERM drains open requests, then exits.")
    _add_output_dir_arg(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_port, default=8000, help="0 picks a free port (printed)")
    sv.add_argument("--api-key", default=os.environ.get("TVM_LLM_API_KEY"),
                    help="require 'Authorization: Bearer KEY' (default: $TVM_LLM_API_KEY)")
    sv.add_argument("--max-batch-size", type=_positive_int, default=None,
                    help="sequences decoded together (default: the build's)")
    sv.add_argument("--max-waiting", type=_positive_int, default=256,
                    help="queued requests beyond which new ones get 429 (default 256)")
    sv.add_argument("--model-name", default=None,
                    help="model id clients send (default: OUT's directory name)")
    _add_threads_arg(sv)
    sv.add_argument("--step-prefill-tokens", type=_positive_int, default=None,
                    help="prompt tokens prefilled per step while other sequences decode "
                    "(default: sized by --step-prefill-ratio; the build's prefill chunk size "
                    "gives the fastest first token, at uneven inter-token latency)")
    sv.add_argument("--step-prefill-ratio", type=_step_ratio, default=1.0,
                    help="while sequences decode, prefill as many prompt tokens per step as "
                    "add about this fraction of a decode step's measured time (default 1: a "
                    "step that prefills takes about two decode steps; 0.5 evens inter-token "
                    "latency more, at a later first token)")
    sv.add_argument("--no-mixed-steps", action="store_true",
                    help="prefill prompts in a call of their own, not in the decode's call")
    sv.set_defaults(func=_serve)

    v = sub.add_parser("verify", help="compare a build with transformers, layer by layer",
                       description="Run the build in OUT and transformers (the checkpoint MODEL_DIR, "
                                   "float32, eager attention) on the same prompts; print per "
                                   "hidden state (embedding, each decoder layer, final norm) and "
                                   "for the logits the cosine similarity and max abs difference, "
                                   "and flag what falls below the thresholds. Exit code 0: nothing "
                                   "flagged, 1: something flagged, 2: bad input.")
    _add_output_dir_arg(v)
    v.add_argument("--reference", metavar="MODEL_DIR", default=None,
                   help="Hugging Face checkpoint to compare with (default: the directory OUT was "
                        "built from, as its manifest records)")
    v.add_argument("--prompt", action="append", type=_text_arg,
                   help="prompt text (repeat for several; default: three short texts)")
    v.add_argument("--min-cosine", type=_cosine, default=0.99,
                   help="flag a hidden state or the logits whose cosine similarity (all positions "
                        "flattened) is below this (default 0.99)")
    v.add_argument("--min-top1", type=_fraction, default=0.9,
                   help="flag the logits when fewer than this fraction of positions agree on the "
                        "greedy token (default 0.9)")
    _add_threads_arg(v)
    v.set_defaults(func=_verify)

    pp = sub.add_parser("perplexity", help="perplexity of a build on a text file",
                        description="Perplexity of the build in OUT on non-overlapping windows of "
                                    "--window tokens of a text (default: the bundled model's "
                                    "held-out text), through the runtime.")
    _add_output_dir_arg(pp)
    _add_text_args(pp)
    _add_threads_arg(pp)
    pp.set_defaults(func=_perplexity)

    se = sub.add_parser("sensitivity", help="perplexity cost of quantizing each layer alone",
                        description="Quantize one decoder layer (or the LM head) at a time, "
                                    "simulated in transformers with the build's exact rounding, "
                                    "and print perplexity and logits cosine against float32: "
                                    "the most sensitive units are what --keep-float is for.")
    _add_model_dir_arg(se)
    _add_quantization_args(se, default="q4")
    _add_text_args(se)
    se.set_defaults(func=_sensitivity)

    i = sub.add_parser("inspect", help="print an output directory's manifest and build report")
    _add_output_dir_arg(i)
    i.set_defaults(func=_inspect)

    d = sub.add_parser("demo", help="build the bundled tiny model for this CPU and generate")
    d.add_argument("-o", "--output", default="tvm-llm-demo", metavar="OUT")
    d.add_argument("--prompt", action="append", type=_text_arg)
    d.add_argument("--max-new-tokens", type=_positive_int, default=48)
    d.set_defaults(func=_demo)
    return p


def _show_tuning_warnings() -> None:
    """Tuning-log and non-finite-weight warnings as one plain line each (file and line are
    in the message)."""
    import warnings

    shown = warnings.showwarning
    if getattr(shown, "tvm_llm", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__name__ in ("TuningLogWarning", "NonFiniteWarning"):
            print(f"tvm-llm: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    show.tvm_llm = True
    warnings.showwarning = show


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    _show_tuning_warnings()
    try:
        code = args.func(args)  # verify returns its exit code; the others return None
    except UserError as e:
        print(f"tvm-llm: error: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:  # bad generation parameters from the runtime API
        if args.command == "generate":
            print(f"tvm-llm: error: {e}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        print("tvm-llm: interrupted", file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
