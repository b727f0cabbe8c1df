"""`tvm-llm serve` end to end: a real server on an ephemeral port (torch unimportable in it),
talked to with the official `openai` client and raw HTTP."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request

import pytest

from conftest import NO_TORCH, Server, wait_for

PROMPTS = ["Once upon a time", "The little dog", "def main():", "She said that the"]


def _http(server, method, path, body=None, headers=None, raw: bytes | None = None):
    """(status, headers, parsed JSON or text) over plain http.client."""
    host, port = server.url[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, dict(resp.getheaders()), json.loads(text)
    except ValueError:
        return resp.status, dict(resp.getheaders()), text


def _metrics(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _chat_ids(engine, content: str) -> list:
    from tvm_llm.runtime import chat_template

    return chat_template.encode(engine, chat_template.load(engine.out_dir).render(
        [{"role": "user", "content": content}]))


def test_server_module_imports_without_torch():
    code = NO_TORCH + """
import json
import tvm_llm.serve.app, tvm_llm.serve.scheduler
print(json.dumps([m for m in ("torch", "transformers", "tvm_llm.frontend", "tvm_llm.passes",
                              "tvm_llm.quantization", "tvm_llm.tune") if m in sys.modules]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_models_health_and_greedy_completions_match_the_engine(server, engine):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [server.model]
    assert _http(server, "GET", "/health")[0] == 200
    for prompt in PROMPTS[:2]:
        ids = engine.generate_ids(prompt, max_new_tokens=20)[0]
        expected = engine.decode(ids)
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=20,
                                      temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.prompt_tokens == len(engine.encode(prompt))
        assert r.usage.completion_tokens == len(ids)
        stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=20,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == expected
    # a prompt of token ids
    r = client.completions.create(model=server.model, prompt=[5, 9, 33, 41], max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == engine.decode(
        engine.generate_ids([[5, 9, 33, 41]], max_new_tokens=8, ignore_eos=True)[0])


def test_chat_streamed_and_not_matches_the_engine(server, engine):
    client = server.client()
    ids = engine.generate_ids([_chat_ids(engine, "hello there")], max_new_tokens=16)[0]
    expected = engine.decode(ids)
    messages = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == expected
    assert r.choices[0].message.role == "assistant"
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids)
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.logprob <= 0
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_seed_n_and_stop_strings(server, engine):
    client = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=5,
              n=3, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    expected = engine.generate(PROMPTS[2], max_new_tokens=12, temperature=1.0, seed=5, n=3,
                               ignore_eos=True)
    assert texts == expected
    assert len(set(texts)) > 1
    greedy = engine.generate(PROMPTS[3], max_new_tokens=24, ignore_eos=True)
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 3]
    for stream in (False, True):
        r = client.completions.create(model=server.model, prompt=PROMPTS[3], max_tokens=24,
                                      temperature=0, stop=[stop], stream=stream,
                                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == greedy[: greedy.index(stop)]
        assert finish == "stop"


def test_16_concurrent_streams_equal_their_solo_runs(server, engine):
    # every fourth prompt is longer than the build's 64-token prefill chunk: it is prefilled in
    # slices over several steps, riding in the decoding sequences' calls (the server defaults)
    prompts = [[3 + i, 40 + 3 * i, 77, 5 + i, 9] * (1 + i % 3) * (9 if i % 4 == 0 else 1)
               for i in range(16)]
    alone = [engine.generate_ids([p], max_new_tokens=24, ignore_eos=True)[0] for p in prompts]
    expected = [engine.decode(x) for x in alone]
    client = server.client()
    results, errors = {}, []
    start = threading.Barrier(16)

    def run(i):
        try:
            start.wait()
            stream = client.completions.create(model=server.model, prompt=prompts[i],
                                               max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            results[i] = "".join(c.choices[0].text for c in stream)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [results[i] for i in range(16)] == expected
    m = _metrics(server)
    assert m["tvm_llm_kv_pages_used"] == 0 and m["tvm_llm_running_sequences"] == 0


def test_disconnect_mid_stream_returns_every_page(server):
    host, port = server.url[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": server.model, "prompt": "Once upon a time " * 20, "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(5):  # a few events arrive: the sequence is running and holds pages
        assert resp.fp.readline()
    m = _metrics(server)
    assert m["tvm_llm_kv_pages_used"] > 0 and m["tvm_llm_running_sequences"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_for(lambda: _metrics(server)["tvm_llm_kv_pages_used"] == 0, what="pages to return")
    m = _metrics(server)
    assert m["tvm_llm_running_sequences"] == 0
    assert m["tvm_llm_kv_pages_free"] == m["tvm_llm_kv_pages_total"]
    assert m["tvm_llm_generation_tokens_total"] > 0


BAD = [  # (what, method, path, body or raw bytes, status, code or param in the error)
    ("malformed JSON", "POST", "/v1/completions", b'{"model": ', 400, "invalid_json"),
    ("not an object", "POST", "/v1/completions", b'[1, 2]', 400, "invalid_json"),
    ("wrong-typed temperature", "POST", "/v1/completions",
     {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("wrong-typed max_tokens", "POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400,
     "max_tokens"),
    ("max_tokens 0", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": -4}, 400, "max_tokens"),
    ("stream not a bool", "POST", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("n too large", "POST", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("token id out of range", "POST", "/v1/completions", {"prompt": [5, 100000000]}, 400, "prompt"),
    ("negative token id", "POST", "/v1/completions", {"prompt": [5, -3]}, 400, "prompt"),
    ("prompt over the context window", "POST", "/v1/completions", {"prompt": [5] * 600}, 413,
     "context_length_exceeded"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404,
     "model_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "not_found"),
    ("wrong method", "GET", "/v1/completions", None, 405, None),
    ("unsupported field", "POST", "/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("what,method,path,body,status,where", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors_and_the_server_lives_on(server, what, method, path, body,
                                                                status, where):
    if isinstance(body, dict):
        body = {"model": server.model, **body}
    raw = body if isinstance(body, bytes) else None
    got, _, err = _http(server, method, path, None if raw else body, raw=raw)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["message"]
    if where is not None:
        assert where in (err["error"]["code"], err["error"]["param"]), err
    # and the server keeps answering
    assert _http(server, "GET", "/health")[0] == 200
    ok, _, r = _http(server, "POST", "/v1/completions",
                     {"model": server.model, "prompt": "a", "max_tokens": 2})
    assert ok == 200 and r["usage"]["completion_tokens"] >= 1


def _running_and_waiting(s, n: int) -> bool:
    """At least one sequence running and n in all (running and waiting), by the metrics."""
    m = _metrics(s)
    running = m["tvm_llm_running_sequences"]
    return running >= 1 and running + m["tvm_llm_waiting_sequences"] >= n


def test_api_key_missing_template_and_full_queue(chat_build, tmp_path):
    """A second server: no chat template, an API key, one sequence at a time, a queue of one."""
    out = str(tmp_path / "tiny-plain")
    shutil.copytree(chat_build, out)
    os.remove(os.path.join(out, "chat_template.jinja"))
    s = Server(out, "--api-key", "sesame", "--max-batch-size", "1", "--max-waiting", "1",
               "--step-prefill-ratio", "0.5", "--no-mixed-steps")
    try:
        body = {"model": s.model, "prompt": "a", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "sesame"}):
            status, _, err = _http(s, "POST", "/v1/completions", body, headers)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
        from openai import AuthenticationError, BadRequestError

        with pytest.raises(AuthenticationError):
            s.client("wrong").models.list()
        client = s.client("sesame")
        assert client.completions.create(**body).usage.completion_tokens >= 1
        with pytest.raises(BadRequestError, match="no chat template"):
            client.chat.completions.create(model=s.model, max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        # one running, one waiting: the next request is turned away with 429 and Retry-After.
        # The long request fills most of the 512-token context, yet a fast CPU (znver5) can
        # finish it before the second or third request arrives: a race, so the scenario starts
        # again, at most 5 times. A server that never turns the third request away still fails.
        long = {"model": s.model, "prompt": "a b c", "max_tokens": 500, "ignore_eos": True}
        auth = {"Authorization": "Bearer sesame"}
        for _attempt in range(5):
            results = []
            runs = [threading.Thread(target=lambda: results.append(
                _http(s, "POST", "/v1/completions", long, auth)[0])) for _ in range(2)]
            queued = True
            for k, t in enumerate(runs):
                t.start()
                try:  # the first request running, not only queued (a second one arriving
                    # while both wait is turned away), then the second waiting behind it
                    wait_for(lambda: _running_and_waiting(s, k + 1),
                             timeout=5.0, what="the request to be queued")
                except AssertionError:  # it finished before the poll saw it
                    queued = False
            status, headers, err = _http(s, "POST", "/v1/completions", long, auth) if queued \
                else (None, {}, None)
            for t in runs:
                t.join()
            assert results == [200, 200]
            if status == 429:
                break
        assert status == 429 and err["error"]["code"] == "queue_full"
        assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1"
    finally:
        s.stop()


def test_generate_chat_renders_the_template(chat_build, engine, tmp_path, capsys):
    from tvm_llm.cli import main

    expected = engine.decode(engine.generate_ids([_chat_ids(engine, "hello")], max_new_tokens=8)[0])
    assert main(["generate", chat_build, "--chat", "--prompt", "hello", "--max-new-tokens", "8",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    plain = str(tmp_path / "plain")
    shutil.copytree(chat_build, plain)
    os.remove(os.path.join(plain, "chat_template.jinja"))
    assert main(["generate", plain, "--chat", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and len(err.strip().splitlines()) == 1


def test_sigterm_finishes_requests_in_flight(server, engine):
    """Last in the module: SIGTERM while 4 streams run; each still gets all its tokens."""
    client = server.client()
    got, errors = {}, []
    started = threading.Semaphore(0)

    def run(i):
        try:
            stream = client.completions.create(model=server.model, prompt=PROMPTS[i],
                                               max_tokens=60, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            text, first = "", True
            for c in stream:
                text += c.choices[0].text
                if first:
                    started.release()
                    first = False
                finish = c.choices[0].finish_reason
            got[i] = (text, finish)
        except Exception as e:  # reported below
            errors.append(repr(e))
            started.release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        started.acquire(timeout=120)
    server.proc.send_signal(15)
    for t in threads:
        t.join()
    assert server.proc.wait(60) == 0
    assert errors == []
    for i in range(4):
        assert got[i] == (engine.generate(PROMPTS[i], max_new_tokens=60, ignore_eos=True), "length")
    assert "drained" in server.proc.stdout.read()
