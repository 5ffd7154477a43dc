"""The OpenAI-compatible HTTP API (cluster/http_api.py), driven by the official `openai` client against a
real `flashpd serve --http-port 0` (colocated, CPU, the shipped demo pair: it has a tokenizer and a chat
template), with the same server's gRPC API as the reference: greedy completions (streamed or not, native
and DFlash) equal the gRPC API's text and tokens; chat is deterministic and counts its tokens; stop
strings; /v1/models, /health, /metrics; OpenAI error bodies and codes; a client that leaves mid-stream
(or mid-request) frees the request's KV blocks; 32 concurrent streams equal the same requests served alone; a
stream that fell behind the engine gets its queued tokens in one chunk.
"""
from __future__ import annotations

import json
import threading
import time
from functools import partial
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from flashpd.cluster.chat_template import ChatTemplate  # noqa: E402
from flashpd.cluster.generation_client import GenerationClient  # noqa: E402
from flashpd.engine.tokenizer import TextTokenizer  # noqa: E402
from tests._fake_handle import FakeHandle  # noqa: E402
from tests._serve_process import serve_lines  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
MODEL = "target"  # the served model name: the target directory's name
WAIT_S = 15.0  # bound on every poll here
FREED_S = 3.0  # a dropped request's blocks are free by then (one engine step, one poll of the client)
PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "def fib(n):\n    if n < 2:\n", "with open(path) as f:\n",
           "try:\n    import numpy as np\n", "def main():\n    args = parse_args()\n"]
TOKENIZER = TextTokenizer.from_dir(DEMO / "target")


class _Server:
    def __init__(self, http: str, grpc_address: str) -> None:
        self.base = f"http://{http}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0, timeout=60.0)
        self.grpc_address = grpc_address
        self.grpc = GenerationClient(grpc_address, timeout_s=60.0)
        self.http = self.client._client  # the openai client's own httpx client, for the non-OpenAI routes

    def health(self) -> dict:
        return self.http.get(f"{self.base}/health").json()

    def free_blocks(self) -> float:
        text = self.http.get(f"{self.base}/metrics").text
        return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith("flashpd_kv_blocks_free{")))

    def finished(self) -> float:
        """Requests the engine ran to their end (a cancelled one is not counted)."""
        text = self.http.get(f"{self.base}/metrics").text
        return sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith("flashpd_requests_total{") and 'outcome="ok"' in ln)

    def wait_idle(self) -> float:
        """Seconds until nothing runs or waits and every KV block is free (at most WAIT_S)."""
        total = self.health()["kv_blocks_total"]
        t0 = time.monotonic()
        while time.monotonic() < t0 + WAIT_S:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and self.free_blocks() == total:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"KV not freed within {WAIT_S} s: {self.health()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("http") / "serve.json"
    cfg.write_text(json.dumps({"target": str(DEMO / "target"), "draft": str(DEMO / "drafter"), "device": "cpu",
                               "dtype": "float32", "kv_cache_tokens": 4096, "torch_threads": 1}))
    with serve_lines([str(cfg), "--http-port", "0"], start_timeout_s=90.0) as found:
        assert "http" in found, found
        s = _Server(found["http"], found["listening"])
        yield s
        s.client.close()
        s.grpc.close()


GREEDY = dict(temperature=0)


def _extra(**kw) -> dict:
    return {"extra_body": {"ignore_eos": True, "return_token_ids": True, **kw}}


def _stream_text(stream) -> tuple[str, list[int], object, dict | None, object]:
    """(text, token ids, finish_reason, the flashpd field, usage) of a streamed completion."""
    text, toks, reason, stats, usage = [], [], None, None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text.append(c.text)
            toks.extend((c.model_extra or {}).get("token_ids") or [])
            if c.finish_reason is not None:
                reason = c.finish_reason
                stats = ch.model_extra["flashpd"]
    return "".join(text), toks, reason, stats, usage


