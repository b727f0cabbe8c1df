"""The paged KV cache at run time: one page pool shared by every sequence.

A thin, explicit wrapper over TVM's runtime KV-state functions: sequences are added, forked
(sharing their parent's pages), stepped (begin/end forward around each model call) and removed
(their pages return to the pool).

Page accounting is checked here, before TVM is called, and exactly: when TVM's runtime runs
out of pages inside `kv_state_begin_forward` or `kv_state_fork_sequence` it raises only after
it has already grown the sequences and taken pages (the cache is left inconsistent), so that
must never be reached. A sequence of n tokens owns ceil(n / page_size) pages of its last block
(blocks before it are whole pages, shared after a fork); a fork at a length that is not a
page multiple copies the parent's partial last page into one new page.

Sliding windows: when every layer of the model attends only to its last `sliding_window` tokens
(the manifest says so), each sequence is enabled for TVM's sliding window, so the pages behind
the window are returned to the pool as the sequence grows: a sequence holds at most
ceil(window / page_size) + 1 pages, whatever its length. The cache then keeps the window's
tokens only, so such a sequence cannot be forked (TVM refuses): `fork` raises, and the engine
prefills each sample on its own instead.
"""
from __future__ import annotations


class PagePoolFull(RuntimeError):
    """The pool has no free page (or no sequence slot) for the request; nothing was changed."""

_GROW = "build with a larger --max-memory (or --kv-cache-tokens)"


