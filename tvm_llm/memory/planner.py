"""The memory plan: weights, activations, logits, KV pool and runtime, before anything runs.

    plan = plan_memory(mod, vocab_size=..., num_layers=..., head_dim=..., dtype="float32",
                       device_type="cpu", budget=parse_budget("4GB"), ...)
    print(format_memory(plan.to_dict()))       # tvm_llm.report: the same text everywhere

It plans from sizes and shapes (a module after the static memory plan, or weights and
activations given); taking a checkpoint there is the front half's work (tvm_llm/front.py).

Activations come from TVM's static block-memory plan: after `StaticPlanBlockMemory`, with
upper bounds on the symbolic sizes (prefill tokens <= prefill_chunk_size, decode batch <=
max_batch_size, the functions' `tir_var_upper_bound`), every intermediate tensor lives in one
of a few `alloc_storage` calls of constant size. Summing them per function gives what each
function needs. Prefill and decode never run at once, but TVM's VM allocator (PooledAllocator)
keeps a freed storage for the next request of the same rounded size rather than handing it to
a different size, so once both functions have run, the storages of both stay resident: the
plan counts, per rounded size, the most storages any function holds (`resident`), not the
larger function alone.

The tensors a function returns (the logits) are allocated at run time with their actual size
and are outside the static plan; they are added explicitly (kv_budget.logits_pool_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError
from .kv_budget import (RUNTIME_RESERVE, Budget, KVPool, dtype_bytes, fmt_bytes, kv_bytes_per_token,
                        kv_workspace_bytes, logits_pool_bytes, pages_for_tokens, round_alloc)

_ALLOC_STORAGE_OPS = ("relax.memory.alloc_storage", "relax.vm.alloc_storage")
# functions the runtime calls per step; any other function that allocates storage (e.g. a CUDA
# graph's cached allocation) holds it for the life of the process
_STEP_FUNCTIONS = ("prefill", "decode")
# functions only `tvm-llm verify` calls (never a serving engine): left out of the plan and the
# budget; a verify run allocates their activations beyond it
_DIAGNOSTIC_FUNCTIONS = ("hidden_states",)
DEFAULT_CONTEXT = 2048  # when neither the user nor a budget says otherwise


@dataclass
class FunctionPlan:
    name: str
    storages: list  # constant sizes in bytes, as planned
    dynamic_storages: int  # storages sized at run time (the returned tensors)
    bounds: dict  # symbolic variable -> upper bound the plan assumed

    @property
    def bytes(self) -> int:
        return sum(self.storages)

    @property
    def allocated_bytes(self) -> int:
        return sum(round_alloc(s) for s in self.storages)


@dataclass
class ActivationPlan:
    functions: dict  # name -> FunctionPlan

    @property
    def resident_bytes(self) -> int:
        """Bytes the VM allocator holds after every step function has run at its bounds."""
        per_size: dict = {}
        permanent = 0
        for f in self.functions.values():
            if f.name not in _STEP_FUNCTIONS:
                permanent += f.allocated_bytes
                continue
            counts: dict = {}
            for s in f.storages:
                counts[round_alloc(s)] = counts.get(round_alloc(s), 0) + 1
            for size, n in counts.items():
                per_size[size] = max(per_size.get(size, 0), n)
        return permanent + sum(size * n for size, n in per_size.items())

    def to_dict(self) -> dict:
        return {name: {"bytes": f.bytes, "allocated_bytes": f.allocated_bytes,
                       "storages": len(f.storages), "dynamic_storages": f.dynamic_storages,
                       "bounds": f.bounds}
                for name, f in self.functions.items()}


def activation_plan(mod) -> ActivationPlan:
    """Per-function storage sizes of a module after StaticPlanBlockMemory (at any later stage
    of the VM lowering too: relax.vm.alloc_storage is read like relax.memory.alloc_storage)."""
    from tvm import relax, tirx

    functions = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or gv.name_hint in _DIAGNOSTIC_FUNCTIONS:
            continue
        sizes, dynamic = [], [0]

        def visit(expr, sizes=sizes, dynamic=dynamic):
            if not isinstance(expr, relax.Call) or getattr(expr.op, "name", None) not in _ALLOC_STORAGE_OPS:
                return
            size = expr.args[0]
            if isinstance(size, relax.ShapeExpr) and all(isinstance(v, tirx.IntImm) for v in size.values):
                n = 1
                for v in size.values:
                    n *= int(v)
                sizes.append(n)
            else:
                dynamic[0] += 1

        relax.analysis.post_order_visit(func, visit)
        if not sizes and not dynamic[0]:
            continue
        attrs = func.attrs or {}
        bounds = {str(k): int(v) for k, v in (attrs.get("tir_var_upper_bound") or {}).items()}
        functions[gv.name_hint] = FunctionPlan(gv.name_hint, sizes, dynamic[0], bounds)
    missing = [f for f in _STEP_FUNCTIONS if f not in functions]
    if missing:
        raise RuntimeError(f"no static memory plan for {missing}: plan activations after "
                           "relax.transform.StaticPlanBlockMemory")
    return ActivationPlan(functions)


def logits_dtype(mod, default: str) -> str:
    """dtype of the tensor prefill returns."""
    try:
        return str(mod["prefill"].ret_ty.dtype)
    except Exception:
        return default


@dataclass
class MemoryPlan:
    weights_by_dtype: dict  # dtype -> bytes
    weight_tensors: int
    activations: ActivationPlan
    logits_bytes: int
    logits_rows: int
    logits_dtype: str
    vocab_size: int
    kv: KVPool
    kv_dtype: str
    kv_workspace_bytes: int
    runtime_reserve_bytes: int
    device_type: str
    context_window: int
    context_source: str  # "requested", "default" or "budget"
    max_batch_size: int
    prefill_chunk_size: int
    max_position_embeddings: int | None
    budget: Budget | None = None
    notes: list = field(default_factory=list)
    # every layer attends to its last `sliding_window` tokens only (0: not so): the cache
    # releases the pages behind the window, so a sequence never holds more than window pages
    sliding_window: int = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights_by_dtype.values())

    @property
    def model_bytes(self) -> int:
        """What loading the model and running it at its bounds with a full pool holds."""
        return (self.weight_bytes + self.activations.resident_bytes + self.logits_bytes
                + self.kv.bytes + self.kv_workspace_bytes)

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.runtime_reserve_bytes

    def sequences_at(self, context: int) -> int:
        if self.sliding_window:
            return self.kv.pages // self.pages_per_sequence(context)
        return self.kv.sequences_that_fit(context)

    def pages_per_sequence(self, context: int) -> int:
        """Pages one sequence of `context` tokens holds at most: its whole length, or with a
        sliding window the window's tokens from any offset in their first page."""
        full = pages_for_tokens(context, self.kv.page_size)
        if self.sliding_window:
            return min(full, pages_for_tokens(self.sliding_window, self.kv.page_size) + 1)
        return full

    def to_dict(self) -> dict:
        """The manifest's "memory" section (report.format_memory prints it)."""
        acts = self.activations
        fits = {str(c): self.sequences_at(c) for c in sorted({self.context_window,
                                                             *([self.max_position_embeddings]
                                                               if self.max_position_embeddings else [])})}
        return {
            "budget": None if self.budget is None else {
                "spec": self.budget.spec, "bytes": self.budget.bytes,
                "fraction": self.budget.fraction, "device_bytes": self.budget.device_bytes},
            "device_type": self.device_type,
            "weights": {"bytes": self.weight_bytes, "tensors": self.weight_tensors,
                        "by_dtype": dict(self.weights_by_dtype)},
            "activations": {"bytes": acts.resident_bytes, "functions": acts.to_dict()},
            "logits": {"bytes": self.logits_bytes, "rows": self.logits_rows,
                       "vocab_size": self.vocab_size, "dtype": self.logits_dtype},
            "kv_cache": {"dtype": self.kv_dtype, "bytes_per_token": self.kv.bytes_per_token,
                         "page_size": self.kv.page_size, "page_bytes": self.kv.page_bytes,
                         "pages": self.kv.pages, "bytes": self.kv.bytes, "tokens": self.kv.tokens,
                         "max_total_seq_len": self.kv.max_total_seq_len,
                         "workspace_bytes": self.kv_workspace_bytes},
            "runtime_reserve_bytes": self.runtime_reserve_bytes,
            "context_window": self.context_window, "context_source": self.context_source,
            "max_batch_size": self.max_batch_size, "prefill_chunk_size": self.prefill_chunk_size,
            "sequences_that_fit": fits,
            "concurrent_sequences": min(self.sequences_at(self.context_window), self.max_batch_size),
            "sliding_window": self.sliding_window,
            "model_bytes": self.model_bytes, "total_bytes": self.total_bytes,
            "notes": list(self.notes),
        }