@pytest.mark.parametrize("method", ["native", "dflash"])
def test_completions_equal_the_grpc_api(server, method):
    c = server.client
    for prompt in PROMPTS[:3]:
        ref = server.grpc.generate_once(prompt, max_tokens=16, method=method, ignore_eos=True)
        assert len(ref.token_ids) == 16 and ref.text
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY, **_extra(method=method))
        ch = r.choices[0]
        assert ch.text == ref.text and ch.model_extra["token_ids"] == ref.token_ids
        assert ch.finish_reason == ref.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(TOKENIZER.encode(prompt)), 16)
        stats = r.model_extra["flashpd"]
        assert stats["method"] == method and stats["acceptance_lengths"] == ref.stats["acceptance_lengths"]
        assert (stats["tau"] is None) == (method == "native") and stats["ttft_ms"] > 0
        text, toks, reason, sstats, usage = _stream_text(c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True},
            **GREEDY, **_extra(method=method)))
        assert (text, toks, reason) == (ref.text, ref.token_ids, "length")
        assert sstats["acceptance_lengths"] == ref.stats["acceptance_lengths"]
        assert usage.completion_tokens == 16 and usage.total_tokens == 16 + usage.prompt_tokens
    # a prompt of token ids is the same request
    ids = TOKENIZER.encode(PROMPTS[0])
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=16, **GREEDY, **_extra(method=method))
    assert r.choices[0].model_extra["token_ids"] == server.grpc.generate_once(
        ids, max_tokens=16, method=method, ignore_eos=True).token_ids
    server.wait_idle()


def test_chat_completions(server):
    c = server.client
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompt_len = len(TOKENIZER.encode(ChatTemplate.from_dir(DEMO / "target").render(msgs)))
    a = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **GREEDY, **_extra())
    b = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, **GREEDY, **_extra())
    assert a.choices[0].message.content and a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.role == "assistant" and a.choices[0].finish_reason == "length"
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (prompt_len, 12)
    assert a.model_extra["flashpd"]["method"] == "dflash"  # the default with a drafter
    # the same prompt through /v1/completions gives the same tokens
    rendered = ChatTemplate.from_dir(DEMO / "target").render(msgs)
    ref = server.grpc.generate_once(rendered, max_tokens=12, ignore_eos=True)
    assert a.choices[0].model_extra["token_ids"] == ref.token_ids and a.choices[0].message.content == ref.text
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY, **_extra()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == prompt_len
    # content parts; seeded sampling is reproducible
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    s1, s2 = (c.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0.8, seed=3,
                                        **_extra()).choices[0].model_extra["token_ids"] for _ in range(2))
    assert s1 == s2 and len(s1) == 8
    server.wait_idle()


def test_stop_strings(server):
    c = server.client
    prompt = PROMPTS[4]
    full = server.grpc.generate_once(prompt, max_tokens=32, ignore_eos=True)
    stop = next(s for s in ("\n", ":", " ", "(") if full.text.find(s) > 0)  # occurs, and not at the start
    cut = full.text.find(stop)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=32, stop=[stop, "@@never@@"], **GREEDY,
                             **_extra())
    assert r.choices[0].text == full.text[:cut] and r.choices[0].finish_reason == "stop"
    n = r.usage.completion_tokens  # up to the token that completed the stop string
    assert 0 < n < 32 and r.choices[0].model_extra["token_ids"] == full.token_ids[:n]
    assert stop in TOKENIZER.decode(full.token_ids[:n]) and stop not in TOKENIZER.decode(full.token_ids[:n - 1])
    text, toks, reason, _, usage = _stream_text(c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, stop=stop, stream=True, stream_options={"include_usage": True},
        **GREEDY, **_extra()))
    assert (text, reason, usage.completion_tokens, toks) == (full.text[:cut], "stop", n, full.token_ids[:n])
    server.wait_idle()  # the rest of the request was cancelled


def test_models_health_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 4096
    assert server.client.models.retrieve(MODEL).id == MODEL
    h = server.health()
    assert h["status"] == "ok" and h["kv_blocks_total"] == 256 and h["kv_block_size"] == 16
    assert 'flashpd_requests_total{method="dflash",outcome="ok",role="colocated"}' in \
        server.http.get(f"{server.base}/metrics").text


