"""The HTTP server's request deadline (cluster/http_guard.py) on a real uvicorn server on 127.0.0.1: connections
that trickle their headers, stop mid-body, send nothing, or trickle after a response are closed at the deadline
and counted; a stream that outlasts the deadline once its request is read is not cut; keep-alive still serves a
second request; and with the connection limit held by trickling clients, a new client is served once the
deadline has passed (it got 503 for ever before); a client that stops reading a stream is cut at the deadline
and its request cancelled. Past the limit the 503 is an OpenAI error body. Also the HTTP
text's stop-string search at the end of a stream.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from flashpd.cluster.http_api import build_app
from flashpd.cluster.http_server import HttpServer
from tests._fake_handle import FakeHandle

DEADLINE_S = 1.0
WAIT_S = 10.0


class _SlowBackend:
    """A backend that streams one token every `gap_s` (no engine): a response that outlasts the deadline."""

    has_drafter, default_draft_width, vocab_size, max_positions, alive = False, None, 100, 64, True

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s

    def counts(self):
        from flashpd.engine.load import Load
        return Load(running=0, waiting=0, kv_blocks_free=4, kv_blocks_total=4, kv_block_size=16)

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()

        def feed() -> None:
            for t in range(params.max_tokens):
                time.sleep(self.gap_s)
                h.events.put(Event("tokens", tokens=[10 + t]))
            h.events.put(Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))

        threading.Thread(target=feed, daemon=True).start()
        return h

    def cancel(self, h) -> None:
        pass


def _request(n_tokens: int, stream: bool = False) -> bytes:
    body = json.dumps({"model": "fake", "prompt": [5], "max_tokens": n_tokens, "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    """Whether the server closes s within within_s (reads until EOF; any bytes a response sent are skipped)."""
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _read_response(s: socket.socket) -> bytes:
    """One whole non-streamed response (Content-Length framed) from s."""
    s.settimeout(WAIT_S)
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0])
    while len(rest) < n:
        rest += s.recv(65536)
    return head + b"\r\n\r\n" + rest


@pytest.fixture
def server():
    srv = HttpServer(build_app(_SlowBackend(gap_s=0.4), None, "fake", None), max_concurrent=2,
                     request_timeout_s=DEADLINE_S).start()
    yield srv
    srv.stop()


def _connect(srv: HttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT_S)


def _one_request(srv: HttpServer) -> bytes:
    """A one-token completion on a fresh connection: the whole response."""
    c = _connect(srv)
    try:
        c.sendall(_request(1))
        return _read_response(c)
    finally:
        c.close()


def test_stalled_requests_are_closed_at_the_deadline(server):
    req = _request(1)
    silent, trickle, half_body = _connect(server), _connect(server), _connect(server)
    half_body.sendall(req[:-5])  # headers whole, body 5 bytes short
    t0 = time.monotonic()
    stop = threading.Event()

    def drip() -> None:  # a header byte every 0.1 s: each byte would cancel uvicorn's own keep-alive timer
        for b in req:
            if stop.is_set():
                return
            try:
                trickle.send(bytes([b]))
            except OSError:
                return
            time.sleep(0.1)

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        for s in (silent, trickle, half_body):
            assert _closed_by_server(s, DEADLINE_S + 3.0)
        assert time.monotonic() - t0 < DEADLINE_S + 3.0
        assert server.requests_timed_out >= 3
    finally:
        stop.set()
        t.join(WAIT_S)
        for s in (silent, trickle, half_body):
            s.close()


def test_a_request_read_in_time_is_not_cut_and_keep_alive_serves_again(server):
    s = _connect(server)
    try:
        before = server.requests_timed_out
        s.sendall(_request(5))  # 5 tokens, 0.4 s apart: 2 s of work, twice the deadline
        t0 = time.monotonic()
        r = _read_response(s)
        assert time.monotonic() - t0 > DEADLINE_S
        assert r.startswith(b"HTTP/1.1 200"), r[:200]
        body = json.loads(r.partition(b"\r\n\r\n")[2])
        assert body["usage"]["completion_tokens"] == 5
        s.sendall(_request(1))  # the same connection, within the next request's deadline
        assert _read_response(s).startswith(b"HTTP/1.1 200")
        assert server.requests_timed_out == before
        s.send(b"POST")  # then a trickle after a response: closed at the deadline, not held
        assert _closed_by_server(s, DEADLINE_S + 3.0)
        assert server.requests_timed_out == before + 1
    finally:
        s.close()


def test_trickling_clients_cannot_hold_the_connection_limit(server):
    """max_concurrent 2 gives uvicorn a limit of 20 connections: 24 trickling ones fill it; past the deadline
    they are gone and a new client's request is served."""
    held = [_connect(server) for _ in range(24)]
    try:
        for s in held:
            s.send(b"P")
        time.sleep(DEADLINE_S + 1.0)
        assert _one_request(server).startswith(b"HTTP/1.1 200")
        assert all(_closed_by_server(s, 2.0) for s in held)
    finally:
        for s in held:
            s.close()


