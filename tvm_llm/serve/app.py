"""The HTTP side of `tvm-llm serve`: OpenAI-compatible routes on Starlette, run by uvicorn.

Why Starlette + uvicorn: both are small, widely deployed and actively maintained (Starlette is
what FastAPI is built on; uvicorn is the reference ASGI server), they stream server-sent events
natively, cancel a stream's task when its client disconnects (which is how an abandoned
request frees its KV pages), and drain open requests on SIGTERM. FastAPI's pydantic layer would
add little here: the OpenAI bodies are validated field by field in protocol.py so that every
mistake is a 400 with OpenAI's error JSON, not FastAPI's 422.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import signal
import socket
import sys
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import UserError
from ..runtime import chat_template
from . import protocol
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .protocol import ApiError
from .scheduler import QueueFull, Scheduler

MAX_BODY_BYTES = 8 * 2**20
RETRY_AFTER_SECONDS = "1"


class ServerState:
    def __init__(self, engine, model_id: str, api_key: str | None = None, max_waiting: int = 256):
        self.engine = engine
        self.model_id = model_id
        self.api_key = api_key
        self.template = chat_template.load(engine.out_dir)
        self.created = int(time.time())
        self.scheduler = Scheduler(engine, max_waiting, on_step=self._on_step)
        self.metrics = Metrics(engine, self.scheduler.waiting)

    def _on_step(self, events, seconds: float) -> None:
        self.metrics.step_seconds.observe(seconds)
        self.metrics.generation_tokens.inc(sum(1 for e in events if e.error is None))


# ---------------------------------------------------------------------------- helpers
def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             state.api_key.encode()):
        raise ApiError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key")


async def _json_body(request: Request) -> dict:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is over the {MAX_BODY_BYTES}-byte limit")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def _check_model(state: ServerState, body: dict) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise protocol.bad_field("model", "a string naming the served model", model)
    if model != state.model_id:
        raise ApiError(404, f"model '{model}' does not exist; this server serves "
                       f"'{state.model_id}' (GET /v1/models)", param="model",
                       code="model_not_found")


def _prompt_ids(state: ServerState, prompt) -> list:
    engine = state.engine
    try:
        ids = engine.encode(prompt) if isinstance(prompt, str) else engine.check_token_ids(prompt)
    except UserError as e:
        raise ApiError(400, str(e), param="prompt") from None
    return ids


def _check_fits(state: ServerState, ids: list, p: protocol.GenParams) -> dict:
    """The engine.add keyword arguments, after the size checks (413 when the prompt cannot fit)."""
    engine = state.engine
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    window = engine.context_window
    if len(ids) >= window:
        raise ApiError(413, f"the prompt has {len(ids)} tokens; the model's context window is "
                       f"{window} (prompt plus at least one generated token)",
                       param="prompt", code="context_length_exceeded")
    cache = engine.cache
    pages = -(-(len(ids) + 1) // cache.page_size) + p.n - 1
    if pages > cache.total_pages:
        raise ApiError(413, f"the prompt needs {pages} KV pages but the server's pool has "
                       f"{cache.total_pages}; shorten the prompt", param="prompt",
                       code="context_length_exceeded")
    max_new = min(p.max_tokens or window, window - len(ids))
    return dict(max_new_tokens=max_new, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                seed=p.seed, ignore_eos=p.ignore_eos, n=p.n, logprobs=p.logprobs)


def _submit(state: ServerState, ids: list, kwargs: dict):
    if not state.scheduler.alive:
        raise ApiError(503, "the engine has stopped; restart the server",
                       headers={"Retry-After": RETRY_AFTER_SECONDS})
    try:
        handle = state.scheduler.submit(ids, **kwargs)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy: {e}; retry later", code="queue_full",
                       headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
    state.metrics.prompt_tokens.inc(len(ids))
    return handle


class _Sample:
    """Text of one sample as tokens arrive: held back while it may still be cut by a stop
    string or ends inside a UTF-8 sequence."""

    def __init__(self):
        self.ids: list = []
        self.emitted = ""
        self.finish: str | None = None
        self.last_time: float | None = None


def _advance(state: ServerState, s: _Sample, token: int, finish, stop: list) -> str:
    """Append a token; returns the text that can be sent now and sets s.finish."""
    s.ids.append(token)
    text = state.engine.decode(s.ids)
    if finish is None and text.endswith("\ufffd"):
        return ""
    cut = len(text)
    if stop:
        start = max(0, len(s.emitted) - max(len(x) for x in stop) + 1)
        hits = [i for i in (text.find(x, start) for x in stop) if i >= 0]
        if hits:
            cut, finish = min(hits), "stop"
        elif finish is None:  # keep back a tail that may be the start of a stop string
            for x in stop:
                for k in range(min(len(x) - 1, len(text)), 0, -1):
                    if text.endswith(x[:k]):
                        cut = min(cut, len(text) - k)
                        break
    s.finish = finish
    piece = text[len(s.emitted):cut]
    s.emitted = text[:cut] if cut >= len(s.emitted) else s.emitted
    return piece


async def _run(state: ServerState, request: Request, handle, n: int, stop: list, arrival: float,
               watch_disconnect: bool):
    """Yield (sample index, text piece, [(token, logprob, top)], finish reason) as events come.
    Cancels the handle (freeing its pages) if the consumer stops early or the client leaves."""
    samples = [_Sample() for _ in range(n)]
    done = 0
    first = True
    try:
        while done < n:
            if watch_disconnect:  # a non-streamed request: notice a client that went away
                try:
                    events = await asyncio.wait_for(handle.next_events(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
            else:
                events = await handle.next_events()
            now = time.perf_counter()
            for e in events:
                j = handle.index[e.request_id]
                s = samples[j]
                if s.finish is not None:
                    continue
                if e.error is not None:
                    raise ApiError(503, f"the request could not be served: {e.error}",
                                   headers={"Retry-After": RETRY_AFTER_SECONDS})
                if first:
                    state.metrics.ttft.observe(now - arrival)
                    first = False
                if s.last_time is not None:
                    state.metrics.itl.observe(now - s.last_time)
                s.last_time = now
                piece = _advance(state, s, e.token, e.finish_reason, stop)
                lp = [] if e.logprob is None else [(e.token, e.logprob, e.top_logprobs or [])]
                if s.finish is not None:
                    done += 1
                    if e.finish_reason is None:  # cut by a stop string: the sequence ends now
                        state.scheduler.abort_one(handle, e.request_id)
                yield j, piece, lp, s.finish, len(s.ids)
    finally:
        if done < n:
            state.scheduler.cancel(handle)


def _token_text(state: ServerState, token: int) -> str:
    return state.engine.tokenizer.decode([token], skip_special_tokens=False)


def _chat_logprobs(state: ServerState, lps: list) -> list:
    def entry(t, lp):
        text = _token_text(state, t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, lp, top in lps]


def _completion_logprobs(state: ServerState, lps: list, offset: int) -> dict:
    tokens = [_token_text(state, t) for t, _, _ in lps]
    offsets, pos = [], offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in lps],
            "top_logprobs": [{_token_text(state, a): b for a, b in top} for _, _, top in lps],
            "text_offset": offsets}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------- endpoints
async def _generation(request: Request, chat: bool):
    state: ServerState = request.app.state.server
    arrival = time.perf_counter()
    _check_key(state, request)
    body = await _json_body(request)
    _check_model(state, body)
    max_n = state.engine.cache.max_batch_size
    if chat:
        p = protocol.chat_params(body, max_n)
        messages = protocol.chat_messages(body)
        if state.template is None:
            raise ApiError(400, chat_template.no_template_message(state.model_id),
                           param="messages", code="no_chat_template")
        try:
            text = state.template.render(messages, body.get("add_generation_prompt", True) is not False)
        except UserError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompts = [chat_template.encode(state.engine, text)]
    else:
        p = protocol.completion_params(body, max_n)
        prompts = [_prompt_ids(state, x) for x in protocol.completion_prompts(body)]
    if p.stream and len(prompts) > 1:
        raise ApiError(400, "streaming supports one prompt per request", param="prompt")
    kwargs = [_check_fits(state, ids, p) for ids in prompts]
    handles = [_submit(state, ids, kw) for ids, kw in zip(prompts, kwargs)]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    usage_prompt = sum(len(x) for x in prompts)
    if p.stream:
        gen = _run(state, request, handles[0], p.n, p.stop, arrival, watch_disconnect=False)
        return StreamingResponse(_stream(state, gen, p, rid, created, chat, usage_prompt),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    choices, completion_tokens = [], 0
    for i, handle in enumerate(handles):
        texts = [""] * p.n
        lps: list = [[] for _ in range(p.n)]
        finishes = [None] * p.n
        counts = [0] * p.n
        async for j, piece, lp, finish, count in _run(state, request, handle, p.n, p.stop,
                                                      arrival, watch_disconnect=True):
            texts[j] += piece
            lps[j] += lp
            finishes[j], counts[j] = finish, count
        if any(f is None for f in finishes):  # the client went away
            for h in handles[i + 1:]:
                state.scheduler.cancel(h)
            return Response(status_code=499)
        completion_tokens += sum(counts)
        for j in range(p.n):
            if chat:
                choice = {"index": i * p.n + j,
                          "message": {"role": "assistant", "content": texts[j]},
                          "logprobs": ({"content": _chat_logprobs(state, lps[j])}
                                       if p.logprobs is not None else None),
                          "finish_reason": finishes[j]}
            else:
                choice = {"index": i * p.n + j, "text": texts[j],
                          "logprobs": (_completion_logprobs(state, lps[j], 0)
                                       if p.logprobs is not None else None),
                          "finish_reason": finishes[j]}
            choices.append(choice)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": state.model_id, "choices": choices,
        "usage": {"prompt_tokens": usage_prompt, "completion_tokens": completion_tokens,
                  "total_tokens": usage_prompt + completion_tokens}})


async def _stream(state: ServerState, gen, p, rid: str, created: int, chat: bool, usage_prompt: int):
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": state.model_id}
    counts = [0] * p.n
    offsets = [0] * p.n
    try:
        if chat:
            for j in range(p.n):
                yield _sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
        async for j, piece, lp, finish, count in gen:
            counts[j] = count
            if not piece and not lp and finish is None:
                continue
            if chat:
                delta = {"content": piece} if piece else {}
                choice = {"index": j, "delta": delta,
                          "logprobs": {"content": _chat_logprobs(state, lp)} if lp else None,
                          "finish_reason": finish}
            else:
                choice = {"index": j, "text": piece,
                          "logprobs": _completion_logprobs(state, lp, offsets[j]) if lp else None,
                          "finish_reason": finish}
                offsets[j] += len(piece)
            yield _sse({**head, "choices": [choice]})
        if p.include_usage:
            done = sum(counts)
            yield _sse({**head, "choices": [], "usage": {
                "prompt_tokens": usage_prompt, "completion_tokens": done,
                "total_tokens": usage_prompt + done}})
    except ApiError as e:  # headers are sent: report in the stream, as OpenAI does
        yield _sse(e.body())
    finally:
        await gen.aclose()  # cancels the handle if it did not finish (client gone)
    yield "data: [DONE]\n\n"


def _endpoint(name: str, func):
    async def handler(request: Request):
        state: ServerState = request.app.state.server
        try:
            response = await func(request)
        except ApiError as e:
            response = _error_response(e)
        except Exception as e:  # a bug: still an OpenAI-shaped answer, and the server lives on
            print(f"tvm-llm serve: internal error on {name}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            response = _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        state.metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    return handler


async def completions(request: Request):
    return await _generation(request, chat=False)


async def chat_completions(request: Request):
    return await _generation(request, chat=True)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created,
            "owned_by": "tvm_llm", "max_model_len": state.engine.context_window}


async def list_models(request: Request):
    state: ServerState = request.app.state.server
    _check_key(state, request)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(request: Request):
    state: ServerState = request.app.state.server
    _check_key(state, request)
    name = request.path_params["model"]
    if name != state.model_id:
        raise ApiError(404, f"model '{name}' does not exist; this server serves '{state.model_id}'",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


async def health(request: Request):
    state: ServerState = request.app.state.server
    if not state.scheduler.alive:
        return JSONResponse({"status": "error", "detail": repr(state.scheduler.error)}, 503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request):
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: HTTPException):
    state: ServerState = request.app.state.server
    msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
           f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    state.metrics.requests.labels("other", str(exc.status_code)).inc()
    return _error_response(ApiError(exc.status_code, msg, code="not_found"
                                    if exc.status_code == 404 else None))


def create_app(state: ServerState) -> Starlette:
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.scheduler.stop)

    routes = [
        Route("/v1/completions", _endpoint("completions", completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint("chat_completions", chat_completions),
              methods=["POST"]),
        Route("/v1/models", _endpoint("models", list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint("models", get_model), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.server = state
    return app


def serve(out_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_batch_size: int | None = None, threads: int | None = None, max_waiting: int = 256,
          model_name: str | None = None, step_prefill_tokens: int | None = None,
          step_prefill_ratio: float = 1.0, mixed_steps: bool = True, log=print) -> None:
    """Load OUT and answer OpenAI requests until SIGTERM/SIGINT (then drain and return)."""
    import uvicorn

    from ..runtime.engine import Engine

    engine = Engine(out_dir, num_threads=threads, max_batch_size=max_batch_size)
    engine.decode_prefill_tokens = step_prefill_tokens
    engine.prefill_step_ratio = step_prefill_ratio
    engine.mixed_steps = mixed_steps
    model_id = model_name or os.path.basename(os.path.normpath(os.path.abspath(out_dir)))
    state = ServerState(engine, model_id, api_key, max_waiting)
    try:
        sock = socket.create_server((host, port), backlog=2048)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    bound = sock.getsockname()[1]

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # drain open requests, then return normally (uvicorn would re-raise the signal)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False,
                            lifespan="on", timeout_keep_alive=30)
    server = _Server(config)
    log(f"tvm-llm serve: {model_id} on http://{host}:{bound}/v1 (max batch "
        f"{engine.cache.max_batch_size}, {engine.cache.total_pages} KV pages, "
        f"{engine.num_threads} threads, context {engine.context_window}"
        f"{', API key required' if api_key else ''})")
    sys.stdout.flush()
    server.run(sockets=[sock])
    log("tvm-llm serve: drained, exiting")