def _error(fn) -> tuple[type, int, dict]:
    with pytest.raises(openai.APIStatusError) as ei:
        fn()
    e = ei.value
    assert set(e.body) == {"message", "type", "param", "code"}, e.body  # the client unwraps {"error": {...}}
    return type(e), e.status_code, e.body


@pytest.mark.parametrize("stream", [False, True])
def test_errors_have_openai_bodies_and_codes(server, stream):
    c = server.client

    def comp(**kw):
        args = dict(model=MODEL, prompt="def f():\n", max_tokens=4, stream=stream)
        call = partial(c.completions.create, **{**args, **kw})
        return (lambda: list(call())) if stream else call

    for kw, param in ((dict(temperature=-1), "temperature"), (dict(n=2), "n"), (dict(top_p=1.5), "top_p"),
                      (dict(max_tokens=0), "max_tokens"), (dict(prompt=""), "prompt"),
                      (dict(prompt=[1, 2, 99999]), "prompt"), (dict(presence_penalty=0.5), "presence_penalty"),
                      (dict(extra_body={"method": "beam"}), "method"), (dict(extra_body={"top_k": -3}), "top_k"),
                      (dict(stop=["ok", "x" * 1025]), "stop"), (dict(stop=[";"] * 17), "stop")):
        typ, status, body = _error(comp(**kw))
        assert (typ, status, body["type"], body["param"]) == (openai.BadRequestError, 400, "invalid_request_error",
                                                               param), (kw, body)
        assert param in body["message"]
    typ, status, body = _error(comp(model="no-such-model"))
    assert (typ, status, body["code"], body["param"]) == (openai.NotFoundError, 404, "model_not_found", "model")
    for kw, param in ((dict(prompt=[5] * 5000), "prompt"), (dict(prompt=[5] * 100, max_tokens=4000), "max_tokens"),
                      (dict(prompt="x " * 300_000), "prompt")):
        typ, status, body = _error(comp(**kw))
        assert (typ, status, body["code"], body["param"]) == (openai.BadRequestError, 400, "context_length_exceeded",
                                                               param), body
    typ, status, body = _error(lambda: c.chat.completions.create(model=MODEL, messages=[], max_tokens=4,
                                                                 stream=stream))
    assert (typ, status, body["param"]) == (openai.BadRequestError, 400, "messages")
    r = server.http.post(f"{server.base}/v1/completions", content=b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.http.get(f"{server.base}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    server.wait_idle()


def test_a_client_that_leaves_frees_the_kv(server):
    """3000 tokens take the engine tens of seconds here; a client that leaves after a few has its request
    dropped at once (it never finishes) and every block free within a second or two."""
    total = server.health()["kv_blocks_total"]
    assert server.free_blocks() == total
    done0 = server.finished()
    for method in ("dflash", "native"):
        stream = server.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3000, stream=True,
                                                  **GREEDY, **_extra(method=method))
        got = 0
        for ch in stream:
            got += len(ch.choices[0].model_extra["token_ids"]) if ch.choices else 0
            if got >= 5:
                break
        assert server.free_blocks() < total  # it holds KV now
        stream.close()
        assert server.wait_idle() < FREED_S
    # a non-streamed request whose client gives up is dropped as well
    fast = server.client.with_options(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        fast.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=3000, **GREEDY, **_extra())
    assert server.wait_idle() < FREED_S
    assert server.finished() == done0


def test_32_concurrent_streams_equal_solo_runs(server):
    n = 32
    prompts = [PROMPTS[i % len(PROMPTS)] + "    " * (i // len(PROMPTS)) for i in range(n)]
    methods = ["dflash" if i % 3 else "native" for i in range(n)]
    lens = [8 + i % 5 for i in range(n)]
    solo = [server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lens[i], **GREEDY,
                                             **_extra(method=methods[i])).choices[0] for i in range(n)]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n, timeout=WAIT_S)

    def worker(i: int) -> None:
        try:
            start.wait()
            results[i] = _stream_text(server.client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=lens[i], stream=True, **GREEDY, **_extra(method=methods[i])))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    for i in range(n):
        text, toks, reason, _, _ = results[i]
        assert (text, toks, reason) == (solo[i].text, solo[i].model_extra["token_ids"], "length"), i
        assert len(toks) == lens[i]
    server.wait_idle()


