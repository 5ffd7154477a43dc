"""The HTTP API's event loop never waits on slow work (real HTTP servers on 127.0.0.1, fake backends): one loop
thread serves every stream and request, so anything that blocks it stalls them all.

- /health and /metrics read the backend: with the engine in its own process each read is a round trip (up to
  STATS_TIMEOUT_S = 5 s when the engine is stuck; /metrics makes several). Done on the loop, a stuck engine froze
  the whole API for 5 s per /health probe and 45 s per /metrics scrape (measured on `flashpd serve` with the
  engine process stopped by SIGSTOP).
- A cancel (a client left) runs off the loop: engine_proc's cancel writes to the engine's pipe with no deadline,
  and with the engine stuck and the pipe full, one client leaving froze the whole API until the engine came back
  (`flashpd serve`, engine process stopped: GET /v1/models got no answer in 10 s).
- Parsing a request runs off the loop: tokenizing a long prompt (the tokenizers library's `encode` holds the
  interpreter lock throughout; TextTokenizer.encode takes its batch call, which lets it go), rendering a chat
  template, and chat's default max_tokens
  (backend.counts()).
- Stop strings: the text ends before the first one generated; searching for them costs linear work.

And two of the front door's answers: /v1/completions' logprobs=0 (the chosen tokens' logprobs) is refused, not
ignored; a client that leaves while sending its body is no server error (no tracebacks in the log).
"""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from flashpd.cluster.chat_template import ChatTemplate
from flashpd.cluster.http_api import build_app
from flashpd.cluster.http_server import start_http
from flashpd.engine.tokenizer import TextTokenizer
from tests._fake_handle import FakeHandle

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair" / "target"
STUCK_S = 8.0  # how long a blocked call stays blocked unless released (the test fails before that)
PROMPT_OK_S = 2.0  # a request the loop is free to serve answers well within this
TOK = TextTokenizer.from_dir(DEMO)
TEXT_IDS = TOK.encode("for i in range(10):\n    print(i * 2, 'ok')  # é ü 中文 🙂\n" * 400)


class _Backend:
    """A backend with no engine: each request gets one token and ends; counts() can be made to block."""

    has_drafter, default_draft_width, vocab_size, max_positions, alive = False, None, 4096, 4096, True

    def __init__(self) -> None:
        self.block = threading.Event()  # set: counts() blocks until `release` is set
        self.release = threading.Event()
        self.entered = threading.Event()  # counts() was entered while blocking

    def counts(self):
        from flashpd.engine.load import Load

        if self.block.is_set():
            self.entered.set()
            self.release.wait(STUCK_S)
        return Load(running=0, waiting=0, kv_blocks_free=256, kv_blocks_total=256, kv_block_size=16)

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()
        h.events.put(Event("tokens", tokens=[65]))
        h.events.put(Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))
        return h

    def cancel(self, h) -> None:
        pass


class _StuckCancelBackend(_Backend):
    """Its requests stream one token and never end; cancel() blocks (as engine_proc's does behind a full pipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        h = super().submit(prompt, params, method, draft_width, timeout_s, first_token)
        h.events.get()
        h.events.get()  # the "done": this request runs on
        from flashpd.decode_node.engine_loop import Event

        h.events.put(Event("tokens", tokens=[65]))
        return h

    def cancel(self, h) -> None:
        self.entered.set()
        self.release.wait(STUCK_S)
        self.cancelled.set()


class _StuckMetrics:
    """Metrics whose exposition waits on the engine (as live families do when the engine process is stuck)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def exposition(self) -> str:
        self.entered.set()
        self.release.wait(STUCK_S)
        return "# nothing\n"


def _get(base: str, path: str, timeout: float) -> int:
    with urllib.request.urlopen(f"{base}{path}", timeout=timeout) as r:
        return r.status


def _post(base: str, path: str, body: dict, timeout: float = 30.0) -> tuple[int, dict]:
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _models_answers_while(base: str, start, entered: threading.Event, release: threading.Event) -> float:
    """Start a call (in a thread) that blocks in the backend, then time GET /v1/models meanwhile; release after."""
    t = threading.Thread(target=start, daemon=True)
    t.start()
    try:
        assert entered.wait(PROMPT_OK_S * 5), "the blocking call was never made"
        t0 = time.monotonic()
        try:
            assert _get(base, "/v1/models", timeout=PROMPT_OK_S) == 200
        except OSError as e:  # a timeout: the loop was blocked
            raise AssertionError(f"GET /v1/models got no answer within {PROMPT_OK_S} s: {e!r}") from None
        return time.monotonic() - t0
    finally:
        release.set()
        t.join(STUCK_S + 5)


