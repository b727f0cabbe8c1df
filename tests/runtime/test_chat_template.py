"""Chat templates: found in a checkpoint, rendered like transformers, sandboxed."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tvm_llm.errors import UserError
from tvm_llm.runtime import chat_template

CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
          "You are helpful.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WITH_BOS = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | tojson }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Say \"ok\" ünd ✓"}]


def _checkpoint(tmp_path, template, in_config: bool) -> str:
    from tvm_llm.cli import DEFAULT_MODEL_DIR

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL_DIR, name), ckpt / name)
    if in_config:
        cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (ckpt / chat_template.FILE).write_text(template)
    return str(ckpt)


@pytest.mark.parametrize("template", [CHATML, WITH_BOS], ids=["chatml", "bos+tojson"])
@pytest.mark.parametrize("in_config", [False, True], ids=["jinja-file", "tokenizer_config"])
def test_renders_what_transformers_renders(tmp_path, template, in_config):
    from transformers import AutoTokenizer

    ckpt = _checkpoint(tmp_path, template, in_config)
    assert chat_template.find(ckpt) == template
    ours = chat_template.load(ckpt)
    hf = AutoTokenizer.from_pretrained(ckpt)
    for add in (True, False):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.render(MESSAGES, add_generation_prompt=add) == expected


def test_named_templates_and_none(tmp_path):
    ckpt = _checkpoint(tmp_path, [{"name": "tool_use", "template": "x"},
                                  {"name": "default", "template": CHATML}], in_config=True)
    assert chat_template.find(ckpt) == CHATML
    from tvm_llm.cli import DEFAULT_MODEL_DIR

    assert chat_template.find(DEFAULT_MODEL_DIR) is None and chat_template.load(DEFAULT_MODEL_DIR) is None


def test_the_sandbox_refuses_python_internals_and_reports_template_errors():
    evil = chat_template.ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(UserError, match="chat template"):
        evil.render(MESSAGES)
    mutate = chat_template.ChatTemplate("{% set _ = messages.append(1) %}ok")
    with pytest.raises(UserError, match="chat template"):
        mutate.render(MESSAGES)
    strict = chat_template.ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(UserError, match="roles must alternate"):
        strict.render(MESSAGES)
    with pytest.raises(UserError, match="does not parse"):
        chat_template.ChatTemplate("{% for %}")