class PagedKVCache:
    def __init__(self, vm, max_batch_size: int, max_total_seq_len: int, prefill_chunk_size: int,
                 page_size: int, sliding_window: int = 0):
        import tvm
        from tvm_ffi import Shape

        self._f = {name: tvm.get_global_func(f"vm.builtin.{name}") for name in (
            "kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence",
            "kv_state_begin_forward", "kv_state_end_forward", "kv_state_popn",
            "attention_kv_cache_get_num_available_pages",
            "attention_kv_cache_get_total_sequence_length",
            "attention_kv_cache_enable_sliding_window_for_seq")}
        self._shape = Shape
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_total_seq_len = max_total_seq_len
        self.prefill_chunk_size = prefill_chunk_size
        self.sliding_window = int(sliding_window)  # 0: sequences keep all their pages
        self.handle = vm["create_paged_kv_cache"](
            Shape([max_batch_size]), Shape([max_total_seq_len]), Shape([prefill_chunk_size]),
            Shape([page_size]), Shape([1 if self.sliding_window else 0]))
        self.sequences: dict = {}  # seq id -> length in tokens
        # sliding sequences: seq id -> (tokens kept, offset of the first kept one in its page)
        self._kept: dict = {}
        self._next_id = 0
        self._ones: dict = {}  # batch size -> Shape([1] * batch), begin_decode's lengths
        self.total_pages = self.free_pages()

    def free_pages(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def add(self) -> int:
        self._check_slot()
        sid = self._new_id()
        self._f["kv_state_add_sequence"](self.handle, sid)
        self.sequences[sid] = 0
        if self.sliding_window:
            self._f["attention_kv_cache_enable_sliding_window_for_seq"](
                self.handle, sid, self.sliding_window, 0)
            self._kept[sid] = (0, 0)
        return sid

    def fork(self, parent: int) -> int:
        """A new sequence sharing all of `parent`'s tokens (and pages) so far."""
        if parent not in self.sequences:
            raise ValueError(f"fork: no sequence {parent} in the KV cache")
        if self.sliding_window:
            raise ValueError("fork: sequences of a sliding-window cache keep only their window; "
                             "prefill the sample as a sequence of its own")
        self._check_slot()
        need = self.fork_pages(parent)
        if need > self.free_pages():
            raise PagePoolFull(f"KV cache full: forking sequence {parent} needs {need} page, 0 free "
                               f"of {self.total_pages}; finish some sequences or {_GROW}")
        sid = self._new_id()
        self._f["kv_state_fork_sequence"](self.handle, parent, sid, -1)
        self.sequences[sid] = self.sequences[parent]
        return sid

    def remove(self, sid: int) -> None:
        self._f["kv_state_remove_sequence"](self.handle, sid)
        del self.sequences[sid]
        self._kept.pop(sid, None)

    def fork_pages(self, parent: int) -> int:
        """Pages a fork of `parent` takes: its partial last page is copied for the child."""
        return 1 if self.sequences[parent] % self.page_size else 0

    def used_pages(self) -> int:
        return self.total_pages - self.free_pages()

    def _check_slot(self) -> None:
        if len(self.sequences) >= self.max_batch_size:
            raise PagePoolFull(f"the KV cache holds at most {self.max_batch_size} sequences "
                               "(--max-batch-size); finish or remove one first")

    def pages_needed(self, seq_ids: list, lengths: list) -> int:
        need = 0
        for sid, n in zip(seq_ids, lengths):
            if sid in self._kept:
                need += max(0, self._slide(*self._kept[sid], n)[2])
                continue
            have = self.sequences[sid]
            need += -(-(have + n) // self.page_size) - -(-have // self.page_size)
        return need

    def pages_to_grow(self, have: int, n: int) -> int:
        """Pages a sequence of `have` tokens (not forked, not yet slid) takes to append n more."""
        if self.sliding_window:
            kept = min(have, self.sliding_window)
            offset = 0 if have <= self.sliding_window else (have - self.sliding_window) % self.page_size
            return max(0, self._slide(kept, offset, n)[2])
        return -(-(have + n) // self.page_size) - -(-have // self.page_size)

    def _slide(self, kept: int, offset: int, n: int):
        """(kept, offset, page change) after appending n tokens to a sliding sequence, as TVM's
        cache does it (pages grow for the new tokens, then the fully slid-out ones are freed;
        pages borrowed for a moment while the pool is empty are taken back the same step)."""
        ps, before = self.page_size, -(-(offset + kept) // self.page_size)
        kept += n
        if kept > self.sliding_window:
            offset = (offset + kept - self.sliding_window) % ps
            kept = self.sliding_window
        return kept, offset, -(-(offset + kept) // ps) - before

    def begin(self, seq_ids: list, lengths: list) -> None:
        if len(set(seq_ids)) != len(seq_ids) or any(s not in self.sequences for s in seq_ids):
            raise ValueError(f"begin: unknown or repeated sequence ids {list(seq_ids)}")
        if any(int(n) < 1 for n in lengths):
            raise ValueError(f"begin: every sequence must append at least one token, got {list(lengths)}")
        need = self.pages_needed(seq_ids, lengths)
        if need > self.free_pages():
            raise PagePoolFull(f"KV cache full: {need} more pages needed, {self.free_pages()} free "
                               f"of {self.total_pages} (page size {self.page_size}); finish some "
                               f"sequences or {_GROW}")
        self._f["kv_state_begin_forward"](self.handle, self._shape(seq_ids), self._shape(lengths))
        for sid, n in zip(seq_ids, lengths):
            self.sequences[sid] += n
            if sid in self._kept:
                self._kept[sid] = self._slide(*self._kept[sid], n)[:2]

    def begin_decode(self, seq_ids: list) -> None:
        """begin(seq_ids, [1] * len(seq_ids)), the decode step's case, with fewer host calls:
        the page check asks TVM for the free pages only when a sequence needs a new page, and
        the lengths' shape is built once per batch size."""
        if len(set(seq_ids)) != len(seq_ids) or any(s not in self.sequences for s in seq_ids):
            raise ValueError(f"begin: unknown or repeated sequence ids {list(seq_ids)}")
        if self._kept:
            return self.begin(seq_ids, [1] * len(seq_ids))
        ps = self.page_size
        need = sum(1 for s in seq_ids if self.sequences[s] % ps == 0)
        if need and need > self.free_pages():
            raise PagePoolFull(f"KV cache full: {need} more pages needed, {self.free_pages()} free "
                               f"of {self.total_pages} (page size {self.page_size}); finish some "
                               f"sequences or {_GROW}")
        ones = self._ones.get(len(seq_ids))
        if ones is None:
            ones = self._ones[len(seq_ids)] = self._shape([1] * len(seq_ids))
        self._f["kv_state_begin_forward"](self.handle, self._shape(seq_ids), ones)
        for sid in seq_ids:
            self.sequences[sid] += 1

    def end(self) -> None:
        self._f["kv_state_end_forward"](self.handle)

    def _new_id(self) -> int:
        sid = self._next_id
        self._next_id += 1
        return sid
