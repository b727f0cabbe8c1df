"""ExportedProgram -> Relax IRModule with prefill/decode functions over a paged KV cache.

The custom attention op becomes TVM's fused-QKV paged attention (`attention_with_fused_qkv`);
heads, head dim and scale are read from the traced op's arguments, so no architecture is
described by hand. The module gets four functions:
  prefill(input_ids (1, n), position_ids (1, n), logit_positions (m,), kv_cache, *weights)
      -> logits (1, m, vocab): the tokens of several sequences concatenated (ragged batch).
  decode(input_ids (b, 1), position_ids (b, 1), kv_cache, *weights) -> logits (b, 1, vocab)
  hidden_states(same arguments as prefill) -> (logits (1, m, vocab),
      hidden states (k, 1, n, hidden)): prefill that also returns the stacked hidden states
      (embedding output, each decoder layer's output, the final norm's), for tvm-llm verify.
  create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
      support_sliding_window) -> the cache object (TVM's TIR paged KV cache).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError


@dataclass
class AttentionShape:
    """What the traced attention layers need from the cache."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scales: list = field(default_factory=list)
    # layer -> (window, softcap, sink logits per query head or None) for layers with attention
    # variants (tvm_llm::paged_attention_variant); those layers pass a layer code as sm_scale
    variants: dict = field(default_factory=dict)
    # multi-head latent attention (frontend/mla.py): one KV head whose K and V planes hold the
    # same latent row (c | k_pe), head_dim = kv_lora_rank + qk_rope_head_dim
    latent: bool = False

    @property
    def sliding_window(self) -> int:
        """The window when every layer slides with the same window (the cache can then drop
        a sequence's pages behind it); 0 otherwise (full layers keep every page)."""
        windows = {self.variants.get(i, (0,))[0] for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else 0


@dataclass
class ImportedModel:
    mod: object  # tvm.IRModule
    param_names: list  # checkpoint names, in the order of the Relax weight params
    params: list  # numpy arrays, same order
    attention: AttentionShape
    vocab_size: int
    relax_names: dict = field(default_factory=dict)  # Relax param name -> checkpoint name


def _attention_converter(layers: dict, cache_var, cache_dtype: str | None = None,
                         sm_scale_arg=None):
    """`cache_dtype`: the KV cache's dtype (the build dtype). TVM's torch importer computes
    linears in float32 even in a float16/bfloat16 model, so q/k/v may arrive as float32: they
    are cast to the cache's dtype on the way in, and the output back. `sm_scale_arg(layer,
    scale)`: what the cache call passes as sm_scale (default: the scale)."""
    from tvm import relax as rx

    def convert(node, importer):
        bb = importer.block_builder
        q, k, v = (importer.env[a] for a in node.args[:3])
        layer_id, scale = int(node.args[3]), float(node.args[4])
        b, nh, s, d = q.ty.shape
        nkv, dv = k.ty.shape[1], v.ty.shape[3]
        if int(d) != int(dv):
            raise UserError(f"layer {layer_id}: value head dim {int(dv)} differs from query head dim "
                            f"{int(d)}; the paged KV cache needs equal head dims")
        layers[layer_id] = (int(nh), int(nkv), int(d), int(dv), scale)
        # (b, h, s, d) -> (b, s, h, d), q | k | v along heads -> (b*s, nh + 2 nkv, d);
        # each cast to the cache dtype first: they may differ (Qwen3's per-head RMSNorm gives
        # q and k back in the model dtype, v stays in the importer's float32)
        dtype = str(cache_dtype or q.ty.dtype)
        parts = []
        for t in (q, k, v):
            if str(t.ty.dtype) != dtype:
                t = bb.emit(rx.op.astype(t, dtype))
            parts.append(bb.emit(rx.op.permute_dims(t, [0, 2, 1, 3])))
        qkv = bb.emit(rx.op.concat(parts, axis=2))
        qkv = bb.emit(rx.op.reshape(qkv, [b * s, nh + 2 * nkv, d]))
        out = bb.emit(rx.call_dps_packed(
            "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
            [cache_var, rx.prim_value(layer_id),
             rx.prim_value(sm_scale_arg(layer_id, scale) if sm_scale_arg else scale), qkv],
            out_ty=rx.TensorType([b * s, nh, d], dtype)))
        if str(q.ty.dtype) != dtype:
            out = bb.emit(rx.op.astype(out, q.ty.dtype))
        return bb.emit(rx.op.reshape(out, [b, s, nh, d]))

    return {"paged_attention.default": convert}


def _attention_variant_converter(layers: dict, variants: dict, cache_var, sources: dict,
                                 cache_dtype: str | None = None):
    """Converter of `tvm_llm::paged_attention_variant` (layers with a sliding window, logit
    soft-capping or attention sinks): records the layer's variant and emits the same cache
    call as paged_attention, with the layer code -(layer + 1) as sm_scale, by which the CPU
    kernels find the layer's row of their table (tvm_llm/targets/attention.py)."""
    plain = _attention_converter(layers, cache_var, cache_dtype,
                                 sm_scale_arg=lambda layer, scale: float(-(layer + 1)))
    plain = plain["paged_attention.default"]

    def convert(node, importer):
        layer_id, window, softcap = int(node.args[3]), int(node.args[5]), float(node.args[6])
        sink_node = node.args[7]
        sinks = None
        if tuple(sink_node.meta["val"].shape) != (0,):
            if sink_node.name not in sources:
                raise UserError(f"layer {layer_id}: attention sinks are computed, not a weight; "
                                "tvm_llm needs them as a parameter of the checkpoint")
            sinks = [float(x) for x in sources[sink_node.name][1].detach().float().reshape(-1)]
        variants[layer_id] = (window, softcap, sinks)
        return plain(node, importer)

    return {"paged_attention_variant.default": convert}


def _to_device_converter() -> dict:
    """aten.to.device(x, device, dtype, ...) (e.g. the rotary inv_freq moved to the input's
    device) as a cast to `dtype`: the importer knows it only in its decomposed form (_to_copy),
    and we import without decompositions (to_relax)."""
    import torch
    from tvm import relax as rx

    def convert(node, importer):
        x = importer.env[node.args[0]]
        dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
        if not isinstance(dtype, torch.dtype):
            return x
        return importer.block_builder.emit(
            rx.op.astype(x, importer._convert_data_type(dtype, importer.env)))

    return {"to.device": convert}


def _topk_converter() -> dict:
    """torch.topk with sorted=False (DeepSeek-V3's router) as a sorted top-k: an unsorted top-k
    may return its k values in any order, sorted included, and TVM's converter refuses the flag.
    (The router only scatters the chosen groups into a mask and gathers the chosen experts'
    weights, so the order never changes which experts are picked.)"""
    from tvm import relax as rx

    def convert(node, importer):
        args = importer.retrieve_args(node)
        k = args[1] if len(args) > 1 else node.kwargs.get("k", 1)
        dim = args[2] if len(args) > 2 else node.kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else node.kwargs.get("largest", True)
        return importer.block_builder.emit(
            rx.op.topk(args[0], k=k, axis=dim, largest=largest, ret_type="both", dtype="int64"))

    return {"topk.default": convert}


def _half_precision_converters() -> dict:
    """Converters for float16/bfloat16 models; float32 models are converted as before.

    * Matmuls: TVM's importer computes every matmul with a float32 result, so the activations
      downstream of a linear are float32 while the weights stay half; its own converter then
      casts the *weight* up to float32 (folded at build time into a float32 copy: o_proj and
      down_proj stored at twice the bytes). Here the float32 operand is cast down instead, to
      the dtype torch has there (both operands are half in the traced model), and the product
      still accumulates in float32.
    * bfloat16 layer norm, pow, tanh, gelu, erf: TVM cannot lower them in bfloat16; they are
      computed in float32 and rounded back, as torch's CPU kernels do."""
    from tvm import relax as rx

    half = ("float16", "bfloat16")

    def torch_dtype(node) -> str:
        val = node.meta.get("val")
        return str(getattr(val, "dtype", "")).replace("torch.", "")

    def common(importer, a, b):
        da, db = str(a.ty.dtype), str(b.ty.dtype)
        bb = importer.block_builder
        if da != db and da in half and db == "float32":
            b = bb.emit(rx.op.astype(b, da))
        elif da != db and db in half and da == "float32":
            a = bb.emit(rx.op.astype(a, db))
        return a, b

    def matmul(node, importer):
        a, b = importer.retrieve_args(node)[:2]
        if torch_dtype(node) in half:
            a, b = common(importer, a, b)
        elif str(a.ty.dtype) != str(b.ty.dtype):  # what TVM's importer does
            a = importer.block_builder.emit(rx.op.astype(a, "float32"))
            b = importer.block_builder.emit(rx.op.astype(b, "float32"))
        return importer.block_builder.emit(rx.op.matmul(a, b, out_dtype="float32"))

    def addmm(node, importer):  # bias + x @ w (GPT-2's Conv1D)
        out_dtype = torch_dtype(node)
        alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
        if out_dtype not in half or alpha != 1 or beta != 1:
            return importer._addmm(node)
        bias, x, w = (importer.env[a] for a in node.args[:3])
        bb = importer.block_builder
        x, w = common(importer, x, w)
        res = bb.emit(rx.op.matmul(x, w, out_dtype="float32"))
        res = bb.emit(rx.op.astype(res, out_dtype))
        if str(bias.ty.dtype) != out_dtype:
            bias = bb.emit(rx.op.astype(bias, out_dtype))
        return bb.emit(rx.op.add(bias, res))

    def layer_norm(node, importer):  # TVM's layer_norm kernel takes float32/float16 only
        x = importer.env[node.args[0]]
        if str(x.ty.dtype) != "bfloat16":
            native = str(node.target).startswith("aten.native_layer_norm")
            return (importer._native_layer_norm if native else importer._layer_norm)(node)
        bb = importer.block_builder
        gamma = importer.env.get(node.args[2]) if len(node.args) > 2 else None
        beta = importer.env.get(node.args[3]) if len(node.args) > 3 else None
        eps = node.args[4] if len(node.args) > 4 else 1e-05
        # in float32, as torch's CPU kernel computes a bfloat16 layer norm
        x, gamma, beta = (None if t is None else bb.emit(rx.op.astype(t, "float32"))
                          for t in (x, gamma, beta))
        out = importer._layer_norm_impl(x, gamma, beta, eps, node.args[1])
        return bb.emit(rx.op.astype(out, "bfloat16"))

    # unary math TVM cannot lower in bfloat16 (pow, tanh, erf: "only applies to float"):
    # computed in float32 and rounded back, as torch's CPU kernels do for bfloat16
    defaults = {}

    def via_float32(key):
        def convert(node, importer):
            arg = node.args[0]
            x = importer.env[arg]
            if str(x.ty.dtype) != "bfloat16":
                return defaults[key](node)
            bb = importer.block_builder
            importer.env[arg] = bb.emit(rx.op.astype(x, "float32"))
            try:
                out = defaults[key](node)
            finally:
                importer.env[arg] = x
            return bb.emit(rx.op.astype(out, "bfloat16"))

        def first_call(node, importer):  # the importer's own converter, before ours replaced it
            if key not in defaults:
                defaults[key] = importer.create_convert_map()[key]
            return convert(node, importer)

        return first_call

    math = {k: via_float32(k) for k in ("pow.Tensor_Scalar", "tanh.default", "gelu.default",
                                         "erf.default")}

    return {**math, "mm.default": matmul, "matmul.default": matmul, "bmm.default": matmul,
            "addmm.default": addmm, "layer_norm.default": layer_norm,
            "native_layer_norm.default": layer_norm}


def _weight_sources(ep) -> dict:
    """Relax weight param name -> (checkpoint name, torch tensor) for every lifted parameter.
    Buffers and constants (e.g. rotary inv_freq) are bound into the module as constants."""
    from torch.export.graph_signature import InputKind

    out = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER:
            name = spec.target[len("model."):] if spec.target.startswith("model.") else spec.target
            out[spec.arg.name] = (name, ep.state_dict[spec.target])
    return out


_COMPLEX_OPS = ("view_as_complex", "view_as_real", "polar")


def _refuse_complex_ops(ep) -> None:
    """Complex-number tensors (a rotary embedding written as a complex product, e.g.
    transformers' deepseek_v2) have no Relax equivalent: refuse them in one line."""
    used = sorted({str(n.target).split(".")[1] for n in ep.graph.nodes if n.op == "call_function"
                   and str(n.target).startswith("aten.") and str(n.target).split(".")[1] in _COMPLEX_OPS})
    if used:
        raise UserError(f"the model computes with complex numbers ({', '.join(used)}; a rotary "
                        "embedding in complex form, as in deepseek_v2), which tvm_llm cannot "
                        "import; not supported")


def _needs_decompositions(ep, dtype: str | None) -> bool:
    """Whether the importer must run torch's decompositions first. A dense float32 model is
    imported without them: run_decompositions() re-traces the whole program (llama-110m: 7.6
    of the 18 CPU seconds of trace + import) only to spell linear as view/permute/mm, which
    the importer's own converters and the fusion passes bring back to the same kernels (same
    weights). Half-precision models keep them (_half_precision_converters rewrite the
    decomposed mm/addmm), and so do mixture-of-experts models (their routing imported
    undecomposed failed the MoE tests: tests/test_moe.py, test_mla.py's MoE variant)."""
    if dtype != "float32":
        return True
    return any(n.op == "call_function" and "moe_experts" in str(n.target) for n in ep.graph.nodes)


def _from_exported_program(ep, run_decompositions: bool, custom_convert_map: dict):
    """TVM's from_exported_program with keep_params_as_input, less its copy of every weight.

    TVM's importer converts each parameter into a TVM tensor for a "params" attribute that
    to_relax drops (the weights stay torch tensors, ImportedModel.params). Weights loaded from
    safetensors sit 32 bytes off TVM's 64-byte alignment, so each conversion was a copy: on
    llama-1b 4.4 GB and ~8 s of trace + import. Parameters get an empty placeholder instead;
    buffers and constants (bound into the module) are converted as before."""
    import tvm
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    if run_decompositions:
        ep = ep.run_decompositions()
    params = {id(t) for _, t in ep.named_parameters()}

    class Importer(ExportedProgramImporter):
        def _convert_pytorch_tensor_to_tvm(self, tensor_value):
            if id(tensor_value) in params:
                return tvm.runtime.empty((0,), "float32", tvm.cpu())
            return ExportedProgramImporter._convert_pytorch_tensor_to_tvm(tensor_value)

    return Importer().from_exported_program(ep, keep_params_as_input=True,
                                            unwrap_unit_return_tuple=True,
                                            no_bind_return_tuple=False,
                                            custom_convert_map=custom_convert_map)


def to_relax(ep, vocab_size: int, dtype: str | None = None,
             cache_dtype: str | None = None) -> ImportedModel:
    """Convert the exported program into the forward Relax function (one symbolic batch/seq).
    `cache_dtype`: the KV cache's dtype (default `dtype`)."""
    import tvm
    from tvm import relax as rx

    from .mla import mla_converters
    from .moe_relax import moe_converter

    _refuse_complex_ops(ep)

    layers: dict = {}
    variants: dict = {}
    cache_dtype = cache_dtype or dtype
    cache_var = rx.Var("paged_kv_cache", rx.ObjectType())
    sources = _weight_sources(ep)
    mod = _from_exported_program(ep, run_decompositions=_needs_decompositions(ep, dtype),
                                 custom_convert_map={
                                     **_to_device_converter(),
                                     **_half_precision_converters(),
                                     **_topk_converter(),
                                     **_attention_converter(layers, cache_var, cache_dtype),
                                     **mla_converters(layers, cache_var, cache_dtype),
                                     **moe_converter(),
                                     **_attention_variant_converter(layers, variants, cache_var,
                                                                    sources, cache_dtype)})
    func = mod["main"]
    n_in = int(func.attrs["num_input"])
    names, weights, relax_names = [], [], {}
    for var in func.params[n_in:]:
        name, tensor = sources[var.name]
        names.append(name)
        relax_names[var.name] = name
        weights.append(tensor.detach().contiguous().numpy() if tensor.dtype != _bf16()
                       else tensor.detach().float().numpy().astype(_np_bf16()))
    if not layers:
        raise UserError("no attention layer was traced: the model does not route attention through "
                        "transformers' attention interface, so tvm_llm cannot import it")
    ids = sorted(layers)
    if ids != list(range(len(ids))):
        raise UserError(f"traced attention layers {ids} are not numbered 0..{len(ids) - 1}")
    shapes = {v[:4] for v in layers.values()}
    if len(shapes) != 1:
        raise UserError(f"attention layers differ in heads/head dim {sorted(shapes)}; the paged "
                        "KV cache needs one shape for all layers")
    nh, nkv, d, dv = shapes.pop()
    attn = AttentionShape(len(ids), nh, nkv, d, dv, [layers[i][4] for i in ids], variants,
                          latent=any(len(v) > 5 and v[5] == "latent" for v in layers.values()))

    # forward(input_ids, position_ids, logit_positions, kv_cache, *weights)
    #     -> (logits, stacked hidden states)
    params = list(func.params)
    attrs = {k: v for k, v in func.attrs.items() if k != "params"}
    attrs["num_input"] = n_in + 1
    forward = rx.Function(params[:n_in] + [cache_var] + params[n_in:], func.body, func.ret_ty,
                          func.is_pure, tvm.ir.DictAttrs(attrs))
    kernels = {gv: f for gv, f in mod.functions_items() if gv.name_hint != "main"}  # e.g. moe_gemm
    return ImportedModel(tvm.IRModule({"forward": forward, **kernels}), names, weights, attn,
                         vocab_size, relax_names)


def _bf16():
    import torch

    return torch.bfloat16


def _np_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _sym_vars(func):
    """(batch, seq, kept) symbolic variables of the forward function."""
    ids_shape = func.params[0].ty.shape
    keep_shape = func.params[2].ty.shape
    return ids_shape[0], ids_shape[1], keep_shape[0]


def _logits_only(func):
    """The function returning only the first field (the logits) of its (logits, hidden states)
    result; the stacked hidden states become dead code, removed by the caller's DCE."""
    from tvm import relax as rx

    body = rx.SeqExpr(func.body.blocks, rx.TupleGetItem(func.body.body, 0))
    return rx.Function(func.params, body, func.ret_ty.fields[0], func.is_pure, func.attrs)


def specialize(mod, max_batch: int, max_tokens: int):
    """Derive prefill (batch 1), decode (seq 1, last logit) and hidden_states (prefill that
    also returns the hidden states) from the forward function."""
    import tvm
    from tvm import relax as rx
    from tvm.relax.utils import copy_with_new_vars

    forward = mod["forward"]
    batch, seq, kept = _sym_vars(forward)
    one_seq = forward.bind_symbolic_vars({batch: 1})
    seq_bounds = {"tir_var_upper_bound": {seq.name: max_tokens, kept.name: max_tokens},
                  "tir_var_lower_bound": {seq.name: 1, kept.name: 1}}
    prefill = _logits_only(one_seq).with_attrs({"global_symbol": "prefill", "num_input": 4,
                                                **seq_bounds})
    hidden = one_seq.with_attrs({"global_symbol": "hidden_states", "num_input": 4, **seq_bounds})
    decode = _logits_only(forward.bind_symbolic_vars({seq: 1, kept: 1}))
    decode = decode.bind_params({decode.params[2]: rx.const(np.zeros((1,), "int64"))})
    decode = decode.with_attrs({"global_symbol": "decode", "num_input": 3,
                                "tir_var_upper_bound": {batch.name: max_batch},
                                "tir_var_lower_bound": {batch.name: 1}})
    # all came from one function: give each its own variables (passes need SSA per module)
    out = tvm.IRModule({"prefill": copy_with_new_vars(prefill), "decode": copy_with_new_vars(decode),
                        "hidden_states": copy_with_new_vars(hidden)})
    for gv, func in mod.functions_items():  # TIR kernels the converters added (moe_gemm)
        if gv.name_hint != "forward":
            out[gv] = func
    # prefill/decode: forward the logits binding, drop the hidden-state stacking
    out = rx.transform.CanonicalizeBindings()(out)
    return rx.transform.DeadCodeElimination(["prefill", "decode", "hidden_states"])(out)


# export_tvm spec of create_paged_kv_cache: the runtime calls it with these five integers
CACHE_CREATION_SPEC = {"max_batch_size": int, "max_total_seq_len": int,
                       "prefill_chunk_size": int, "page_size": int, "support_sliding_window": int,
                       "$": {"param_mode": "none", "effect_mode": "none"}}


def tir_paged_kv_cache(sizes, attn: AttentionShape, dtype: str, target, rope: bool = False):
    """TVM's TIR paged KV cache (multi-head attention) for `attn`'s layers and heads. `sizes`:
    the five create_paged_kv_cache arguments in CACHE_CREATION_SPEC's order. `rope`: the cache
    applies RoPE (theta 10000) itself; our imported graphs apply it before the cache."""
    from tvm import relax as rx
    from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

    max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, sliding = sizes
    return TIRPagedKVCache(
        attn_kind="mha", max_batch_size=max_batch_size, max_total_seq_len=max_total_seq_len,
        prefill_chunk_size=prefill_chunk_size, page_size=page_size,
        support_sliding_window=sliding,
        layer_partition=rx.ShapeExpr([0, attn.num_layers]),
        num_hidden_layers=attn.num_layers, num_attention_heads=attn.num_heads,
        num_key_value_heads=attn.num_kv_heads, qk_head_dim=attn.head_dim,
        v_head_dim=attn.v_head_dim, mla_original_qk_head_dim=0, mla_original_v_head_dim=0,
        rope_mode=RopeMode.NORMAL if rope else RopeMode.NONE, rope_scale=1, rope_theta=10000,
        rope_scaling={}, rope_ext_factors=rx.prim_value(0), rotary_dim=attn.head_dim,
        enable_disaggregation=False, dtype=dtype, target=target)


def add_kv_cache_creation(mod, attn: AttentionShape, dtype: str, target_spec,
                          page_size: int = 16):
    """Add create_paged_kv_cache (TVM's TIR paged KV cache for this target and dtype), with
    the kernels the target replaces (`TargetSpec.cache_kernels`: our attention kernels).

    The cache's kernels match its pages buffer with a fixed page extent (TVM compiles them for
    16-token pages), so on CPU every kernel that reads or writes pages is rebuilt for
    `page_size`; the runtime must create the cache with the same page size (the manifest
    records it). Other targets take 16 only (checked by the target, tvm_llm/targets/)."""
    key = (type(target_spec).__name__, target_spec.arch, repr(sorted(target_spec.options.items())),
           str(target_spec.tvm_target()), repr(attn), dtype, page_size)
    if key not in _CACHE_MODULES:
        _CACHE_MODULES[key] = _cache_module(attn, dtype, target_spec, page_size)
    kv_mod = _CACHE_MODULES[key].clone()  # clone: the model's functions join the copy
    for gv, func in mod.functions_items():  # the same GlobalVars: prefill calls its kernels by them
        kv_mod[gv] = func
    return kv_mod


# (target, attention shape, dtype, page size) -> the cache's module before the model joins it.
# Making it parses ~20 TVMScript kernels (TVM's and ours): ~6 s of a tiny model's ~17 s build,
# the same for every build of that shape in one process (tuning runs, the test suite). The
# module is never changed in place (add_kv_cache_creation takes a clone); its PrimFuncs are
# immutable IR, shared safely between modules.
_CACHE_MODULES: dict = {}


def _cache_module(attn: AttentionShape, dtype: str, target_spec, page_size: int):
    """TVM's cache module with the target's kernels in place (add_kv_cache_creation)."""
    from tvm import tirx
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache

    target = target_spec.tvm_target()

    class CacheFactory(nn.Module):
        def create_paged_kv_cache(self, max_batch_size: tirx.Var, max_total_seq_len: tirx.Var,
                                  prefill_chunk_size: tirx.Var, page_size: tirx.Var,
                                  support_sliding_window: tirx.Var) -> PagedKVCache:
            return tir_paged_kv_cache(
                (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                 support_sliding_window), attn, dtype, target)

    spec = {"create_paged_kv_cache": CACHE_CREATION_SPEC}
    kv_mod, _ = CacheFactory().export_tvm(spec=spec)
    names = {gv.name_hint for gv in kv_mod.get_global_vars()}
    for name, func in target_spec.cache_kernels(kv_mod, attn, dtype, page_size).items():
        if name not in names:  # TVM renamed a kernel: fail the build, never mismatch at run time
            raise RuntimeError(f"TVM's paged KV cache has no kernel named {name}")
        kv_mod[name] = func
    return kv_mod