def test_the_connection_at_the_limit_is_served(server):
    """max_concurrent 2: at most 20 connections (docs/architecture.md). With 19 held, the 20th is served (the
    check counted the request's own connection against the limit: one fewer was served than documented)."""
    held = [_connect(server) for _ in range(19)]
    try:
        time.sleep(0.1)
        assert _one_request(server).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)


def test_past_the_connection_limit_a_request_gets_an_openai_503(server):
    """max_concurrent 2: uvicorn's limit is 20 connections. With 20 held, a request gets 503 with a JSON error body
    and Retry-After (uvicorn's own 503 was text/plain), /health is still answered; once they are gone, a request
    is served."""
    held = [_connect(server) for _ in range(20)]
    try:
        time.sleep(0.1)
        head, _, body = _one_request(server).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), head
        err = json.loads(body)["error"]
        assert err["code"] == "service_unavailable" and err["type"] == "server_error" and err["message"]
        assert server.requests_refused_busy >= 1
        # a full server is alive: /health is answered (a probe read 503 as down, and 18-528 sockets that send
        # nothing were enough to get there)
        c = _connect(server)
        try:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_response(c).startswith(b"HTTP/1.1 200")
        finally:
            c.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert _one_request(server).startswith(b"HTTP/1.1 200")


class _FloodBackend(_SlowBackend):
    """A backend whose one request streams 4,000-token chunks (8 KB of token ids each, a millisecond apart) until it
    is cancelled (or 3,000 chunks): far more than the socket buffers hold."""

    def __init__(self) -> None:
        super().__init__(gap_s=0.001)
        self.cancelled = threading.Event()

    def submit(self, prompt, params, method, draft_width, timeout_s, first_token=None):
        from flashpd.decode_node.engine_loop import Event

        h = FakeHandle()

        def feed() -> None:
            for _ in range(3000):
                if self.cancelled.is_set():
                    return
                h.events.put(Event("tokens", tokens=[7] * 4000))
                time.sleep(self.gap_s)
            h.events.put(Event("done", finish_reason="length", stats={"acceptance_lengths": [], "tau": None}))

        threading.Thread(target=feed, daemon=True).start()
        return h

    def cancel(self, h) -> None:
        self.cancelled.set()


def _flood_stream() -> tuple[_FloodBackend, HttpServer, socket.socket]:
    """A server over a _FloodBackend and a socket (4 KiB receive buffer) that has sent it a stream request."""
    be = _FloodBackend()
    srv = HttpServer(build_app(be, None, "fake", None), max_concurrent=2, request_timeout_s=DEADLINE_S).start()
    body = json.dumps({"prompt": [5], "max_tokens": 8, "stream": True, "return_token_ids": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return be, srv, s


def test_a_client_that_stops_reading_a_stream_is_cut_and_its_request_cancelled():
    """uvicorn has no write timeout: a client that stopped reading a stream held its connection (one of the limit's),
    the stream's task and all its queued output for ever, and its request ran on in the backend. Once the client has
    taken no bytes for the deadline, the connection is aborted and the request cancelled."""
    be, srv, s = _flood_stream()
    try:  # and never reads
        assert be.cancelled.wait(DEADLINE_S + 6.0), "the stalled stream was never cut"
        assert srv.responses_stalled == 1
        assert _closed_by_server(s, 5.0)
    finally:
        s.close()
        srv.stop()


def test_a_client_that_reads_a_stream_slowly_but_steadily_is_not_cut():
    """A reader slower than the stream (100 KB/s here) keeps the transport paused until the socket's send queue,
    megabytes by then, drains by half: such a client, reading all along, was cut at the deadline as if it had
    stopped. Bytes leaving the send queue count as reading."""
    be, srv, s = _flood_stream()
    try:
        s.settimeout(WAIT_S)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4 * DEADLINE_S:
            got = s.recv(2048)
            assert got, "the server closed a connection whose client was reading"
            time.sleep(len(got) / 100_000)
        assert srv.responses_stalled == 0 and not be.cancelled.is_set()
    finally:
        s.close()
        srv.stop()


def test_the_deadline_must_be_positive():
    with pytest.raises(ValueError, match="request_timeout_s"):
        HttpServer(None, request_timeout_s=0)


def test_a_stop_string_begun_in_held_text_and_ended_by_the_last_piece_is_found():
    """_Text holds back (longest stop - 1) characters; the final piece (what the detokenizer releases at the end)
    may complete a stop that began in them. Zeroing the hold before the search missed it."""
    from flashpd.cluster.http_api import _Text

    class _Rest:
        def finish(self) -> str:
            return "XY!"

    t = _Text(None, ["abXY"])
    t.tok, t.detok = object(), _Rest()  # a tokenizer is present; only the final piece matters here
    assert t._add("zzab") == ("z", False)
    assert t.finish() == ("z", True)  # "zzabXY!" cut before "abXY": "zz", of which "z" went out already
    t = _Text(None, ["abXY"])
    t.tok, t.detok = object(), _Rest()
    assert t._add("zz") == ("", False) and t.finish() == ("zzXY!", False)