def test_chat_template_renders_as_transformers():
    """A Qwen-style template with a system default, raise_exception and loop controls renders exactly as
    transformers renders it (no server)."""
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    tpl = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}"
           "{% endif %}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
           "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
           "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not "
           "enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}{{ eos_token | tojson }}")
    t = ChatTemplate(tpl, {"eos_token": "<|endoftext|>"})
    msgs = [{"role": "user", "content": " hi \u00e9 "}, {"role": "assistant", "content": "ok"}, {"role": "user",
                                                                                                   "content": "go"}]
    for kw in ({}, {"enable_thinking": False}):
        ref = cu.render_jinja_template([msgs], chat_template=tpl, add_generation_prompt=True,
                                       eos_token="<|endoftext|>", **kw)[0][0]
        assert t.render(msgs, add_generation_prompt=True, **kw) == ref
    from flashpd.cluster.chat_template import ChatTemplateError
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        t.render([{"role": "tool", "content": "x"}])


def test_a_message_the_template_leaves_out_is_an_error():
    """Qwen3's template renders system, user, assistant and tool turns only: a 'developer' message vanished from
    the prompt without a word. Now the render names it; assistant and tool turns, which templates rewrite, and
    trimmed text are not flagged."""
    from flashpd.cluster.chat_template import ChatTemplateError
    tpl = ("{% for m in messages %}{% if m.role in ['system', 'user'] %}{{ '<|im_start|>' + m.role + '\n' + "
           "m.content | trim + '<|im_end|>\n' }}{% elif m.role == 'assistant' %}{{ '<|im_start|>assistant\n' + "
           "m.content.split('</think>')[-1] | trim + '<|im_end|>\n' }}{% elif m.role == 'tool' %}"
           "{{ '<tool>' + m.content | tojson + '</tool>' }}{% endif %}{% endfor %}")
    t = ChatTemplate(tpl, {})
    ok = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "<think>x</think> ok"}, {"role": "tool", "content": 'a "b"'},
          {"role": "user", "content": "go"}]
    assert "be brief" in t.render(ok)
    for role in ("developer", "function", "User"):
        with pytest.raises(ChatTemplateError, match=rf"messages\[1\] \(role '{role}'\)"):
            t.render([{"role": "user", "content": "hi"}, {"role": role, "content": "answer in French"}])


def test_http_load_tool_matches_grpc_load(server):
    from flashpd.bench.http_load import run_load_http
    from flashpd.bench.load_gen import run_load, summarize

    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:6]]
    kw = dict(max_tokens=10, method="dflash", ignore_eos=True)
    via_http, wall = run_load_http(server.base, prompts, concurrency=3, timeout_s=60.0, **kw)
    via_grpc, _ = run_load(server.grpc_address, prompts, concurrency=3, timeout_s=60.0, **kw)
    for h, g in zip(via_http, via_grpc):
        assert h.error is None and g.error is None, (h.error, g.error)
        assert h.tokens == g.tokens and len(h.tokens) == 10
        assert h.acceptance_lengths == g.acceptance_lengths and sum(h.acceptance_lengths) == 9
        assert 0 < h.ttft_ms <= h.latency_ms
    s = summarize(via_http, wall)
    assert s["errors"] == 0 and s["output_tokens"] == 60 and s["tau"] > 1
    bad, _ = run_load_http(server.base, [[1, 2, 99999]], concurrency=1, timeout_s=10.0, max_tokens=4)
    assert bad[0].error.startswith("HTTP 400") and "prompt" in bad[0].error
    server.wait_idle()