@pytest.fixture()
def served():
    be, metrics = _Backend(), _StuckMetrics()
    srv = start_http(build_app(be, TOK, "fake", metrics, chat_template=ChatTemplate.from_dir(DEMO)))
    try:
        yield be, metrics, f"http://{srv.address}"
    finally:
        be.release.set()
        metrics.release.set()
        srv.stop()


def test_a_stuck_health_read_does_not_stop_other_requests(served):
    be, _, base = served
    be.block.set()
    took = _models_answers_while(base, lambda: _get(base, "/health", STUCK_S + 5), be.entered, be.release)
    assert took < PROMPT_OK_S


def test_a_stuck_metrics_scrape_does_not_stop_other_requests(served):
    _, metrics, base = served
    took = _models_answers_while(base, lambda: _get(base, "/metrics", STUCK_S + 5), metrics.entered,
                                 metrics.release)
    assert took < PROMPT_OK_S


def test_chat_default_max_tokens_reads_the_backend_off_the_loop(served):
    """A chat request without max_tokens asks the backend how much KV room there is (counts())."""
    be, _, base = served
    be.block.set()
    got = {}

    def chat() -> None:
        got["r"] = _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                         timeout=STUCK_S + 5)

    took = _models_answers_while(base, chat, be.entered, be.release)
    assert took < PROMPT_OK_S
    assert got["r"][0] == 200 and got["r"][1]["usage"]["completion_tokens"] == 1


def test_chat_default_max_tokens_from_a_backend_not_serving_is_a_503(served):
    """A backend that is not serving (an engine process whose stats fail, a router with no decode worker up) has no
    KV figures to bound chat's default max_tokens by: 503, not an unbounded default or a 500. A request that sets
    max_tokens needs no figures and still goes to the backend."""
    be, _, base = served
    from flashpd.engine.load import Load  # noqa: PLC0415

    be.counts = lambda: Load(running=0, waiting=0, kv_blocks_free=0, kv_blocks_total=0, kv_block_size=0,
                             serving=False)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, body = _post(base, "/v1/chat/completions", chat)
    assert status == 503 and body["error"]["code"] == "service_unavailable", body
    assert "max_tokens" in body["error"]["message"], body
    status, body = _post(base, "/v1/chat/completions", {**chat, "max_tokens": 1})
    assert status == 200 and body["usage"]["completion_tokens"] == 1, body


