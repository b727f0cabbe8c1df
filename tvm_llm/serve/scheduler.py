"""The scheduler thread: the only caller of the Engine while the server runs.

HTTP handlers never touch the Engine. They `submit` a prompt (a Handle comes back at once)
and read the Handle's asyncio queue; the thread drains its inbox (new prompts, cancellations)
between steps, calls `Engine.step()` (admit waiting prompts, prefill at most one chunk, decode
every running sequence in one batched call, retire finished ones), and hands the step's
events to the event loop in one call. So requests join and leave the batch at any step, and a
cancelled request (a client that went away) gives its pages back before the next step.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque


class QueueFull(Exception):
    """More requests are waiting than the server queues; the client should retry later."""


class Handle:
    """One submitted prompt (n samples): its request ids once added, and where events arrive."""

    def __init__(self, prompt_ids: list, kwargs: dict, loop: asyncio.AbstractEventLoop):
        self.prompt_ids = prompt_ids
        self.kwargs = kwargs
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict = {}  # engine request id -> sample index
        self.cancelled = False

    async def next_events(self) -> list:
        """The next batch of TokenEvents (or an Exception raised by the engine)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class Scheduler:
    def __init__(self, engine, max_waiting: int = 256, on_step=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step  # called with (events, step seconds) after each step
        self._inbox: deque = deque()  # ("add", handle) | ("cancel", handle)
        self._wake = threading.Condition()
        self._handles: dict = {}  # request id -> Handle
        self._stop = False
        self.error: BaseException | None = None  # set if the engine failed: the server is unhealthy
        self._thread = threading.Thread(target=self._loop, name="tvm-llm-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish everything already submitted, then end the thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def waiting(self) -> int:
        return len(self._inbox) + self.engine.stats["waiting"]

    def submit(self, prompt_ids: list, **kwargs) -> Handle:
        """Queue a prompt (engine.add keyword arguments); QueueFull past max_waiting."""
        if self.waiting() >= self.max_waiting:
            raise QueueFull(f"{self.waiting()} requests are already waiting (--max-waiting "
                            f"{self.max_waiting})")
        handle = Handle(prompt_ids, kwargs, asyncio.get_running_loop())
        with self._wake:
            self._inbox.append(("add", handle))
            self._wake.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Abort every sample of a handle (pages return before the next step)."""
        handle.cancelled = True
        with self._wake:
            self._inbox.append(("cancel", handle))
            self._wake.notify()

    def abort_one(self, handle: Handle, rid: int) -> None:
        """Abort one sample (it hit a stop string) while its siblings run on."""
        with self._wake:
            self._inbox.append(("abort", (handle, rid)))
            self._wake.notify()

    # ------------------------------------------------------------------ the thread
    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                if item.cancelled:
                    continue
                try:
                    rids = self.engine.add(item.prompt_ids, buffer=False, **item.kwargs)
                except Exception as e:  # validated before submit; report rather than die
                    item.loop.call_soon_threadsafe(item.queue.put_nowait, e)
                    continue
                for j, rid in enumerate(rids):
                    item.index[rid] = j
                    self._handles[rid] = item
            elif kind == "cancel":
                for rid in item.index:
                    self._handles.pop(rid, None)
                    self.engine.abort(rid)
            else:
                handle, rid = item
                self._handles.pop(rid, None)
                self.engine.abort(rid)

    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._inbox and not engine.has_work() and not self._stop:
                        self._wake.wait()
                    if self._stop and not self._inbox and not engine.has_work():
                        return
                self._drain_inbox()
                if not engine.has_work():
                    continue
                t0 = time.perf_counter()
                events = engine.step()
                elapsed = time.perf_counter() - t0
                batches: dict = {}
                for e in events:
                    handle = self._handles.get(e.request_id)
                    if handle is None:
                        continue
                    batches.setdefault(id(handle), (handle, []))[1].append(e)
                    if e.finish_reason is not None:
                        del self._handles[e.request_id]
                # one wake-up of the event loop per step, not one per request
                by_loop: dict = {}
                for handle, evs in batches.values():
                    by_loop.setdefault(handle.loop, []).append((handle.queue, evs))
                for loop, items in by_loop.items():
                    loop.call_soon_threadsafe(_deliver, items)
                if self.on_step is not None:
                    self.on_step(events, elapsed)
        except BaseException as e:  # the engine failed: fail every open request, mark unhealthy
            self.error = e
            for handle in set(self._handles.values()):
                handle.loop.call_soon_threadsafe(handle.queue.put_nowait,
                                                 RuntimeError(f"the engine failed: {e!r}"))
            self._handles.clear()


def _deliver(items: list) -> None:
    """On the event loop: hand each request its step's events."""
    for queue, evs in items:
        queue.put_nowait(evs)
