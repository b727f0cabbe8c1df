"""OpenAI request bodies -> validated generation parameters, and OpenAI-style error bodies.

Validation is explicit (one check per field, a message naming the field and what it must be)
so that every bad request is a 4xx with {"error": {...}}, never a 500. Fields the OpenAI API
defines that this server cannot honour (echo, penalties, logit_bias, ...) are refused by name
rather than silently ignored; fields it does not know are ignored, as vLLM and llama.cpp do.
Extensions: `top_k` and `ignore_eos` (as vLLM and llama.cpp's server accept them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class ApiError(Exception):
    """An error answered as OpenAI does: status code plus {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class GenParams:
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's plus k alternatives
    ignore_eos: bool = False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bad_field(param: str, what: str, value) -> ApiError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"'{param}' must be {what}, got {shown}", param=param,
                    code="invalid_value" if value is not None else "invalid_type")


def _opt(body: dict, name: str, check, what: str, default):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad_field(name, what, value)
    return value


def _refuse_unsupported(body: dict, names: dict) -> None:
    for name, neutral in names.items():
        if name in body and body[name] not in (None, *neutral):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")


def common_params(body: dict, max_n: int, default_max_tokens: int | None) -> GenParams:
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""
    _refuse_unsupported(body, {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                               "logit_bias": ({},), "best_of": (1,), "suffix": ("",),
                               "tools": ([],), "response_format": ({"type": "text"},)})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise bad_field(name, "an integer >= 1", max_tokens)
    p = GenParams(max_tokens if max_tokens is not None else default_max_tokens)
    p.temperature = float(_opt(body, "temperature", lambda v: _is_num(v) and 0 <= v <= 2,
                               "a number in [0, 2]", 1.0))
    p.top_p = float(_opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]", 1.0))
    p.top_k = _opt(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= 0 (or -1)", 0)
    p.top_k = max(p.top_k, 0)
    p.seed = _opt(body, "seed", lambda v: _is_int(v) and 0 <= v < 2**63,
                  "an integer in [0, 2^63)", None)
    p.n = _opt(body, "n", lambda v: _is_int(v) and 1 <= v <= max_n,
               f"an integer in [1, {max_n}] (the server's max batch size)", 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 16
                             or not all(isinstance(s, str) and s for s in stop)):
        raise bad_field("stop", "a non-empty string or a list of up to 16 of them", stop)
    p.stop = stop or []
    p.stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    p.include_usage = options.get("include_usage", False)
    if not isinstance(p.include_usage, bool):
        raise bad_field("stream_options.include_usage", "a boolean", p.include_usage)
    p.ignore_eos = _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    return p


def completion_prompts(body: dict) -> list:
    """/v1/completions `prompt`: a string, a list of token ids, or a list of either; each
    returned entry is a str or a list of ints."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(x, str) for x in prompt):
            return list(prompt)
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in prompt):
            return list(prompt)
    raise bad_field("prompt", "a string, a list of strings, a list of token ids or a list of such lists",
               prompt)


def completion_params(body: dict, max_n: int) -> GenParams:
    _refuse_unsupported(body, {"echo": (False,)})
    p = common_params(body, max_n, default_max_tokens=16)  # the OpenAI API's default
    lp = body.get("logprobs")
    if lp is not None and lp is not False:
        if not _is_int(lp) or not 0 <= lp <= 20:
            raise bad_field("logprobs", "an integer in [0, 20]", lp)
        p.logprobs = lp
    return p


def chat_messages(body: dict) -> list:
    """`messages` as the template expects them: role and content strings (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_field(name, "an object with 'role' and 'content'", m)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant",
                                                     "tool"):
            raise bad_field(f"{name}.role", "one of system, developer, user, assistant, tool", role)
        if isinstance(content, list):  # content parts: only text can go to a text model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise bad_field(f"{name}.content", "a string or a list of text parts", part)
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad_field(f"{name}.content", "a string or a list of text parts", content)
        out.append({**{k: v for k, v in m.items() if k not in ("role", "content")},
                    "role": role, "content": content})
    return out


def chat_params(body: dict, max_n: int) -> GenParams:
    p = common_params(body, max_n, default_max_tokens=None)
    want = _opt(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    top = _opt(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= 20,
               "an integer in [0, 20]", None)
    if top is not None and not want:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    p.logprobs = (top or 0) if want else None
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise bad_field("add_generation_prompt", "a boolean", add_gen)
    return p
