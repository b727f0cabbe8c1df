"""`tvm-llm serve`: an OpenAI-compatible HTTP server over the runtime Engine.

Imports the runtime only (never torch, transformers or the compiler):
    protocol.py   request bodies -> validated generation parameters; OpenAI error JSON
    scheduler.py  the one thread that owns the Engine and steps it (continuous batching)
    metrics.py    Prometheus counters, gauges and latency histograms
    app.py        the Starlette routes, SSE streaming, and `serve()` (uvicorn)
"""
