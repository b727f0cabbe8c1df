"""The paged KV cache at run time: one page pool shared by every sequence.

A thin, explicit wrapper over TVM's runtime KV-state functions: sequences are added, forked
(sharing their parent's pages), stepped (begin/end forward around each model call) and removed
(their pages return to the pool).
"""
from __future__ import annotations


class PagePoolFull(RuntimeError):
    """The pool has no free page for the requested tokens."""


class PagedKVCache:
    def __init__(self, vm, max_batch_size: int, max_total_seq_len: int, prefill_chunk_size: int,
                 page_size: int):
        import tvm
        from tvm_ffi import Shape

        self._f = {name: tvm.get_global_func(f"vm.builtin.{name}") for name in (
            "kv_state_add_sequence", "kv_state_remove_sequence", "kv_state_fork_sequence",
            "kv_state_begin_forward", "kv_state_end_forward", "kv_state_popn",
            "attention_kv_cache_get_num_available_pages",
            "attention_kv_cache_get_total_sequence_length")}
        self._shape = Shape
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_total_seq_len = max_total_seq_len
        self.prefill_chunk_size = prefill_chunk_size
        self.handle = vm["create_paged_kv_cache"](
            Shape([max_batch_size]), Shape([max_total_seq_len]), Shape([prefill_chunk_size]),
            Shape([page_size]), Shape([0]))
        self.sequences: dict = {}  # seq id -> length in tokens
        self._next_id = 0
        self.total_pages = self.free_pages()

    def free_pages(self) -> int:
        return int(self._f["attention_kv_cache_get_num_available_pages"](self.handle))

    def add(self) -> int:
        if len(self.sequences) >= self.max_batch_size:
            raise PagePoolFull(f"the KV cache holds at most {self.max_batch_size} sequences; "
                               "finish or remove one first")
        sid = self._new_id()
        self._f["kv_state_add_sequence"](self.handle, sid)
        self.sequences[sid] = 0
        return sid

    def fork(self, parent: int) -> int:
        """A new sequence sharing all of `parent`'s tokens (and pages) so far."""
        sid = self._new_id()
        self._f["kv_state_fork_sequence"](self.handle, parent, sid, -1)
        self.sequences[sid] = self.sequences[parent]
        return sid

    def remove(self, sid: int) -> None:
        self._f["kv_state_remove_sequence"](self.handle, sid)
        del self.sequences[sid]

    def pages_needed(self, seq_ids: list, lengths: list) -> int:
        need = 0
        for sid, n in zip(seq_ids, lengths):
            have = self.sequences[sid]
            need += -(-(have + n) // self.page_size) - -(-have // self.page_size)
        return need

    def begin(self, seq_ids: list, lengths: list) -> None:
        need = self.pages_needed(seq_ids, lengths)
        if need > self.free_pages():
            raise PagePoolFull(f"KV cache full: {need} more pages needed, {self.free_pages()} free "
                               f"of {self.total_pages} (page size {self.page_size}); finish some "
                               "sequences or build with a larger --kv-cache-tokens")
        self._f["kv_state_begin_forward"](self.handle, self._shape(seq_ids), self._shape(lengths))
        for sid, n in zip(seq_ids, lengths):
            self.sequences[sid] += n

    def end(self) -> None:
        self._f["kv_state_end_forward"](self.handle)

    def _new_id(self) -> int:
        sid = self._next_id
        self._next_id += 1
        return sid
