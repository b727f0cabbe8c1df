"""Memory budget arithmetic: parse `--max-memory`, size the paged KV pool, count what fits.

Pure arithmetic on numbers the planner hands in (no TVM, no torch), so every figure can be
checked by hand:

    KV bytes per token  = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes
                          (an MLA model: kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim,
                          as traced, see frontend/mla.py)
    page bytes          = KV bytes per token * page size
    pages               = (budget - weights - activations - logits - KV workspace
                           - runtime reserve) // page bytes
    tokens in the pool  = pages * page size
    sequences that fit  = pages // ceil(context / page size)

TVM's paged KV cache allocates ceil(max_total_seq_len / page_size) + 1 pages
(`paged_kv_cache.cc`), so a pool of P pages is created with max_total_seq_len = (P - 1) *
page_size, and every one of its P pages is usable.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UserError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int32": 4,
               "int64": 8, "float64": 8, "bool": 1}

# Memory the process needs besides the model: the Python interpreter with numpy, the TVM
# runtime library (190 MiB resident measured on x86-64 after `import tvm` with the runtime
# only) and the compiled model's code. On GPUs: the driver context on the device.
RUNTIME_RESERVE = {"cpu": 256 * 2**20, "cuda": 512 * 2**20, "rocm": 512 * 2**20}

# TVM's VM allocator (PooledAllocator) rounds every storage up to 4 KiB and keeps freed
# storages for reuse by the next request of the same rounded size.
ALLOCATOR_PAGE = 4096

# Paged KV cache runtime constants (src/runtime/vm/attn_utils.h): two block depths of page
# tables; a 32 Mi-int32 auxiliary-data staging buffer on host and device, committed on CUDA,
# touched only as far as used on CPU.
_KV_MAX_BLOCK_DEPTH = 2
_KV_AUX_CACHE_BYTES = 32 * 2**20 * 4

_UNITS = {"": None, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise UserError(f"unknown dtype {dtype!r} in the memory plan")
    return DTYPE_BYTES[dtype]


def fmt_bytes(n: float) -> str:
    """Binary units, one decimal: 480.0 MiB, 3.7 GiB."""
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Budget:
    """A parsed --max-memory: `spec` as the user wrote it, `bytes` it stands for."""

    spec: str
    bytes: int
    fraction: float | None = None  # set when given as a fraction of `device_bytes`
    device_bytes: int | None = None

    def describe(self) -> str:
        if self.fraction is not None:
            return (f"{self.spec} of {fmt_bytes(self.device_bytes)} device memory = "
                    f"{fmt_bytes(self.bytes)}")
        return f"{self.spec} = {fmt_bytes(self.bytes)}"


def parse_budget(spec, device_bytes=None) -> Budget:
    """'4GB' (10^9), '4GiB' / '4G' (2^30), '512MB', '0.5' or '50%' (of `device_bytes`, an int
    or a callable returning one, asked only for fractions)."""
    text = str(spec).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*|%)", text)
    hint = "give a size such as 4GB, 512MiB, or a fraction of the device memory such as 0.5"
    if not m:
        raise UserError(f"--max-memory {text!r} is not a size; {hint}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not value < 1e18:  # 1e18 bytes is an exabyte; larger (or inf) is a typo
        raise UserError(f"--max-memory {text!r} is not a plausible size; {hint}")
    if unit == "%" or (unit == "" and 0 < value <= 1):
        fraction = value / 100 if unit == "%" else value
        if not 0 < fraction <= 1:
            raise UserError(f"--max-memory {text}: a fraction must be in (0, 1]; {hint}")
        total = device_bytes() if callable(device_bytes) else device_bytes
        if not total:
            raise UserError(f"--max-memory {text} is a fraction of the device memory, which is "
                            "unknown here; give a size such as 4GB")
        return Budget(text, int(total * fraction), fraction, int(total))
    if unit not in _UNITS:
        raise UserError(f"--max-memory {text!r}: unknown unit {m.group(2)!r}; {hint}")
    if _UNITS[unit] is None:
        raise UserError(f"--max-memory {text}: a bare number must be a fraction in (0, 1]; {hint}")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise UserError(f"--max-memory {text} is not a positive size; {hint}")
    total = device_bytes() if callable(device_bytes) else device_bytes
    if total and nbytes > total:  # a pool sized past the memory fails at run time, not here
        raise UserError(f"--max-memory {text} ({fmt_bytes(nbytes)}) exceeds this machine's "
                        f"{fmt_bytes(total)} of memory (or its cgroup limit); give at most "
                        f"{fmt_bytes(total)}, or a fraction such as 0.5")
    return Budget(text, nbytes)


def host_memory_bytes() -> int:
    """Physical RAM, or the cgroup memory limit when this process runs under a smaller one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