def test_load_over_client_processes_matches_one_process(server):
    """bench/load_procs.py: the same closed loop from 2 spawned client processes (gRPC and HTTP) returns every
    request, in prompt order, with one process's tokens and acceptance."""
    from flashpd.bench.http_load import run_load_http
    from flashpd.bench.load_gen import run_load

    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:5]]
    kw = dict(max_tokens=8, method="dflash", ignore_eos=True)
    one, _ = run_load(server.grpc_address, prompts, concurrency=3, timeout_s=60.0, **kw)
    for load, target in ((run_load, server.grpc_address), (run_load_http, server.base)):
        two, wall = load(target, prompts, concurrency=3, timeout_s=60.0, procs=2, **kw)
        assert [r.index for r in two] == list(range(len(prompts))) and wall > 0
        for a, b in zip(one, two):
            assert b.error is None, b.error
            assert (b.tokens, b.acceptance_lengths) == (a.tokens, a.acceptance_lengths) and len(b.tokens) == 8
            assert 0 < b.ttft_ms <= b.latency_ms
    server.wait_idle()


def test_odd_but_valid_json_gets_4xx_and_tiny_top_p_is_greedy(server):
    """Bodies a JSON parser accepts but the API must still answer cleanly (each was a 500 or worse)."""
    post = lambda body, path="completions": server.http.post(  # noqa: E731
        f"{server.base}/v1/{path}", content=body if isinstance(body, bytes) else json.dumps(body).encode())
    r = post(b"[" * 20_000)  # nested past the parser's recursion limit
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for many in (b"[" + b"{}," * 200_000 + b"{}]", b'{"prompt": [' + b"1," * 400_000 + b'1]}'):
        r = post(many)  # more values than a request can use: refused before parsing (it blocked the event loop)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert "too many JSON values" in r.json()["error"]["message"]
    for odd in ([], "", 0, False):  # falsy, and not objects: they were taken as {}
        r = post(dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=odd),
                 "chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", (odd, r.text)
    for name in ("max_tokens", "n", "top_p"):  # huge values are shown capped, not in their 309 digits
        r = post(b'{"model": "%s", "prompt": "x", "%s": 1e308}' % (MODEL.encode(), name.encode()))
        assert r.status_code == 400 and len(r.json()["error"]["message"]) < 200, r.text
    r = post(b'{"model": "\\ud800", "prompt": "x"}')  # a lone surrogate, echoed in the error
    assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"]
    long = b"\\ud800" + b" a" * 9000  # past the tokenizer's window: counted before it is encoded (that was a 500)
    for path, body in (("completions", b'{"prompt": "%s"}' % long),
                       ("chat/completions", b'{"messages": [{"role": "user", "content": "%s"}]}' % long)):
        r = post(body, path)
        assert r.status_code == 400 and "tokenizer refused" in r.json()["error"]["message"], (path, r.text)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    for k in ("tools", "documents", "continue_final_message", "messages", "add_generation_prompt"):
        r = post({**chat, "chat_template_kwargs": {k: None}}, "chat/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == f"chat_template_kwargs.{k}", (k, r.text)
    assert post({**chat, "chat_template_kwargs": {"self": 1}}, "chat/completions").status_code == 200
    base = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, ignore_eos=True, return_token_ids=True)
    for top_k in (2 ** 31, 2 ** 64):
        r = post({**base, "top_k": top_k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    greedy = post({**base, "temperature": 0}).json()["choices"][0]["token_ids"]
    for kw in (dict(top_p=1e-50), dict(top_p=1e-30), dict(top_k=2 ** 31 - 1, top_p=1e-45)):
        r = post({**base, "temperature": 1.0, "seed": 3, **kw})  # only the most likely token is left: greedy
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy, (kw, r.text)
    assert server.health()["status"] == "ok"
    server.wait_idle()


def test_local_mode_serves_http_over_the_router(tmp_path):
    """Mode "local" (router + bridge, prefill and decode worker processes): the HTTP API is the router's,
    with the gRPC API's tokens and the prefill worker's prefill_ms. The service has an API key (api_key_file):
    the router's APIs ask for it (tests/test_api_key.py covers the key's rules)."""
    from flashpd.cluster.config import ServeConfig
    from flashpd.cluster.generation_client import GenerationUnauthenticated
    from flashpd.cluster.service import start_service

    key = "router-key-0123456789"
    (tmp_path / "api.key").write_text(key)
    (tmp_path / "api.key").chmod(0o600)
    svc = start_service(ServeConfig(target=str(DEMO / "target"), draft=str(DEMO / "drafter"), mode="local",
                                    device="cpu", dtype="float32", kv_cache_tokens=4096, torch_threads=1, http_port=0,
                                    served_model_name="demo", start_timeout_s=120.0,
                                    api_key_file=str(tmp_path / "api.key")))
    try:
        c = openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key=key, max_retries=0, timeout=60.0)
        with GenerationClient(svc.address, timeout_s=60.0) as g:
            with pytest.raises(GenerationUnauthenticated):
                g.generate_once(PROMPTS[0], max_tokens=12, ignore_eos=True)
        with openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="none", max_retries=0) as keyless:
            with pytest.raises(openai.AuthenticationError):
                keyless.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=2)
        with GenerationClient(svc.address, timeout_s=60.0, api_key=key) as g:
            ref = g.generate_once(PROMPTS[0], max_tokens=12, ignore_eos=True)
        r = c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, **GREEDY, **_extra())
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids and r.choices[0].text == ref.text
        assert r.model_extra["flashpd"]["prefill_ms"] > 0
        text, toks, reason, stats, _ = _stream_text(c.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=12, stream=True, **GREEDY, **_extra()))
        assert (text, toks, reason) == (ref.text, ref.token_ids, "length") and stats["acceptance_lengths"]
        chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                         **GREEDY, **_extra())
        assert chat.usage.completion_tokens == 6
        # values the router's wire holds differently (uint64 seed, float32 top_p, int32 top_k) mean the same
        sampled = lambda **kw: c.completions.create(  # noqa: E731
            model="demo", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, **_extra(**kw)
        ).choices[0].model_extra["token_ids"]
        assert sampled(seed=-1) == sampled(seed=2 ** 64 - 1) and len(sampled(seed=-1)) == 10
        greedy = c.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=10, **GREEDY, **_extra()
                                      ).choices[0].model_extra["token_ids"]
        assert sampled(seed=4, top_p=1e-50, top_k=2 ** 31 - 1) == greedy
        assert svc.backend.inflight == 0
        assert _error(lambda: c.models.retrieve("target"))[1] == 404
        c.close()
    finally:
        svc.stop()


