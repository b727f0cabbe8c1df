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

Scheduling: one scheduler, driven by a step-level API that `generate`/`stream` loop over and
that a server drives directly (continuous batching):

    rids = engine.add([5, 9, 33], max_new_tokens=16)   # queue a prompt (n samples -> n ids)
    events = engine.step()   # admit, prefill <= one chunk, decode all running: TokenEvents
    engine.abort(rids[0])    # drop a request; its pages return at once

The engine is thread-safe: every call that touches the VM or the KV cache holds one lock, and
threads calling `generate` at once share steps (their sequences decode in the same batch).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
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
class TokenEvent:
    """One generated token of one request (or its failure: token -1, error set)."""

    request_id: int
    token: int
    finish_reason: str | None = None  # "stop" (a stop/eos token), "length", "error"
    logprob: float | None = None  # log-probability of `token` (when the request asked)
    top_logprobs: list | None = None  # [(token id, log-probability)], most likely first
    error: Exception | None = None


@dataclass(eq=False)  # compared by identity: requests are found in the queues by `is`
class _Request:
    rid: int
    prompt_ids: list
    max_new_tokens: int
    params: SamplingParams
    rng: np.random.Generator
    stop_ids: set
    logprobs: int | None
    buffer: bool
    seq_id: int = -1
    admitted: int = -1  # admission order: the highest is the youngest
    output_ids: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # tokens still to prefill (the group's leader)
    finish_reason: str | None = None
    events: list = field(default_factory=list)


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
        artifact.check_cpu(self.manifest)
        artifact.check_amx(self.manifest)
        lib = load_module(os.path.join(out_dir, artifact.LIBRARY))
        self.vm = VirtualMachine(lib, self.device)
        self.weights = _upload_weights(os.path.join(out_dir, artifact.WEIGHTS),
                                       self.manifest["params"], tvm, self.device)
        self._tvm = tvm
        self._decode_fn = self.vm["decode"]  # looked up once: a lookup per step costs a microsecond
        self._decode_buffers: dict = {}  # batch size -> the decode inputs (tensors, numpy views)
        self.cache = PagedKVCache(
            self.vm, max_batch_size or kv_cfg["max_batch_size"],
            kv_cache_tokens or kv_cfg["max_total_seq_len"], kv_cfg["prefill_chunk_size"],
            kv_cfg["page_size"], kv_cfg.get("sliding_window", 0))
        self.context_window = kv_cfg["context_window"]
        self.preemptions = 0  # sequences preempted (and recomputed) because the pool was full
        self._admissions = 0
        self._tokenizer = None
        tok = self.manifest["tokenizer"]
        self.eos_token_ids = set(tok.get("eos_token_ids") or [])
        self.add_bos = bool(tok.get("add_bos"))
        self.bos_token_id = tok.get("bos_token_id")
        self.vocab_size = int(self.manifest["model"]["vocab_size"])
        self._lock = threading.RLock()  # one VM, one KV cache: one caller at a time
        self._waiting: list = []  # groups (the n samples of a prompt), in arrival order
        self._prefilling: list = []  # admitted groups whose prompt is not all in the cache yet
        self._running: list = []  # requests decoding one token per step
        self._requests: dict = {}  # request id -> _Request, until its last event is taken
        self._next_rid = 0
        # Prompt tokens prefilled per step while other sequences decode. None (the default):
        # as many as fit in `prefill_step_ratio` of a decode step's measured time, so a step that
        # also prefills is at most that much longer than one that only decodes (the running
        # sequences' inter-token latency stays even); an int fixes the count (the build's
        # prefill chunk size: a whole chunk per step, the fastest time to first token).
        self.decode_prefill_tokens: int | None = None
        self.prefill_step_ratio = 1.0
        # While a prompt is prefilled, the running sequences' next tokens ride in the same
        # prefill call (one pass over the weights, one VM call); False: a separate decode call.
        self.mixed_steps = True
        self._decode_seconds: dict = {}  # batch size -> EMA of a decode call's seconds
        # EMA of seconds per token of prefill calls of at least PREFILL_TIMING_TOKENS tokens:
        # what one more token costs a call, once the call's fixed cost (a pass over the
        # weights) is spread over many
        self._prefill_token_seconds: float | None = None
        self._update_stats()

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

    def check_token_ids(self, ids) -> list:
        """A prompt of token ids as ints, each in [0, vocab_size): anything else is a UserError
        (an out-of-range id would read outside the embedding table)."""
        out = []
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise UserError(f"token id {t!r} is not an integer; token ids are integers in "
                                f"[0, {self.vocab_size}) (the vocabulary size is {self.vocab_size})")
            if not 0 <= int(t) < self.vocab_size:
                raise UserError(f"token id {int(t)} is out of range: the vocabulary size is "
                                f"{self.vocab_size}, so ids must be in [0, {self.vocab_size - 1}]")
            out.append(int(t))
        return out

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        """The low-level calls' guard: ids outside the vocabulary never reach the kernels."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
            self.check_token_ids([bad])
        return ids

    def decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -------------------------------------------------------------- model calls
    def _tensor(self, arr):
        return self._tvm.runtime.tensor(arr, self.device)

    def prefill(self, chunks: list) -> np.ndarray:
        """chunks: [(seq_id, token ids)] -> last-token logits per chunk, shape (len(chunks), vocab).
        The caller keeps the total under the prefill chunk size."""
        with self._lock:
            return self._prefill(chunks)

    def _prefill(self, chunks: list) -> np.ndarray:
        seq_ids = [sid for sid, _ in chunks]
        lengths = [len(t) for _, t in chunks]
        starts = [self.cache.sequences[sid] for sid in seq_ids]
        ids = self._checked(np.concatenate([np.asarray(t, dtype="int64") for _, t in chunks]))[None]
        pos = np.concatenate([np.arange(s, s + n, dtype="int64") for s, n in zip(starts, lengths)])[None]
        last = np.cumsum(lengths, dtype="int64") - 1
        return self.prefill_positions(seq_ids, lengths, ids, pos, last)[0]

    def prefill_positions(self, seq_ids, lengths, ids, pos, logit_positions) -> np.ndarray:
        """Low-level prefill: explicit positions and the token indices to return logits for."""
        total, chunk = int(sum(lengths)), self.cache.prefill_chunk_size
        if total > chunk:  # the prefill's activation memory is planned for one chunk
            raise UserError(f"one prefill call got {total} tokens but this build's prefill chunk is "
                            f"{chunk}; split the prompt into chunks of at most {chunk} tokens "
                            "(generate/add do this), or rebuild with a larger --prefill-chunk-size")
        with self._lock:
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
        with self._lock:
            vocab = self.vocab_size
            for t in tokens:  # the ids' range check in Python: numpy's min/max cost ~3 us
                if not 0 <= t < vocab:
                    self._checked(np.asarray(tokens, dtype="int64"))  # raises, naming the id
            pos = [self.cache.sequences[s] for s in seq_ids]
            self.cache.begin_decode(seq_ids)
            try:
                out = self._decode_fn(*self._decode_inputs(tokens, pos), self.cache.handle,
                                      *self.weights)
            finally:
                self.cache.end()
            return _host_rows(out)

    def _decode_inputs(self, tokens, pos: list) -> tuple:
        """The decode call's (input ids, positions) tensors, both (batch, 1) int64. On the CPU
        they are kept per batch size and written in place through numpy views (called under
        the lock): creating two small tensors per step cost more host time than many of the
        step's kernels. Other devices: fresh tensors (a copy to the device either way)."""
        if self.device.dlpack_device_type() != 1:  # not the CPU (kDLCPU)
            return (self._tensor(np.asarray(tokens, dtype="int64")[:, None]),
                    self._tensor(np.asarray(pos, dtype="int64")[:, None]))
        held = self._decode_buffers.get(len(pos))
        if held is None:
            tensors = (self._tensor(np.zeros((len(pos), 1), "int64")),
                       self._tensor(np.zeros((len(pos), 1), "int64")))
            held = self._decode_buffers[len(pos)] = (tensors, [np.from_dlpack(t) for t in tensors])
        tensors, (ids_view, pos_view) = held
        ids_view[:, 0] = tokens
        pos_view[:, 0] = pos
        return tensors

    def hidden_states(self, token_ids) -> tuple:
        with self._lock:
            return self._hidden_states(token_ids)

    def _hidden_states(self, token_ids) -> tuple:
        """One sequence through the compiled `hidden_states` function (prefill's kernels and
        weights, also returning what each layer produced): (logits (n, vocab), hidden states
        (k, n, hidden)) as float32 numpy, for every position of `token_ids`. The states are the
        embedding output, each decoder layer's output and the final norm's (tvm-llm verify).
        A prompt longer than the prefill chunk size runs in chunks over the KV cache."""
        if not self.vm.module.implements_function("hidden_states"):
            raise UserError(f"{self.out_dir}: the build has no hidden_states function (built by "
                            "an older tvm_llm); rebuild it to verify it")
        ids = self.check_token_ids(token_ids)
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

    # -------------------------------------------------------------- step-level API
    def add(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
            ignore_eos: bool = False, n: int = 1, logprobs: int | None = None,
            buffer: bool = True) -> list:
        """Queue one prompt (a str or a list of token ids) for generation; returns the ids of its
        n requests (samples). Nothing runs until `step`. Sample j draws from seed + j.
        logprobs: also report each chosen token's log-probability and that many top alternatives.
        buffer: keep each request's events for `events` (the thin loops); a caller that consumes
        what `step` returns (the server's scheduler) passes False."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        params.validate()
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not isinstance(n, int) or not 1 <= n <= self.cache.max_batch_size:
            raise ValueError(f"n must be an integer in [1, {self.cache.max_batch_size}] (the max "
                             f"batch size), got {n!r}")
        ids = self.encode(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.context_window:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context window is "
                             f"{self.context_window}")
        stop = set(stop_token_ids or []) | (set() if ignore_eos else self.eos_token_ids)
        with self._lock:
            group = []  # the n samples of one prompt: the first is prefilled, the rest fork from it
            for j in range(n):
                rng = np.random.default_rng(None if seed is None else seed + j)
                self._next_rid += 1
                r = _Request(self._next_rid, list(ids), int(max_new_tokens), params, rng, stop,
                             logprobs, buffer)
                self._requests[r.rid] = r
                group.append(r)
            self._waiting.append(group)
            self._update_stats()
        return [r.rid for r in group]

    def abort(self, rid: int) -> None:
        """Drop a request wherever it is (waiting, prefilling, running); its pages return now.
        Unknown or finished ids are ignored."""
        with self._lock:
            r = self._requests.pop(rid, None)
            if r is None or r.finish_reason is not None:
                return
            r.finish_reason = "abort"
            for g in self._waiting:
                if r in g:
                    g.remove(r)
            self._waiting = [g for g in self._waiting if g]
            for g in self._prefilling:
                if r in g and g[0] is not r:
                    g.remove(r)
            if r in self._running:
                self._running.remove(r)
                self._free(r)
            # a prefilling leader stays until its prompt is in the cache if samples fork from it;
            # a group with no live sample left is dropped with its pages
            kept = []
            for g in self._prefilling:
                if _all_aborted(g):
                    self._free(g[0])
                else:
                    kept.append(g)
            self._prefilling = kept
            self._update_stats()

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._running)

    def step(self) -> list:
        """One scheduler iteration: admit waiting prompts while slots and pages allow, prefill at
        most one chunk (packed from the admitted prompts; while sequences decode, only as many
        tokens as `decode_prefill_tokens` or the measured time budget allow, so a long prompt
        holds running sequences up by a slice of a step), and decode every running sequence:
        in the same prefill call as the prompt tokens when there are any (`mixed_steps`),
        else in one batched decode call. Finished sequences free their pages at once. Returns the
        events of this step: one TokenEvent per produced token, and error events for requests
        that can never fit the page pool (PagePoolFull; they are dropped)."""
        with self._lock:
            events: list = []
            self._admit(events)
            if self._running:
                self._make_room(events)
            running = list(self._running)
            mixed = self.mixed_steps and 0 < len(running) < self.cache.prefill_chunk_size
            batch = self._prefill_batch(len(running), mixed)
            if batch and mixed:
                self._mixed_step(batch, running, events)
            else:
                if batch:
                    self._prefill_groups(batch, events)
                self._retire()
                if self._running:
                    self._make_room(events)
                if self._running:
                    running = list(self._running)
                    t0 = time.perf_counter()
                    logits = self.decode_step([r.seq_id for r in running],
                                              [r.output_ids[-1] for r in running])
                    _ema_into(self._decode_seconds, len(running), time.perf_counter() - t0)
                    self._accept_rows(running, logits, events)
            self._retire()
            for e in events:
                r = self._requests.get(e.request_id)
                if r is not None and r.buffer:
                    r.events.append(e)
                if e.finish_reason is not None and r is not None and not r.buffer:
                    del self._requests[e.request_id]
            self._update_stats()
            return events

    def events(self, rid: int) -> list:
        """Take the buffered events of a request (stepping once if it has none yet and is not
        finished); a finished request is forgotten once its last event is taken."""
        with self._lock:
            r = self._requests.get(rid)
            if r is None:
                return []
            if not r.events and r.finish_reason is None:
                self.step()
            out, r.events = r.events, []
            if r.finish_reason is not None and not r.events:
                self._requests.pop(rid, None)
            return out

    # -------------------------------------------------------------- generation (loops over step)
    def stream(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids=None,
               ignore_eos: bool = False, n: int = 1):
        """Yield (index, text piece) as tokens are produced, for all prompts at once; with n
        samples per prompt, sample j of prompt i has index i * n + j."""
        texts: dict = {}
        for index, event in self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                      stop_token_ids, ignore_eos, n):
            ids, emitted = texts.setdefault(index, ([], [""]))
            ids.append(event.token)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
                continue
            piece, emitted[0] = text[len(emitted[0]):], text
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
        for index, event in self._run(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                      stop_token_ids, ignore_eos, n):
            out.setdefault(index, []).append(event.token)
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
             ignore_eos, n):
        """Add every prompt, then step until all its requests finish: yields (index, TokenEvent).
        Other threads' requests share the steps (and batches); each takes only its own events."""
        if isinstance(prompts, str) or _is_id_list(prompts):
            prompts = [prompts]
        # check every prompt before queueing any, so a bad one leaves nothing behind
        checked = []
        for i, p in enumerate(prompts):
            try:
                ids = self.encode(p) if isinstance(p, str) else self.check_token_ids(p)
            except UserError as e:
                raise UserError(f"prompt {i}: {e}") from None
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= self.context_window:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the context window is "
                                 f"{self.context_window}")
            checked.append(ids)
        index = {}
        try:
            for i, ids in enumerate(checked):
                rids = self.add(ids, max_new_tokens, temperature, top_k, top_p,
                                None if seed is None else seed + i * n, stop_token_ids, ignore_eos, n)
                for j, rid in enumerate(rids):
                    index[rid] = i * n + j
            live = list(index)
            while live:
                for rid in list(live):
                    evs = self.events(rid)
                    if not evs and rid not in self._requests:  # aborted elsewhere
                        live.remove(rid)
                    for e in evs:
                        if e.error is not None:
                            raise e.error
                        yield index[rid], e
                        if e.finish_reason is not None:
                            live.remove(rid)
        finally:
            for rid in index:
                self.abort(rid)

    # -------------------------------------------------------------- scheduling (under the lock)
    def _admit(self, events: list) -> None:
        """Take waiting groups, in order, while batch slots and pages allow; add their sequences.

        A group needs pages for its prompt plus the first generated token, one page per extra
        sample (a fork's own last page); running sequences keep the pages their next token needs
        and prefilling ones the pages their prompt still needs. A group that cannot fit even in
        an idle engine fails with PagePoolFull."""
        cache, ps = self.cache, self.cache.page_size
        slots = cache.max_batch_size - len(self._running) - sum(len(g) for g in self._prefilling)
        budget = cache.free_pages() - self._reserved_pages()
        while self._waiting and len(self._waiting[0]) <= slots:
            group = self._waiting[0]
            length = len(group[0].prompt_ids) + len(group[0].output_ids)
            need = cache.pages_to_grow(0, length + 1) + self._sample_pages(group, length)
            if need > budget:
                if self._running or self._prefilling:
                    break
                self._waiting.pop(0)
                err = PagePoolFull(
                    f"a {length}-token prompt needs {need} KV pages but the pool has "
                    f"{cache.free_pages()} of {cache.total_pages} (page size {ps}); shorten the "
                    "prompt or build with a larger --max-memory (or --kv-cache-tokens)")
                for r in group:
                    events.append(self._fail(r, err))
                continue
            self._waiting.pop(0)
            slots -= len(group)
            budget -= need
            for r in group:
                self._admissions += 1
                r.admitted = self._admissions
            lead = group[0]
            lead.seq_id = cache.add()
            lead.pending = list(lead.prompt_ids) + lead.output_ids
            self._prefilling.append(group)

    def _reserved_pages(self) -> int:
        """Pages the running sequences' next token and the prefilling prompts still need."""
        cache = self.cache
        need = cache.pages_needed([r.seq_id for r in self._running], [1] * len(self._running))
        for g in self._prefilling:
            have = cache.sequences[g[0].seq_id]
            need += (cache.pages_needed([g[0].seq_id], [len(g[0].pending) + 1])
                     + self._sample_pages(g, have + len(g[0].pending)))
        return need

    def _sample_pages(self, group: list, length: int) -> int:
        """Pages the samples after the first take once its prompt (`length` tokens) is in: a
        fork's own last page each, or, in a sliding-window cache (no forks), the prompt's."""
        if self.cache.sliding_window:
            return (len(group) - 1) * self.cache.pages_to_grow(0, length + 1)
        return len(group) - 1

    def _step_prefill_room(self, decoding: int) -> int:
        """Prompt tokens this step may prefill while `decoding` sequences decode in it."""
        chunk = self.cache.prefill_chunk_size
        if not decoding:
            return chunk
        if self.decode_prefill_tokens:
            return min(chunk, self.decode_prefill_tokens)
        per_token = self._prefill_token_seconds
        decode = self._decode_estimate(decoding)
        if per_token is None or decode is None:  # nothing measured yet: a whole chunk
            return chunk
        # each decoding sequence concedes `ratio` of its step to prefill; with more sequences
        # prefilling than decoding (a burst of arrivals), scale up: holding many prompts back to
        # spare a few running sequences would keep the batch small for many steps
        waiting = sum(len(g) for g in self._prefilling) + sum(len(g) for g in self._waiting)
        share = max(1.0, waiting / decoding)
        return max(1, min(chunk, int(self.prefill_step_ratio * share * decode / per_token)))

    def _decode_estimate(self, batch: int) -> float | None:
        """Seconds of a decode step of `batch` sequences: measured, else the nearest measured
        batch's plus (or minus) a prefill token's cost per row of difference."""
        if batch in self._decode_seconds:
            return self._decode_seconds[batch]
        if not self._decode_seconds or self._prefill_token_seconds is None:
            return None
        near = min(self._decode_seconds, key=lambda k: abs(k - batch))
        return max(self._decode_seconds[near] + (batch - near) * self._prefill_token_seconds,
                   self._decode_seconds[near] * min(1.0, batch / near))

    def _prefill_batch(self, decoding: int, mixed: bool) -> list:
        """[(group, prompt tokens)] to prefill this step, oldest group first, within the step's
        room (and, when the decoding sequences share the call, the prefill chunk size)."""
        room = self._step_prefill_room(decoding)
        if mixed:
            room = min(room, self.cache.prefill_chunk_size - decoding)
        batch = []
        for g in self._prefilling:
            if room <= 0:
                break
            take = g[0].pending[:room]
            batch.append((g, take))
            room -= len(take)
        return batch

    def _prefill_groups(self, batch: list, events: list) -> None:
        """Prefill the batch's tokens in one call (several prompts' chunks, ragged)."""
        t0 = time.perf_counter()
        logits = self.prefill([(g[0].seq_id, take) for g, take in batch])
        self._time_prefill(sum(len(take) for _, take in batch), time.perf_counter() - t0)
        self._finish_prefill(batch, logits, events)

    def _time_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= min(PREFILL_TIMING_TOKENS, self.cache.prefill_chunk_size):
            self._prefill_token_seconds = _ema(self._prefill_token_seconds, seconds / tokens)

    def _mixed_step(self, batch: list, running: list, events: list) -> None:
        """One prefill call for the batch's prompt chunks and each running sequence's next token
        (a one-token chunk at its position): the prompt rides on the decode's pass over the
        weights instead of a pass of its own."""
        chunks = [(g[0].seq_id, take) for g, take in batch]
        chunks += [(r.seq_id, [r.output_ids[-1]]) for r in running]
        t0 = time.perf_counter()
        logits = self.prefill(chunks)
        seconds = time.perf_counter() - t0
        n = sum(len(take) for _, take in batch)
        self._time_prefill(len(running) + n, seconds)
        if self._prefill_token_seconds is not None:  # the decode's share of the call
            decode = min(seconds, max(0.3 * seconds, seconds - n * self._prefill_token_seconds))
            _ema_into(self._decode_seconds, len(running), decode)
        self._accept_rows(running, logits[len(batch):], events)
        self._finish_prefill(batch, logits[:len(batch)], events)

    def _finish_prefill(self, batch: list, logits: np.ndarray, events: list) -> None:
        """Advance each group past the tokens just prefilled; a group whose prompt is complete
        samples its first tokens (forking its other samples) and runs."""
        for row, (g, take) in zip(logits, batch):
            lead = g[0]
            lead.pending = lead.pending[len(take):]
            if lead.pending:
                continue
            self._prefilling.remove(g)
            for child in g[1:]:  # samples share the prompt's pages from here on
                child.seq_id = self._fork_or_prefill(lead)
            for r in g:
                if r.finish_reason == "abort":
                    continue
                events.append(self._accept(r, row))
                self._running.append(r)
            if lead.finish_reason == "abort":
                self._free(lead)

    def _fork_or_prefill(self, lead: _Request) -> int:
        """A sequence holding `lead`'s prompt: a fork sharing its pages, or in a sliding-window
        cache (which keeps only the window, so cannot fork) the prompt prefilled again."""
        if not self.cache.sliding_window:
            return self.cache.fork(lead.seq_id)
        sid = self.cache.add()
        ids = list(lead.prompt_ids) + lead.output_ids
        for i in range(0, len(ids), self.cache.prefill_chunk_size):
            self.prefill([(sid, ids[i:i + self.cache.prefill_chunk_size])])
        return sid

    def _accept_rows(self, requests: list, logits: np.ndarray, events: list) -> None:
        """One token per request from its row of logits; greedy rows share one argmax call."""
        greedy = logits.argmax(axis=1) if any(r.params.temperature == 0 for r in requests) else None
        for i, r in enumerate(requests):
            events.append(self._accept(r, logits[i], None if greedy is None else int(greedy[i])))

    def _accept(self, r: _Request, row: np.ndarray, greedy: int | None = None) -> "TokenEvent":
        if greedy is not None and r.params.temperature == 0:
            token = greedy
        else:
            token = sample(row, r.params, r.rng)
        r.output_ids.append(token)
        logprob = top = None
        if r.logprobs is not None:
            z = row.astype(np.float64)
            lse = z.max() + np.log(np.exp(z - z.max()).sum())
            logprob = float(z[token] - lse)
            if r.logprobs > 0:
                best = np.argpartition(-z, r.logprobs)[: r.logprobs] if r.logprobs < z.size else np.arange(z.size)
                best = best[np.argsort(-z[best], kind="stable")]
                top = [(int(t), float(z[t] - lse)) for t in best]
        total = len(r.prompt_ids) + len(r.output_ids)
        if token in r.stop_ids:
            r.finish_reason = "stop"
        elif len(r.output_ids) >= r.max_new_tokens or total >= self.context_window:
            r.finish_reason = "length"
        return TokenEvent(r.rid, token, r.finish_reason, logprob, top)

    def _fail(self, r: _Request, err: Exception) -> "TokenEvent":
        r.finish_reason = "error"
        return TokenEvent(r.rid, -1, "error", error=err)

    def _free(self, r: _Request) -> None:
        if r.seq_id in self.cache.sequences:
            self.cache.remove(r.seq_id)
        r.seq_id = -1

    def _retire(self) -> None:
        for r in [r for r in self._running if r.finish_reason is not None]:
            self._free(r)
            self._running.remove(r)

    def _make_room(self, events: list) -> None:
        """Before a decode step: while the pool lacks the pages the running sequences' next token
        and the prefilling prompts need, preempt the youngest sequence (free its pages) and
        requeue it first, to be recomputed later. A lone sequence that outgrows the pool fails."""
        cache = self.cache
        while self._running and self._reserved_pages() > cache.free_pages():
            if len(self._running) == 1 and not self._prefilling:
                r = self._running.pop()
                length = cache.sequences[r.seq_id]
                self._free(r)
                events.append(self._fail(r, PagePoolFull(
                    f"sequence {r.rid} reached {length + 1} tokens, more than the KV pool's "
                    f"{cache.total_pages} pages x {cache.page_size} tokens hold; build with a "
                    "larger --max-memory (or --kv-cache-tokens) or a smaller --context-window")))
                return
            young_run = max(self._running, key=lambda q: q.admitted, default=None)
            young_pre = max(self._prefilling, key=lambda g: g[0].admitted, default=None)
            if young_pre is not None and (young_run is None or young_pre[0].admitted > young_run.admitted):
                self._prefilling.remove(young_pre)
                self._free(young_pre[0])
                group = [r for r in young_pre if r.finish_reason is None]
            else:
                self._running.remove(young_run)
                self._free(young_run)
                group = [young_run]
            if group:
                self._waiting.insert(0, group)
            self.preemptions += 1

    def _update_stats(self) -> None:
        self.stats = {"running": len(self._running),
                      "prefilling": sum(len(g) for g in self._prefilling),
                      "waiting": sum(len(g) for g in self._waiting),
                      "kv_pages_free": self.cache.free_pages(),
                      "kv_pages_total": self.cache.total_pages,
                      "preemptions": self.preemptions}