class _WatchedTokenizer:
    """The demo tokenizer, recording which call tokenized a prompt and on which thread."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok, self.calls = tok, []

    def encode(self, text: str) -> list[int]:
        self.calls.append(threading.current_thread().name)
        return self.tok.encode(text)

    def tokens_over(self, text: str, limit: int) -> int | None:
        """Lets every text through to a whole encode (what the test times), as for a text that fits; its own
        thread is recorded too."""
        self.calls.append(threading.current_thread().name)
        return None

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


def test_tokenizing_a_long_prompt_does_not_stall_the_loop():
    """Prompts of about 260k characters (the most a 4096-position model takes) take the demo tokenizer about 0.15 s
    each to encode. They are tokenized off the loop's thread ("http-api"), checked on the calls themselves;
    TextTokenizer.encode lets go of the interpreter lock meanwhile (tests/test_generation_api.py checks that: with
    the library's single encode, even on another thread, the loop stalled). While a client sends them,
    GET /v1/models keeps answering (gaps of about 0.03 s here, 0.3 s with either undone; the bound is loose, for a
    loaded machine)."""
    tok = _WatchedTokenizer(TOK)
    srv = start_http(build_app(_Backend(), tok, "fake", None))
    base = f"http://{srv.address}"
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh ij\n") for _ in range(260_000)) for _ in range(2)]
    done = threading.Event()
    codes = []

    def client() -> None:
        try:
            for i in range(6):
                codes.append(_post(base, "/v1/completions", {"prompt": prompts[i % 2], "max_tokens": 1})[0])
        finally:
            done.set()

    try:
        t = threading.Thread(target=client, daemon=True)
        t.start()
        answered = [time.monotonic()]  # when each ping was answered
        while not done.is_set():
            assert _get(base, "/v1/models", timeout=10) == 200
            answered.append(time.monotonic())
            time.sleep(0.005)
        t.join(10)
    finally:
        srv.stop()
    assert codes == [400] * 6  # each is tokenized whole, then refused as too long for 4096 positions
    assert len(tok.calls) == 12 and "http-api" not in tok.calls, tok.calls
    gaps = [b - a for a, b in zip(answered, answered[1:])]
    assert len(gaps) >= 10 and max(gaps) < 1.0, (len(gaps), max(gaps))


def test_a_cancel_that_blocks_does_not_stop_other_requests():
    """A stream whose client leaves after its first chunk is cancelled; the cancel blocks in the backend, and the
    API goes on serving meanwhile. The cancel still reaches the backend."""
    import socket

    be = _StuckCancelBackend()
    srv = start_http(build_app(be, None, "fake", None))
    base = f"http://{srv.address}"

    def leave() -> None:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            body = json.dumps({"prompt": [5, 6], "max_tokens": 100, "stream": True, "return_token_ids": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data: " not in got:  # the headers, then the first chunk (its token)
                more = s.recv(4096)
                assert more, got
                got += more

    try:
        took = _models_answers_while(base, leave, be.entered, be.release)
        assert took < PROMPT_OK_S
        assert be.cancelled.wait(STUCK_S)
    finally:
        be.release.set()
        srv.stop()


def _run_text(stops: list[str], ids: list[int]) -> tuple[str, bool]:
    from flashpd.cluster.http_api import _Text

    t, out = _Text(TOK, stops), []
    for i in ids:
        s, n, stopped = t.push([i])
        out.append(s)
        if stopped:
            return "".join(out), True
    s, stopped = t.finish()
    return "".join(out) + s, stopped


def _first_stop(stops: list[str], ids: list[int]) -> tuple[str, bool]:
    """The text of `ids` that stops strings leave, by brute force: generation stops at the first token whose text
    completes a stop string; the text ends before the earliest of the stops then found."""
    for k in range(1, len(ids) + 1):
        text = TOK.decode(ids[:k]).rstrip("\ufffd")  # a character still incomplete is not text yet
        hits = [i for s in stops if (i := text.find(s)) >= 0]
        if hits:
            return text[:min(hits)], True
    return TOK.decode(ids), False


def test_stop_strings_cut_the_text_at_the_first_match():
    rng = random.Random(0)
    ids = TEXT_IDS[:300]
    full = TOK.decode(ids)
    for _ in range(100):
        stops = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.7:
                a = rng.randrange(len(full) - 1)
                stops.append(full[a:a + rng.randint(1, 12)])
            else:
                stops.append("never seen " * rng.randint(1, 30))
        assert _run_text(stops, ids) == _first_stop(stops, ids), stops


def test_many_stop_strings_cost_linear_work():
    """16 stop strings, one longer than any output (so every character is held back, as it may begin it): each token
    searched all the text so far for each stop: 9 s for these 30,400 tokens (0.3 s now), quadratic, and all of it on
    the event loop. A stop can only end in the new text, so each search starts len(stop) - 1 characters back.
    Timed in this thread's CPU time, not the wall's: other test processes sharing the cores once slowed the wall
    clock past the bound, while this thread's work stays what it is."""
    stops = [f"\x00{i}" for i in range(15)] + ["y" * 200_000]
    ids = TEXT_IDS + TEXT_IDS
    assert len(ids) > 30_000
    t0 = time.thread_time()
    assert _run_text(stops, ids) == (TOK.decode(ids), False)
    assert time.thread_time() - t0 < 3.0  # quadratic: 9 s of CPU here


def test_completions_logprobs_0_is_refused_not_ignored(served):
    """In /v1/completions, logprobs is how many alternatives to return besides the chosen token, whose logprob is
    always returned: logprobs=0 asks for the chosen tokens' logprobs. It was taken as "off" (answered with
    "logprobs": null). Chat's logprobs is a bool, and false is off there; null is off in both."""
    _, _, base = served
    for zero in (0, 0.0, -0.0):  # an integral float is the same count (it was let through as off)
        status, body = _post(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "logprobs": zero})
        assert status == 400 and body["error"]["param"] == "logprobs", (zero, body)
    for path, extra in (("/v1/completions", {"prompt": [5, 6], "logprobs": None}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": False}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": None,
                                                  "top_logprobs": 0})):
        status, body = _post(base, path, {"max_tokens": 1, **extra})
        assert status == 200 and body["choices"][0]["logprobs"] is None, (path, body)