def test_config_http_port_and_model_name():
    from flashpd.cluster.config import ServeConfig

    assert ServeConfig(target="t").http_port is None  # off unless asked for
    assert ServeConfig.from_dict({"target": "t", "http_port": 0, "served_model_name": "m"}).http_port == 0
    for kw, field_ in ((dict(http_port=-1), "http_port"), (dict(http_port=70000), "http_port"),
                       (dict(http_port="80"), "http_port"), (dict(http_port=True), "http_port"),
                       (dict(served_model_name=""), "served_model_name")):
        with pytest.raises(ValueError, match=field_):
            ServeConfig.from_dict({"target": "t", **kw})
    from flashpd.cluster.http_server import HttpServer
    with pytest.raises(ValueError, match="loopback"):
        HttpServer(None, host="0.0.0.0")


class _FakeBackend:
    """A backend whose requests fail as the prompt's first id says (no engine): for the status mapping."""

    has_drafter, default_draft_width, vocab_size, max_positions, alive = False, None, 100, 64, True

    def __init__(self) -> None:
        self.cancelled = []

    def counts(self):
        from flashpd.engine.load import Load
        return Load(running=0, waiting=0, kv_blocks_free=4, kv_blocks_total=4, kv_block_size=16)

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import EngineStopped, Event
        from flashpd.engine.scheduler import PromptTooLong, RequestFailed

        from flashpd.decode_node.engine_loop import Overloaded

        fail = {1: EngineStopped("no decode worker is available"), 2: TimeoutError("took too long"),
                3: PromptTooLong("needs 9 KV blocks; a worker has 4"),
                6: Overloaded("the decode workers are overloaded; retry later")}
        if prompt[0] in fail:
            raise fail[prompt[0]]
        h = FakeHandle()
        h.events.put(Event("tokens", tokens=[7]))
        h.events.put(Event("error", error=RequestFailed("request failed: boom")) if prompt[0] == 4 else
                     Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))
        return h

    def cancel(self, h) -> None:
        self.cancelled.append(h)


