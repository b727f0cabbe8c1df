"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for app.py)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                    5.12, 10.24, 20.48, 40.96)


class Metrics:
    def __init__(self, engine, waiting):
        """waiting: a callable giving the number of queued (not yet admitted) requests."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tvm_llm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tvm_llm_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("tvm_llm_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("tvm_llm_time_to_first_token_seconds",
                              "request arrival to its first generated token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("tvm_llm_inter_token_latency_seconds",
                             "time between consecutive tokens of a sequence", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.step_seconds = Histogram("tvm_llm_step_seconds", "one scheduler step (prefill chunk "
                                      "and batched decode)", registry=r, buckets=_LATENCY_BUCKETS)
        stats = lambda key: (lambda: engine.stats[key])  # noqa: E731  (a snapshot per step)
        Gauge("tvm_llm_running_sequences", "sequences admitted (prefilling or decoding)",
              registry=r).set_function(lambda: engine.stats["running"] + engine.stats["prefilling"])
        Gauge("tvm_llm_waiting_sequences", "sequences queued, not yet admitted",
              registry=r).set_function(lambda: waiting())
        Gauge("tvm_llm_kv_pages_free", "free pages of the KV page pool",
              registry=r).set_function(stats("kv_pages_free"))
        Gauge("tvm_llm_kv_pages_used", "pages of the KV page pool in use", registry=r).set_function(
            lambda: engine.stats["kv_pages_total"] - engine.stats["kv_pages_free"])
        Gauge("tvm_llm_kv_pages_total", "pages of the KV page pool",
              registry=r).set_function(stats("kv_pages_total"))
        Gauge("tvm_llm_preemptions", "sequences preempted because the page pool was full",
              registry=r).set_function(stats("preemptions"))

    def render(self) -> bytes:
        return generate_latest(self.registry)