def _upload_weights(path: str, table: list, tvm, device) -> list:
    """Copy each weight from the memory-mapped weights.bin into a device tensor, dropping the
    file's pages from this process after each copy (MADV_DONTNEED; they stay in the page cache).
    Without that, every mapped page read stays resident until the map is closed, so loading
    would hold the weights twice at its peak: the mapped file and the copies. On the CPU the
    copies share one arena on transparent huge pages (`_huge_page_arena`)."""
    import mmap

    host = artifact.load_weights(path, table)
    mapped = getattr(host[0], "_mmap", None) if host else None
    # the arena mirrors the file's layout (artifact.save_weights: parameter order, each weight
    # at an artifact.ALIGN-byte offset), so every weight keeps that alignment
    size = table[-1]["offset"] + table[-1]["nbytes"] if table else 0
    arena = _huge_page_arena(size) if device.dlpack_device_type() == 1 and table else None
    out = []
    for entry, w in zip(table, host):
        if arena is not None:
            region = arena[entry["offset"]: entry["offset"] + entry["nbytes"]]
            region[...] = np.ascontiguousarray(w).reshape(-1).view(np.uint8)
            out.append(tvm.runtime.from_dlpack(region)._create_view(tuple(entry["shape"]),
                                                                    entry["dtype"]))
        else:
            out.append(tvm.runtime.tensor(w, device))
        end = (entry["offset"] + entry["nbytes"]) // mmap.PAGESIZE * mmap.PAGESIZE
        if mapped is not None and end and hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_DONTNEED, 0, end)
    return out