def weights_of(params) -> tuple[dict, int]:
    """(bytes per dtype, tensor count) of numpy arrays or manifest param entries."""
    by_dtype: dict = {}
    for p in params:
        dt, nb = (p["dtype"], p["nbytes"]) if isinstance(p, dict) else (str(p.dtype), int(p.nbytes))
        by_dtype[dt] = by_dtype.get(dt, 0) + nb
    return by_dtype, len(params)


def weights_from_module(mod) -> list:
    """[{"dtype", "nbytes"}] of the weight parameters prefill takes (after any weight
    transform the passes lifted out: what the compiled model receives and the runtime holds)."""
    func = mod["prefill"]
    out = []
    for p in func.params[int(func.attrs["num_input"]):]:
        n = 1
        for d in p.ty.shape.values:
            n *= int(d)
        out.append({"dtype": str(p.ty.dtype), "nbytes": n * dtype_bytes(str(p.ty.dtype))})
    return out


MAX_KV_TOKENS = 2**31 - 1


def check_options(budget: Budget | None, kv_cache_tokens: int | None) -> None:
    if budget is not None and kv_cache_tokens is not None:
        raise UserError("give --max-memory or --kv-cache-tokens, not both: the budget sizes the "
                        "KV cache")


def default_context(context_window: int | None, max_position_embeddings: int | None) -> int:
    """The context window asked for, else min(max_position_embeddings, 2048); UserError when
    the one asked for exceeds the model's."""
    if context_window is None:
        return min(max_position_embeddings or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if max_position_embeddings and context_window > max_position_embeddings:
        raise UserError(f"--context-window {context_window} exceeds the model's "
                        f"max_position_embeddings ({max_position_embeddings})")
    return context_window


def check_fits_machine(plan: "MemoryPlan", device_type: str) -> None:
    """A plan without a budget (--kv-cache-tokens, the defaults) must still fit the memory of
    the device it is planned for, when that is known here: a KV pool past it would fail to
    allocate at run time (bad_alloc), not at build time."""
    from .kv_budget import device_memory_bytes

    if plan.budget is not None:
        return  # parse_budget refused budgets above the machine already
    total = device_memory_bytes(device_type)
    if total and plan.total_bytes > total:
        raise UserError(f"the memory plan needs {fmt_bytes(plan.total_bytes)} (KV cache "
                        f"{fmt_bytes(plan.kv.bytes)} for {plan.kv.tokens} tokens) but this "
                        f"machine has {fmt_bytes(total)}; lower --kv-cache-tokens or give "
                        "--max-memory")


def check_weights_fit(budget: Budget | None, weight_bytes: int, device_type: str = "cpu") -> None:
    """The early check, as soon as the weights are known: a budget below them is refused."""
    if budget is None or budget.bytes > weight_bytes:
        return
    need = weight_bytes + RUNTIME_RESERVE.get(device_type, RUNTIME_RESERVE["cpu"])
    raise UserError(f"--max-memory {budget.spec} ({fmt_bytes(budget.bytes)}) is below the "
                    f"{fmt_bytes(weight_bytes)} of weights; give more than {fmt_bytes(need)} "
                    "(weights + runtime) plus room for activations and the KV cache, or a smaller "
                    "--dtype")


def plan_memory(mod=None, *, weights=None, activations: ActivationPlan | None = None, vocab_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, dtype: str,
                kv_dtype: str | None = None, device_type: str = "cpu", budget: Budget | None = None,
                context_window: int | None = None, kv_cache_tokens: int | None = None,
                max_batch_size: int = 8, prefill_chunk_size: int = 512, page_size: int = 16,
                max_position_embeddings: int | None = None, sliding_window: int = 0,
                sliding_layers: int = 0) -> MemoryPlan:
    """The plan for a module after the static memory plan (or for given `weights` and
    `activations` without a module). `context_window` and `kv_cache_tokens` are what the user
    asked for (None: not given).

    With a budget the KV pool gets what is left of it: budget - weights - activations - logits
    - KV workspace - runtime reserve, in whole pages; the context window is at most what that
    pool holds. Without one the pool holds `kv_cache_tokens` (default max(context, 4096)).
    `sliding_window`: every layer slides with this window, so a sequence holds only window
    pages (the context may then exceed the pool); `sliding_layers`: how many layers slide when
    not all do (their pages cannot be released: noted in the plan). `kv_dtype`: the KV
    cache's dtype (default `dtype`)."""
    check_options(budget, kv_cache_tokens)
    by_dtype, n_tensors = weights_of(weights_from_module(mod) if weights is None else weights)
    weight_bytes = sum(by_dtype.values())
    check_weights_fit(budget, weight_bytes, device_type)
    acts = activation_plan(mod) if activations is None else activations
    out_dtype = dtype if mod is None else logits_dtype(mod, dtype)
    rows = min(max_batch_size, prefill_chunk_size)
    logits = logits_pool_bytes(vocab_size, out_dtype, rows)
    kv_dtype = kv_dtype or dtype
    per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype, v_head_dim)
    reserve = RUNTIME_RESERVE.get(device_type, RUNTIME_RESERVE["cpu"])
    default_ctx = default_context(None, max_position_embeddings)
    if context_window is not None:
        default_context(context_window, max_position_embeddings)  # checks it

    def workspace(pages):
        return kv_workspace_bytes(device_type, num_heads, num_kv_heads, head_dim, kv_dtype,
                                  prefill_chunk_size, max_batch_size, pages)

    notes = []
    if budget is not None:
        fixed = weight_bytes + acts.resident_bytes + logits + reserve
        page_bytes = per_token * page_size
        # the workspace grows linearly with the page count (page tables): solve
        # fixed + workspace(0) + pages * (page_bytes + per_page) <= budget in one division
        per_page = workspace(1) - workspace(0)
        pages = max(0, (budget.bytes - fixed - workspace(0)) // (page_bytes + per_page))
        pages = min(pages, MAX_KV_TOKENS // page_size)  # TVM's cache indexes tokens in int32
        while pages > 0 and fixed + workspace(pages) + pages * page_bytes > budget.bytes:
            pages -= 1  # never taken while the workspace is linear; kept as the guarantee
        pool = KVPool(per_token, page_size, pages)
        min_tokens = min(context_window or default_ctx, prefill_chunk_size)
        min_pages = pages_for_tokens(min_tokens, page_size) + 1
        if pool.pages < min_pages:
            need = fixed + workspace(min_pages) + min_pages * page_bytes
            raise UserError(
                f"--max-memory {budget.spec} ({fmt_bytes(budget.bytes)}) leaves "
                f"{fmt_bytes(max(0, budget.bytes - fixed - workspace(0)))} for the KV cache after "
                f"weights {fmt_bytes(weight_bytes)}, activations "
                f"{fmt_bytes(acts.resident_bytes + logits)} and runtime {fmt_bytes(reserve)}; "
                f"one {min_tokens}-token chunk needs {min_pages} pages of {fmt_bytes(page_bytes)}: "
                f"give at least {fmt_bytes(need)}")
        if context_window is not None:
            held = min(context_window, sliding_window + page_size) if sliding_window else context_window
            if held > pool.tokens:
                raise UserError(
                    f"--context-window {context_window} does not fit in --max-memory {budget.spec}: "
                    f"the KV pool gets {fmt_bytes(pool.bytes)} = {pool.tokens} tokens; lower "
                    f"--context-window to {pool.tokens} or raise --max-memory by "
                    f"{fmt_bytes((pages_for_tokens(context_window, page_size) - pool.pages) * page_bytes)}")
            ctx, source = context_window, "requested"
        elif pool.tokens < default_ctx:
            ctx, source = pool.tokens, "budget"
            notes.append(f"context window bounded by the budget: {pool.tokens} tokens "
                         f"(default {default_ctx})")
        else:
            ctx, source = default_ctx, "default"
    else:
        ctx = context_window or default_ctx
        source = "requested" if context_window else "default"
        pool = KVPool.from_tokens(kv_cache_tokens or max(ctx, 4096), per_token, page_size)
        held = min(ctx, sliding_window + page_size) if sliding_window else ctx
        if held > pool.tokens:
            if context_window is not None:
                raise UserError(f"--context-window {ctx} exceeds the KV cache's {pool.tokens} tokens "
                                f"(--kv-cache-tokens {kv_cache_tokens}); raise --kv-cache-tokens "
                                "or lower --context-window")
            ctx, source = pool.tokens, "kv_cache_tokens"
    if max_position_embeddings and max_position_embeddings > ctx:
        full = pages_for_tokens(max_position_embeddings, page_size)
        notes.append(f"a full {max_position_embeddings}-token context (max_position_embeddings) "
                     f"needs {full} pages = {fmt_bytes(full * per_token * page_size)} of KV cache per "
                     "sequence; the context window is not taken from it")
    if sliding_window:
        notes.append(f"every layer slides with a window of {sliding_window} tokens: a sequence holds at "
                     f"most {pages_for_tokens(sliding_window, page_size) + 1} pages, whatever its "
                     "length (the pages behind the window return to the pool)")
    elif sliding_layers:
        notes.append(f"{sliding_layers} of {num_layers} layers slide, but the cache's pages hold "
                     "every layer: a sequence keeps pages for its whole length")
    return MemoryPlan(by_dtype, n_tensors, acts, logits, rows, out_dtype, vocab_size, pool, kv_dtype,
                      workspace(pool.pages), reserve, device_type, ctx, source, max_batch_size,
                      prefill_chunk_size, max_position_embeddings, budget, notes, sliding_window)
