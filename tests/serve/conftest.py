"""One build of the bundled model (plus a small chat template) and real servers on it."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")

# the server runs with torch and transformers unimportable: it must need the runtime only
NO_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, NoTorch())
"""


@pytest.fixture(scope="session")
def chat_build(tmp_path_factory):
    """OUT of the bundled model with a chat template added to its checkpoint (built once)."""
    import tvm_llm
    from tvm_llm.cli import DEFAULT_MODEL_DIR

    root = tmp_path_factory.mktemp("serve")
    ckpt = root / "ckpt"
    shutil.copytree(DEFAULT_MODEL_DIR, ckpt)
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    out = str(root / "tiny-chat")
    tvm_llm.build(str(ckpt), out, target="llvm", max_batch_size=16, prefill_chunk_size=64,
                  log=lambda *a: None)
    return out


class Server:
    def __init__(self, out: str, *args: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        code = NO_TORCH + "from tvm_llm.cli import main\nsys.exit(main(sys.argv[1:]))\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", out, "--port", "0", "--threads", "1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if not m:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            self.stop()
            raise RuntimeError(f"the server did not start: {line}{rest}")
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.model = os.path.basename(out)

    def client(self, api_key: str = "unused"):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(chat_build):
    s = Server(chat_build)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(chat_build):
    from tvm_llm import Engine

    return Engine(chat_build, num_threads=1)


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll until predicate() is truthy (a wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)