def test_backend_failures_map_to_http_statuses():
    from flashpd.cluster.http_api import build_app
    from flashpd.cluster.http_server import start_http

    be = _FakeBackend()
    srv = start_http(build_app(be, None, "fake", None))
    try:
        c = openai.OpenAI(base_url=f"http://{srv.address}/v1", api_key="none", max_retries=0, timeout=10.0)
        for first, typ, status, code in ((1, openai.InternalServerError, 503, "service_unavailable"),
                                         (2, openai.InternalServerError, 504, "timeout"),
                                         (3, openai.BadRequestError, 400, "context_length_exceeded"),
                                         (4, openai.InternalServerError, 500, "internal_error")):
            got = _error(lambda: c.completions.create(model="fake", prompt=[first, 5], max_tokens=2))
            assert (got[0], got[1], got[2]["code"]) == (typ, status, code), got
            if first == 3:  # the prompt alone fits the worker's KV cache: max_tokens is what does not (it said prompt)
                assert got[2]["param"] == "max_tokens" and got[2]["message"].startswith("max_tokens: "), got
        # overloaded is busy, not gone: 503 with Retry-After (gRPC: RESOURCE_EXHAUSTED)
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10.0)
        conn.request("POST", "/v1/completions", json.dumps({"model": "fake", "prompt": [6], "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("retry-after")) == (503, "1")
        assert "overloaded" in json.loads(resp.read())["error"]["message"]
        conn.close()
        # after the first token a failure arrives in the stream: an error event, then [DONE]
        with pytest.raises(openai.APIError, match="boom"):
            list(c.completions.create(model="fake", prompt=[4, 5], max_tokens=2, stream=True))
        r = c.completions.create(model="fake", prompt=[5], max_tokens=2, extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == [7] and r.choices[0].text == ""  # no tokenizer: ids only
        for bad in (lambda: c.completions.create(model="fake", prompt="text", max_tokens=2),
                    lambda: c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])):
            assert _error(bad)[1] == 400
        c.close()
    finally:
        srv.stop()


class _EndlessBackend(_FakeBackend):
    """Requests that send one token and then never finish (an engine busy on long outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted: list = []

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()
        h.events.put(Event("tokens", tokens=[7]))
        self.submitted.append(h)  # a list: two request threads submit at once (a += could lose one)
        return h


def test_stopping_ends_requests_in_flight_with_an_error_not_a_bare_500_or_a_cut_stream():
    """A server stopped while requests run past its grace period ends them with OpenAI's error: a non-streamed
    request gets a 503 with the JSON body, a stream an error event and then [DONE]; both are cancelled in the
    backend. (uvicorn's own cancel at the grace period's end gave a plain-text 500 and a stream cut with no error
    event.)"""
    import http.client

    from flashpd.cluster.http_api import build_app
    from flashpd.cluster.http_server import HttpServer

    be = _EndlessBackend()
    srv = HttpServer(build_app(be, None, "fake", None), grace_s=1.0).start()
    got: dict = {}

    def post(body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10.0)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse()

    def plain() -> None:
        r = post({"model": "fake", "prompt": [5], "max_tokens": 4})
        got["plain"] = (r.status, r.getheader("content-type"), r.read().decode())

    def stream() -> None:
        r = post({"model": "fake", "prompt": [5], "max_tokens": 4, "stream": True})
        got["stream"] = [line for line in r.read().decode().splitlines() if line]

    threads = [threading.Thread(target=f) for f in (plain, stream)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10.0
    while len(be.submitted) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(be.submitted) == 2
    time.sleep(0.2)  # both requests are in flight, each holding its first token
    srv.stop()
    for t in threads:
        t.join(10.0)
    status, ctype, text = got["plain"]
    assert status == 503 and ctype == "application/json", got["plain"]
    err = json.loads(text)["error"]
    assert err["code"] == "service_unavailable" and "shutting down" in err["message"]
    events = got["stream"]
    assert events[-1] == "data: [DONE]", events
    last = json.loads(events[-2][len("data: "):])
    assert "shutting down" in last["error"]["message"], events
    deadline = time.monotonic() + 5.0
    while len(be.cancelled) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(be.cancelled) == 2


def test_a_request_whose_end_is_already_queued_is_served_whole_through_a_drain():
    """A drain ends requests still waiting on the engine; one whose tokens and final event are already queued is
    answered, not a 503 with its output thrown away (and a needless cancel sent to the backend)."""
    import asyncio

    from flashpd.cluster import http_api
    from flashpd.decode_node.engine_loop import Event

    be = _FakeBackend()
    st = http_api.build_app(be, None, "fake", None).state.flashpd
    r = http_api._Req(prompt=[5], params=None, method="native", draft_width=None, stops=[], stream=False,
                      include_usage=False, return_token_ids=False)

    async def collect(h) -> list:
        return [(p.tokens, p.finish_reason) async for p in http_api._Run(st, r, h, None).pieces()]

    done = FakeHandle()
    for ev in (Event("tokens", tokens=[7]), Event("tokens", tokens=[8]), Event("done", finish_reason="length")):
        done.events.put(ev)
    st.drain()
    assert asyncio.run(collect(done)) == [([7, 8], None), ([], "length")]
    behind = FakeHandle()  # a stream far behind: more queued tokens than one merged event takes (256)
    for t in range(300):
        behind.events.put(Event("tokens", tokens=[t]))
    behind.events.put(Event("done", finish_reason="length"))
    got = asyncio.run(collect(behind))
    assert [t for toks, _ in got for t in toks] == list(range(300)) and got[-1][1] == "length"
    waiting = FakeHandle()
    waiting.events.put(Event("tokens", tokens=[7]))  # no end in sight: ended by the drain
    with pytest.raises(http_api.APIError, match="shutting down"):
        asyncio.run(collect(waiting))
    deadline = time.monotonic() + 10.0
    while waiting not in be.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)  # cancels go out on a thread of their own
    assert be.cancelled == [waiting]


class _BehindBackend(_FakeBackend):
    """A backend whose stream fell behind by every step: all of a request's token events (each with its `sent`
    flag) and its final event are queued before the front end reads the first."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[threading.Event] = []

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()
        for toks in ([7], [8, 9], [10]):
            self.flags.append(threading.Event())
            h.events.put(Event("tokens", tokens=toks, sent=self.flags[-1]))
        h.events.put(Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))
        return h


def test_a_stream_that_fell_behind_gets_its_tokens_in_one_chunk():
    """The HTTP front end merges the token events queued behind a stream (engine_loop.coalesce): one SSE chunk
    with every token in order, then the final chunk; every merged event is marked sent."""
    from flashpd.cluster.http_api import build_app
    from flashpd.cluster.http_server import start_http

    be = _BehindBackend()
    srv = start_http(build_app(be, None, "fake", None))
    try:
        c = openai.OpenAI(base_url=f"http://{srv.address}/v1", api_key="none", max_retries=0, timeout=10.0)
        chunks = [[(ch.model_extra or {}).get("token_ids"), ch.finish_reason]
                  for ev in c.completions.create(model="fake", prompt=[5], max_tokens=4, stream=True,
                                                 extra_body={"return_token_ids": True})
                  for ch in ev.choices]
        assert chunks == [[[7, 8, 9, 10], None], [[], "length"]], chunks
        assert len(be.flags) == 3 and all(f.is_set() for f in be.flags)
        c.close()
    finally:
        srv.stop()
