"""Engine: load an output directory and generate text with the TVM runtime alone.

Imports only the TVM runtime, numpy and tokenizers (never torch or transformers), so the
exported directory deploys on a machine without the compiler stack.

    engine = Engine("out/")
    engine.generate("def fib(n):", max_new_tokens=32)                   # -> str
    engine.generate(["a", "b"], temperature=0.8, top_p=0.9, seed=0)     # -> list[str]
    for i, piece in engine.stream(["a", "b"]): ...                      # tokens as they come
    engine.generate("a", n=3, temperature=0.8, seed=0)   # 3 samples sharing the prompt's KV pages

Memory: sequences are admitted while the KV page pool has room for their prompt (and batch
slots remain); when running sequences outgrow the pool, the youngest is preempted (its pages
freed) and requeued, to be recomputed from its prompt and the tokens it already produced.
A sequence that cannot fit even alone raises PagePoolFull; the engine stays usable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from . import artifact
from .kv_cache import PagedKVCache, PagePoolFull  # noqa: F401  (re-exported)
from .sampling import SamplingParams, sample
from .tvm_import import import_tvm


def configure_threads(num_threads: int | None = None) -> int:
    """Size TVM's CPU thread pool: all cores unless told otherwise (TVM defaults to 1 here)."""
    n = num_threads or int(os.environ.get("TVM_NUM_THREADS", "0") or 0) or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(n)
    tvm = import_tvm()
    tvm.get_global_func("runtime.config_threadpool")(0, n)
    return n


@dataclass
class _Request:
    index: int
    prompt_ids: list
    max_new_tokens: int
    params: SamplingParams
    rng: np.random.Generator
    stop_ids: set
    seq_id: int = -1
    admitted: int = -1  # admission order: the highest is the youngest
    output_ids: list = field(default_factory=list)
    done: bool = False
    emitted_text: str = ""