def _huge_page_arena(nbytes: int):
    """One private anonymous mapping for all the weights, advised onto transparent huge pages
    (MADV_HUGEPAGE, before anything touches it; most Linux kernels give THP only where asked),
    as a numpy uint8 array; None where that is unavailable or TVM_LLM_HUGE_PAGES=0 (an A/B
    switch), and the weights are then allocated one by one on ordinary pages.

    A decode step streams every weight once: on 4 KiB pages each 4 KiB is a TLB miss and a
    point where the hardware prefetchers stop. llama-110m, 1 thread, CPU time per decode step,
    interleaved in one process, both load orders (machine shared): fp32 -13% to -16% against
    huge pages for the large tensors alone (-5% to -20% for those against none), q4 -8% to
    -17% against none (its packed matrices are under 2 MiB each: only one arena covers them)."""
    import mmap

    if os.environ.get("TVM_LLM_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP refused: ordinary pages, still one mapping
    return np.frombuffer(region, dtype=np.uint8)


def _host_rows(out) -> np.ndarray:
    """Decode logits (batch, 1, vocab) on the host as float32 (batch, vocab), an array the
    caller owns. A float32 CPU result is the VM's own output through DLPack, no copy: the array
    holds the tensor (each call allocates a new output, which returns to the VM's pool only
    when the array is gone), and a copy of llama's 32000 logits cost ~4 us a step. Others
    through numpy()."""
    if out.dtype == "float32" and out.device.dlpack_device_type() == 1:
        return np.from_dlpack(out)[:, 0]
    return out.numpy()[:, 0].astype(np.float32, copy=False)


PREFILL_TIMING_TOKENS = 32  # prefill calls this long time the per-token cost


def _ema(old: float | None, value: float, weight: float = 0.2) -> float:
    return value if old is None else (1 - weight) * old + weight * value


def _ema_into(table: dict, key, value: float) -> None:
    table[key] = _ema(table.get(key), value)


def _is_id_list(p) -> bool:
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(t, (int, np.integer)) for t in p)


def _all_aborted(group: list) -> bool:
    return all(r.finish_reason == "abort" for r in group)
