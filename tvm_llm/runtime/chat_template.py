"""Chat templates: the checkpoint's Jinja template, shipped in OUT and rendered in a sandbox.

The build copies the template (chat_template.jinja, or tokenizer_config.json's
`chat_template`) to OUT/chat_template.jinja; `tvm-llm serve` and `tvm-llm generate --chat`
render it with the variables transformers' apply_chat_template passes (messages,
add_generation_prompt, bos_token, eos_token, ...). The template comes with a downloaded
checkpoint, so it runs in jinja2's ImmutableSandboxedEnvironment: no attribute access to
Python internals, no mutation of the caller's objects. A model without a template gets an
error, not a guessed format.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from ..errors import UserError

FILE = "chat_template.jinja"


def find(model_dir: str) -> str | None:
    """The template text a checkpoint directory carries, or None."""
    path = os.path.join(model_dir, FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    cfg = _tokenizer_config(model_dir)
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) and tmpl.strip() else None


def _tokenizer_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized: {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled template plus the special-token strings it may use."""

    def __init__(self, source: str, special_tokens: dict | None = None, origin: str = "template"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise UserError(f"{origin}: the chat template does not parse ({e})") from None
        self.special_tokens = dict(special_tokens or {})
        self.origin = origin

    def render(self, messages: list, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]); UserError when the
        template rejects them (raise_exception) or fails."""
        from jinja2 import TemplateError

        variables = {**self.special_tokens, "messages": messages,
                     "add_generation_prompt": add_generation_prompt, "tools": None,
                     "documents": None, **extra}
        try:
            return self._template.render(**variables)
        except TemplateError as e:
            raise UserError(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # a template bug (TypeError, KeyError, ...) is the caller's 400
            raise UserError(f"the chat template failed on these messages: "
                            f"{type(e).__name__}: {e}") from None


def load(out_dir: str) -> ChatTemplate | None:
    """The template of a build directory (OUT/chat_template.jinja, else tokenizer_config.json's),
    or None when the model has none."""
    source = find(out_dir)
    if source is None:
        return None
    cfg = _tokenizer_config(out_dir)
    special = {name: _token_text(cfg.get(name)) for name in
               ("bos_token", "eos_token", "unk_token", "pad_token")}
    return ChatTemplate(source, special, origin=out_dir)


def no_template_message(out_dir: str) -> str:
    return (f"{out_dir}: the model has no chat template (no {FILE}, no chat_template in "
            "tokenizer_config.json); use the completions endpoint with a plain prompt, or add a "
            "template to the checkpoint and rebuild")


def encode(engine, text: str) -> list:
    """Token ids of a rendered chat prompt: the template already wrote any special tokens, so
    none are added (as transformers' apply_chat_template(tokenize=True) does)."""
    return engine.tokenizer.encode(text, add_special_tokens=False).ids