def test_a_client_that_leaves_mid_body_is_not_a_server_error(caplog):
    """A client gone before its body arrived whole (or cut off by http_guard's request deadline, the slow-client
    defence) is no server failure: it logged two ERROR tracebacks each (the app's "request failed" and uvicorn's
    "Exception in ASGI application"), so any client could flood the log at will. Nothing is logged at ERROR now,
    and the server goes on serving."""
    import logging
    import socket

    srv = start_http(build_app(_Backend(), None, "fake", None))
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
                    time.sleep(0.2)  # the app is reading the body now
            status, _ = _post(f"http://{srv.address}", "/v1/completions", {"prompt": [5], "max_tokens": 1})
            assert status == 200
            time.sleep(0.2)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [(r.name, r.getMessage()) for r in errors]
    finally:
        srv.stop()


def test_stream_options_without_a_stream_is_refused(served):
    """stream_options asks for usage in a stream; with stream false it is refused naming it (as OpenAI and vLLM
    do), not ignored."""
    _, _, base = served
    status, body = _post(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1,
                                                   "stream_options": {"include_usage": True}})
    assert status == 400 and body["error"]["param"] == "stream_options", body
    status, body = _post(base, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1, "stream_options": None})
    assert status == 200, body


class _BrokenBackend(_Backend):
    def counts(self):  # a bug on the server's side (a backend's failures to serve map to their own statuses)
        raise KeyError("/secret/path/of/the/server")


def test_a_server_bug_answers_500_without_its_internals(caplog):
    """An unexpected exception answers 500 with an error id, and its text (paths, internals) only in the log."""
    srv = start_http(build_app(_BrokenBackend(), None, "fake", None))
    try:
        with caplog.at_level("ERROR", logger="flashpd.cluster.http_api"):
            req = urllib.request.Request(f"http://{srv.address}/health")
            try:
                urllib.request.urlopen(req, timeout=10)
                status, body = 200, {}
            except urllib.error.HTTPError as e:
                status, body = e.code, json.loads(e.read())
    finally:
        srv.stop()
    assert status == 500 and body["error"]["code"] == "internal_error", body
    assert "secret" not in json.dumps(body) and "KeyError" not in json.dumps(body)
    error_id = body["error"]["message"].split("error id ")[1][:12]
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_number_too_large_for_a_float_is_refused_naming_it(served):
    """A JSON integer with hundreds of digits as temperature or top_p is the client's error: math.isfinite raised
    OverflowError on it, and the client got a 500 (with two tracebacks in the log)."""
    _, _, base = served
    for name in ("temperature", "top_p"):
        raw = b'{"prompt": [5, 6], "max_tokens": 1, "%s": %s}' % (name.encode(), b"9" * 400)
        req = urllib.request.Request(f"{base}/v1/completions", data=raw, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).close()
            status, body = 200, {}
        except urllib.error.HTTPError as e:
            status, body = e.code, json.loads(e.read())
        assert status == 400 and body["error"]["param"] == name, (name, status, body)


class _ScanCount(str):
    """A rendered prompt that counts the characters its searches pass over."""

    scanned = 0

    def find(self, sub, start=0, *args):
        at = str.find(self, sub, start, *args)
        _ScanCount.scanned += (at + len(sub) if at >= 0 else len(self)) - start
        return at

    def __contains__(self, sub):
        _ScanCount.scanned += len(self)
        return str.__contains__(self, sub)


def test_checking_a_rendered_chat_costs_linear_work():
    """Each message of a chat is checked to be in the rendered prompt (a template that drops a role is an error).
    One search of the whole prompt per message was quadratic: a 1 MB body of 28,000 short messages cost 7 s of CPU
    before its 400. Each search now starts where the message before it ended; the work is counted, not timed."""
    from flashpd.cluster.chat_template import ChatTemplateError, _check_rendered

    template = ChatTemplate.from_dir(DEMO)
    messages = [{"role": "user" if i % 2 == 0 else "system", "content": f"m{i:05d} " + "x" * 20} for i in range(2000)]
    messages[0]["role"] = "system"
    text = template.render(messages)
    _ScanCount.scanned = 0
    _check_rendered(messages, _ScanCount(text))
    assert _ScanCount.scanned <= 2 * len(text), (_ScanCount.scanned, len(text))  # quadratic: ~1,000 x len(text)
    # a message the template left out is still found missing
    with pytest.raises(ChatTemplateError, match=r"messages\[3\]"):
        _check_rendered(messages[:3] + [{"role": "developer", "content": "not rendered anywhere"}], text)