def device_memory_bytes(device_type: str) -> int | None:
    """Memory of the device a target runs on: host RAM for cpu, the first GPU's memory
    (when one is visible here) for cuda/rocm; None when unknown."""
    if device_type == "cpu":
        return host_memory_bytes()
    try:
        import tvm

        dev = tvm.device(device_type, 0)
        return int(dev.total_global_memory) if dev.exist else None
    except Exception:  # no driver, no device: the caller asks for an absolute size
        return None


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
                       v_head_dim: int | None = None) -> int:
    """K and V of one token across all layers."""
    return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * dtype_bytes(dtype)


def pages_for_tokens(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def tvm_total_pages(max_total_seq_len: int, page_size: int) -> int:
    """Pages TVM's runtime allocates for a capacity of `max_total_seq_len` tokens."""
    return pages_for_tokens(max_total_seq_len, page_size) + 1


def kv_workspace_bytes(device_type: str, num_heads: int, num_kv_heads: int, head_dim: int,
                       dtype: str, prefill_chunk_size: int, max_batch_size: int, pages: int) -> int:
    """Fixed buffers TVM's paged KV cache allocates beside its pages (paged_kv_cache.cc):
    q/k/v/output staging for one prefill chunk, two float32 log-sum-exp arrays, and int32 page
    tables. The 128 MiB auxiliary staging buffer counts on CUDA, where it is committed; on CPU
    only the part a step writes is ever resident (a page table's worth, counted here)."""
    b = dtype_bytes(dtype)
    staging = prefill_chunk_size * (2 * num_heads + 2 * num_kv_heads) * head_dim * b
    lse = 2 * prefill_chunk_size * num_heads * 4
    bs, c = max_batch_size, prefill_chunk_size
    per_depth = 4 * (bs + 1) + 2 * pages + 5 * bs + 512 * bs  # indptrs, page indices, tree mask
    other = 2 * bs + 7 * c + 2 * (bs + 1) + 2 * min(256 * bs, c)  # position maps, copy lists
    tables = 4 * (_KV_MAX_BLOCK_DEPTH * per_depth + other)
    aux = 2 * tables if device_type == "cpu" else _KV_AUX_CACHE_BYTES + tables
    return staging + lse + tables + aux


def round_alloc(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_PAGE) * ALLOCATOR_PAGE


def logits_pool_bytes(vocab_size: int, dtype: str, max_rows: int) -> int:
    """The logits tensors a step returns are outside the static plan: TVM allocates each at run
    time and its pooled allocator keeps one buffer per distinct rounded size. The engine asks
    for 1 to `max_rows` rows (one per sequence in the step), prefill and decode alike, so the
    distinct sizes among round_up(r * vocab * dtype bytes, 4 KiB), r = 1..max_rows, stay
    resident (one step's logits are dropped before the next step asks for its own)."""
    row = vocab_size * dtype_bytes(dtype)
    return sum({round_alloc(r * row) for r in range(1, max_rows + 1)})


@dataclass
class KVPool:
    """The pool a budget (or an explicit capacity) gives, and what it holds."""

    bytes_per_token: int
    page_size: int
    pages: int

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def max_total_seq_len(self) -> int:
        """What to pass TVM's create_paged_kv_cache so that it allocates exactly `pages`."""
        return (self.pages - 1) * self.page_size

    def sequences_that_fit(self, context: int) -> int:
        """Sequences of `context` tokens each that the pool holds at once (unshared pages)."""
        return self.pages // pages_for_tokens(context, self.page_size)

    @classmethod
    def from_bytes(cls, available: int, bytes_per_token: int, page_size: int) -> "KVPool":
        return cls(bytes_per_token, page_size, max(0, available // (bytes_per_token * page_size)))

    @classmethod
    def from_tokens(cls, max_total_seq_len: int, bytes_per_token: int, page_size: int) -> "KVPool":
        return cls(bytes_per_token, page_size, tvm_total_pages(max_total_seq_len, page_size))