class Engine:
    """Generation over a compiled output directory."""

    def __init__(self, out_dir: str, device: str | None = None, num_threads: int | None = None,
                 max_batch_size: int | None = None, kv_cache_tokens: int | None = None):
        self.out_dir = out_dir
        self.manifest = artifact.read_manifest(out_dir)  # UserError if not an output directory
        kv_cfg = self.manifest["kv_cache"]
        device = device or self.manifest["target"].get("device_type", "cpu")
        self.num_threads = configure_threads(num_threads)
        tvm = import_tvm()
        from tvm.runtime import load_module
        from tvm.runtime.vm import VirtualMachine

        self.device = tvm.device(device)
        lib = load_module(os.path.join(out_dir, artifact.LIBRARY))
        self.vm = VirtualMachine(lib, self.device)
        self.weights = _upload_weights(os.path.join(out_dir, artifact.WEIGHTS),
                                       self.manifest["params"], tvm, self.device)
        self._tvm = tvm
        self.cache = PagedKVCache(
            self.vm, max_batch_size or kv_cfg["max_batch_size"],
            kv_cache_tokens or kv_cfg["max_total_seq_len"], kv_cfg["prefill_chunk_size"],
            kv_cfg["page_size"])
        self.context_window = kv_cfg["context_window"]
        self.preemptions = 0  # sequences preempted (and recomputed) because the pool was full
        self._admissions = 0
        self._tokenizer = None
        tok = self.manifest["tokenizer"]
        self.eos_token_ids = set(tok.get("eos_token_ids") or [])
        self.add_bos = bool(tok.get("add_bos"))
        self.bos_token_id = tok.get("bos_token_id")

    # -------------------------------------------------------------- tokenizer
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(os.path.join(self.out_dir, "tokenizer.json"))
        return self._tokenizer

    def encode(self, text: str) -> list:
        ids = self.tokenizer.encode(text).ids
        if self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -------------------------------------------------------------- model calls
    def _tensor(self, arr):
        return self._tvm.runtime.tensor(arr, self.device)

    def prefill(self, chunks: list) -> np.ndarray:
        """chunks: [(seq_id, token ids)] -> last-token logits per chunk, shape (len(chunks), vocab).
        The caller keeps the total under the prefill chunk size."""
        seq_ids = [sid for sid, _ in chunks]
        lengths = [len(t) for _, t in chunks]
        starts = [self.cache.sequences[sid] for sid in seq_ids]
        ids = np.concatenate([np.asarray(t, dtype="int64") for _, t in chunks])[None]
        pos = np.concatenate([np.arange(s, s + n, dtype="int64") for s, n in zip(starts, lengths)])[None]
        last = np.cumsum(lengths, dtype="int64") - 1
        return self.prefill_positions(seq_ids, lengths, ids, pos, last)[0]

    def prefill_positions(self, seq_ids, lengths, ids, pos, logit_positions) -> np.ndarray:
        """Low-level prefill: explicit positions and the token indices to return logits for."""
        self.cache.begin(seq_ids, lengths)
        try:
            out = self.vm["prefill"](self._tensor(ids), self._tensor(pos),
                                     self._tensor(np.asarray(logit_positions, dtype="int64")),
                                     self.cache.handle, *self.weights)
        finally:
            self.cache.end()
        return out.numpy().astype(np.float32, copy=False)

    def decode_step(self, seq_ids: list, tokens: list) -> np.ndarray:
        """One token per sequence -> logits (len(seq_ids), vocab)."""
        pos = np.array([[self.cache.sequences[s]] for s in seq_ids], dtype="int64")
        self.cache.begin(seq_ids, [1] * len(seq_ids))
        try:
            out = self.vm["decode"](self._tensor(np.asarray(tokens, dtype="int64")[:, None]),
                                    self._tensor(pos), self.cache.handle, *self.weights)
        finally:
            self.cache.end()
        return out.numpy()[:, 0].astype(np.float32, copy=False)

    def hidden_states(self, token_ids) -> tuple:
        """One sequence through the compiled `hidden_states` function (prefill's kernels and
        weights, also returning what each layer produced): (logits (n, vocab), hidden states
        (k, n, hidden)) as float32 numpy, for every position of `token_ids`. The states are the
        embedding output, each decoder layer's output and the final norm's (tvm-llm verify).
        A prompt longer than the prefill chunk size runs in chunks over the KV cache."""
        from ..errors import UserError

        if not self.vm.module.implements_function("hidden_states"):
            raise UserError(f"{self.out_dir}: the build has no hidden_states function (built by "
                            "an older tvm_llm); rebuild it to verify it")
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("hidden_states: no tokens")
        if len(ids) > self.context_window:
            raise ValueError(f"hidden_states: {len(ids)} tokens exceed the context window "
                             f"({self.context_window})")
        sid = self.cache.add()
        logits, states = [], []
        try:
            for start in range(0, len(ids), self.cache.prefill_chunk_size):
                chunk = np.asarray(ids[start:start + self.cache.prefill_chunk_size], dtype="int64")
                n = len(chunk)
                self.cache.begin([sid], [n])
                try:
                    out = self.vm["hidden_states"](
                        self._tensor(chunk[None]),
                        self._tensor(np.arange(start, start + n, dtype="int64")[None]),
                        self._tensor(np.arange(n, dtype="int64")), self.cache.handle, *self.weights)
                finally:
                    self.cache.end()
                logits.append(out[0].numpy()[0].astype(np.float32, copy=False))
                states.append(out[1].numpy()[:, 0].astype(np.float32, copy=False))
        finally:
            self.cache.remove(sid)
        return np.concatenate(logits), np.concatenate(states, axis=1)

    # -------------------------------------------------------------- generation
    def _prefill_requests(self, reqs: list) -> dict:
        """Prefill every request's prompt, packing several per call up to the chunk size;
        returns {id(request): its last logits row}."""
        limit = self.cache.prefill_chunk_size
        # a preempted request is recomputed from its prompt and the tokens it already produced
        pending = [(r, list(r.prompt_ids) + r.output_ids) for r in reqs]
        rows = {}
        while pending:
            batch, room = [], limit
            for r, toks in pending:
                if room == 0:
                    break
                take = toks[:room]
                batch.append((r, take))
                room -= len(take)
            logits = self.prefill([(r.seq_id, t) for r, t in batch])
            taken = {id(r): len(t) for r, t in batch}
            rest = []
            for (r, toks) in pending:
                left = toks[taken.get(id(r), 0):]
                if left:
                    rest.append((r, left))
            for row, (r, t) in zip(logits, batch):
                if not any(r is q for q, _ in rest):  # prompt finished: first token from here
                    rows[id(r)] = row
                    self._accept(r, sample(row, r.params, r.rng))
            pending = rest
        return rows

    def _accept(self, r: _Request, token: int) -> None:
        r.output_ids.append(token)
        total = len(r.prompt_ids) + len(r.output_ids)
        if (token in r.stop_ids or len(r.output_ids) >= r.max_new_tokens
                or total >= self.context_window):
            r.done = True

    def _text_delta(self, r: _Request) -> str:
        text = self.decode(r.output_ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        delta, r.emitted_text = text[len(r.emitted_text):], text
        return delta

    def stream(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
               ignore_eos: bool = False, n: int = 1):
        """Yield (index, text piece) as tokens are produced, for all prompts at once; with n
        samples per prompt, sample j of prompt i has index i * n + j."""
        for index, _token, piece in self._run(prompts, max_new_tokens, temperature, top_k, top_p,
                                               seed, stop_token_ids, ignore_eos, n=n):
            if piece:
                yield index, piece

    def generate_ids(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stop_token_ids=None, ignore_eos: bool = False, n: int = 1) -> list:
        """Token ids generated for each prompt (a str or a list of token ids). With n > 1, each
        prompt gets n samples (a list of n id lists) that share the prompt's KV pages: the prompt
        is prefilled once and forked; sample j of prompt i draws from seed + i * n + j, so it
        equals an unforked run of that prompt with that seed."""
        out: dict = {}
        for index, token, _ in self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                         stop_token_ids, ignore_eos, text=False, n=n):
            out.setdefault(index, []).append(token)
        count = len(prompts) if isinstance(prompts, list) and not _is_id_list(prompts) else 1
        if n == 1:
            return [out.get(i, []) for i in range(count)]
        return [[out.get(i * n + j, []) for j in range(n)] for i in range(count)]

    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
                 ignore_eos: bool = False, n: int = 1):
        """Generated text: a str for one prompt, a list of str for a list of prompts (with
        n > 1, a list of n str in place of each str)."""
        single = isinstance(prompts, str) or _is_id_list(prompts)
        ids = self.generate_ids(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                stop_token_ids, ignore_eos, n=n)
        texts = [self.decode(x) if n == 1 else [self.decode(y) for y in x] for x in ids]
        return texts[0] if single else texts

    def _run(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids,
             ignore_eos, text=True, n=1):
        if isinstance(prompts, str) or _is_id_list(prompts):
            prompts = [prompts]
        params = SamplingParams(temperature, top_k, top_p, seed)
        params.validate()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not isinstance(n, int) or not 1 <= n <= self.cache.max_batch_size:
            raise ValueError(f"n must be an integer in [1, {self.cache.max_batch_size}] (the max "
                             f"batch size), got {n!r}")
        stop = set(stop_token_ids or []) | (set() if ignore_eos else self.eos_token_ids)
        reqs = []
        for i, p in enumerate(prompts):
            ids = self.encode(p) if isinstance(p, str) else [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= self.context_window:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the context window is "
                                 f"{self.context_window}")
            group = []  # the n samples of one prompt: the first is prefilled, the rest fork from it
            for j in range(n):
                rng = np.random.default_rng(None if seed is None else seed + i * n + j)
                group.append(_Request(i * n + j, ids, max_new_tokens, params, rng, stop))
            reqs.append(group)
        waiting = list(reqs)  # groups, in order; a preempted request comes back as a group of one
        reqs = [r for g in reqs for r in g]
        active: list = []
        try:
            while waiting or active:
                admitted = self._admit(waiting, active)
                if admitted:
                    rows = self._prefill_requests([g[0] for g in admitted])
                    for g in admitted:
                        for child in g[1:]:  # samples share the prompt's pages from here on
                            child.seq_id = self.cache.fork(g[0].seq_id)
                            self._accept(child, sample(rows[id(g[0])], child.params, child.rng))
                        for r in g:
                            yield r.index, r.output_ids[-1], self._text_delta(r) if text else ""
                        active += g
                for r in [r for r in active if r.done]:
                    self.cache.remove(r.seq_id)
                    r.seq_id = -1
                    active.remove(r)
                if not active:
                    continue
                self._make_room(active, waiting)
                logits = self.decode_step([r.seq_id for r in active], [r.output_ids[-1] for r in active])
                for row, r in zip(logits, active):
                    self._accept(r, sample(row, r.params, r.rng))
                    yield r.index, r.output_ids[-1], self._text_delta(r) if text else ""
        finally:
            for r in reqs:
                if r.seq_id in self.cache.sequences:
                    self.cache.remove(r.seq_id)

    def _admit(self, waiting: list, active: list) -> list:
        """Take waiting groups, in order, while batch slots and pages allow; add their sequences.

        A group needs pages for its prompt plus the first generated token, one page per extra
        sample (a fork's own last page), and the running sequences must keep the pages their
        next token needs."""
        cache, ps = self.cache, self.cache.page_size
        slots = cache.max_batch_size - len(active)
        budget = cache.free_pages() - sum(1 for r in active if cache.sequences[r.seq_id] % ps == 0)
        admitted = []
        while waiting and len(waiting[0]) <= slots:
            group = waiting[0]
            length = len(group[0].prompt_ids) + len(group[0].output_ids)
            need = -(-(length + 1) // ps) + len(group) - 1
            if need > budget:
                if not active and not admitted:
                    raise PagePoolFull(
                        f"a {length}-token prompt needs {need} KV pages but the pool has "
                        f"{cache.free_pages()} of {cache.total_pages} (page size {ps}); shorten the "
                        "prompt or build with a larger --max-memory (or --kv-cache-tokens)")
                break
            waiting.pop(0)
            slots -= len(group)
            budget -= need
            for r in group:
                self._admissions += 1
                r.admitted = self._admissions
            group[0].seq_id = cache.add()
            admitted.append(group)
        return admitted

    def _make_room(self, active: list, waiting: list) -> None:
        """Before a decode step: while the pool lacks the pages it needs, preempt the youngest
        running sequence (free its pages) and requeue it first, to be recomputed later."""
        cache = self.cache
        while cache.pages_needed([r.seq_id for r in active], [1] * len(active)) > cache.free_pages():
            if len(active) == 1:
                r = active[0]
                length = cache.sequences[r.seq_id]
                raise PagePoolFull(
                    f"sequence {r.index} reached {length + 1} tokens, more than the KV pool's "
                    f"{cache.total_pages} pages x {cache.page_size} tokens hold; build with a "
                    "larger --max-memory (or --kv-cache-tokens) or a smaller --context-window")
            victim = max(active, key=lambda q: q.admitted)
            cache.remove(victim.seq_id)
            victim.seq_id = -1
            active.remove(victim)
            waiting.insert(0, [victim])
            self.preemptions += 1


def _upload_weights(path: str, table: list, tvm, device) -> list:
    """Copy each weight from the memory-mapped weights.bin into a device tensor, dropping the
    file's pages from this process after each copy (MADV_DONTNEED; they stay in the page cache).
    Without that, every mapped page read stays resident until the map is closed, so loading
    would hold the weights twice at its peak: the mapped file and the copies."""
    import mmap

    host = artifact.load_weights(path, table)
    mapped = getattr(host[0], "_mmap", None) if host else None
    out = []
    for entry, w in zip(table, host):
        out.append(tvm.runtime.tensor(w, device))
        end = (entry["offset"] + entry["nbytes"]) // mmap.PAGESIZE * mmap.PAGESIZE
        if mapped is not None and end and hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_DONTNEED, 0, end)
    return out


def _is_id_list(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, (int, np.integer)) for t in p)
