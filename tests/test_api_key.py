"""The public APIs' optional key (cluster/api_key.py, ServeConfig.api_key_file): with it, every gRPC call but Health
and every HTTP request but /health and /metrics must carry `Authorization: Bearer <key>`, and one without it is
refused before a backend sees it (gRPC UNAUTHENTICATED, HTTP 401 OpenAI-style); with it, the service's tokens are
those of the same service without a key. The key file is checked (a regular file, mode 600, one line of 16+ visible
ASCII characters) and errors never quote it. Real gRPC and HTTP servers on 127.0.0.1; a real colocated service on the
shipped demo pair for the end-to-end case (the router's path: tests/test_http_api.py's local-mode test)."""
from __future__ import annotations

import io
import json
import os
import threading
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest

from flashpd.cluster.api_key import bearer_ok, grpc_metadata, load_api_key
from flashpd.cluster.generation_client import GenerationClient, GenerationUnauthenticated
from flashpd.cluster.generation_server import serve_generation
from flashpd.cluster.http_api import build_app
from flashpd.cluster.http_server import start_http
from tests.test_http_frontdoor import _Backend
from tests.test_http_origin import _raw

KEY = "k3y-0123456789abcdef"
DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"


def _key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    p = tmp_path / "api.key"
    p.write_text(text)
    p.chmod(mode)
    return p


class _Counting(_Backend):
    """_Backend, counting what reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = 0
        self.lock = threading.Lock()

    def submit(self, prompt, params, method, draft_width, timeout_s, **_):  # (the gRPC API passes deadline_s)
        with self.lock:
            self.submitted += 1
        return super().submit(prompt, params, method, draft_width, timeout_s)


def test_the_key_file_is_checked_and_never_quoted(tmp_path):
    assert load_api_key(_key_file(tmp_path)) == KEY
    assert load_api_key(_key_file(tmp_path, KEY + "\r\n")) == KEY
    assert load_api_key(_key_file(tmp_path, KEY)) == KEY
    link = tmp_path / "link.key"
    link.symlink_to(_key_file(tmp_path))  # a mounted secret is a link to its file
    assert load_api_key(link) == KEY
    bad = {"readable by others": (KEY, 0o644, "chmod 600"), "group-writable": (KEY, 0o620, "chmod 600"),
           "short": ("short-key", 0o600, "at least 16"), "empty": ("", 0o600, "at least 16"),
           "a space": (KEY + " x", 0o600, "visible ASCII"), "two lines": (KEY + "\n" + KEY, 0o600, "visible ASCII"),
           "not ASCII": (KEY + "\u00e9", 0o600, "visible ASCII"), "huge": ("a" * 5000, 0o600, "longer than")}
    for what, (text, mode, says) in bad.items():
        p = _key_file(tmp_path, text, mode)
        with pytest.raises(ValueError, match=says) as e:
            load_api_key(p)
        assert str(p) in str(e.value) and KEY not in str(e.value), what
    with pytest.raises(ValueError, match="not a regular file"):
        load_api_key(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_key(tmp_path / "missing.key")
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):  # (a blocking open would hang here)
        load_api_key(fifo)


def test_a_key_that_is_empty_or_short_is_refused_where_it_is_given(tmp_path, monkeypatch):
    """Found by a review: `api_key_file: ""` started the service with no key (a config naming a key file must never
    serve without one), an empty key given to the servers let `Bearer` with nothing after it through, and a
    FLASHPD_API_KEY with a trailing CR (`$(cat file)` of a CRLF file) was quoted, key and all, in the load tool's
    errors."""
    from flashpd.bench.http_load import _headers
    from flashpd.cluster.config import ServeConfig

    for blank in ("", "  "):
        with pytest.raises(ValueError, match="api_key_file"):
            ServeConfig(target=str(DEMO / "target"), api_key_file=blank)
    for key in ("", "short", KEY + " "):
        with pytest.raises(ValueError, match="api_key"):
            start_http(build_app(_Backend(), None, "fake", None), api_key=key)
        with pytest.raises(ValueError, match="api_key"):
            serve_generation(_Backend(), api_key=key)
    monkeypatch.setenv("FLASHPD_API_KEY", KEY + "\r")
    for make in (lambda: GenerationClient("127.0.0.1:1"), _headers):
        with pytest.raises(ValueError, match="FLASHPD_API_KEY") as e:
            make()
        assert KEY not in str(e.value)


def test_bearer_values():
    assert bearer_ok(f"Bearer {KEY}", KEY) and bearer_ok(f"bearer {KEY}".encode(), KEY)
    for v in (None, KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", "Bearer ", "", f"Bearer{KEY}"):
        assert not bearer_ok(v, KEY), v
    with pytest.raises(ValueError, match="visible ASCII"):
        grpc_metadata("a key")


def test_grpc_calls_need_the_key_and_health_does_not(monkeypatch):
    monkeypatch.delenv("FLASHPD_API_KEY", raising=False)
    be = _Counting()
    server, port = serve_generation(be, api_key=KEY)
    address = f"127.0.0.1:{port}"
    try:
        for key in (None, "wrong-key-0123456789", KEY + "0"):
            with GenerationClient(address, timeout_s=10, api_key=key) as c:
                with pytest.raises(GenerationUnauthenticated, match="API key"):
                    c.generate_once([5, 6], max_tokens=1)
                with pytest.raises(GenerationUnauthenticated, match="API key"):
                    list(c.generate([5, 6], max_tokens=1))
                assert c.health()["serving"]  # probes carry no key
        assert be.submitted == 0
        # two authorization entries (one of them right) are refused too: the gate reads exactly one
        stub_channel = grpc.insecure_channel(address)
        from flashpd.cluster.generation_client import build_request
        from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(stub_channel).GenerateOnce(
                build_request([5, 6], max_tokens=1), timeout=10,
                metadata=(("authorization", "Bearer nope-nope-nope-nope"), ("authorization", f"Bearer {KEY}")))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub_channel.close()
        with GenerationClient(address, timeout_s=10, api_key=KEY) as c:
            assert c.generate_once([5, 6], max_tokens=1).token_ids == [65]
            assert [t for ch in c.generate([5, 6], max_tokens=1) for t in ch.token_ids] == [65]
        assert be.submitted == 2
        monkeypatch.setenv("FLASHPD_API_KEY", KEY)  # a client given no key sends the environment's
        with GenerationClient(address, timeout_s=10) as c:
            assert c.generate_once([5, 6], max_tokens=1).token_ids == [65]
        assert be.submitted == 3
    finally:
        server.stop(None)


def test_http_routes_need_the_key_but_health_and_metrics_do_not(monkeypatch):
    from flashpd.bench.http_load import served_model

    monkeypatch.delenv("FLASHPD_API_KEY", raising=False)
    be = _Counting()
    srv = start_http(build_app(be, None, "fake", None), allowed_origins=("https://ui.example.com",), api_key=KEY)
    me = {"Host": f"127.0.0.1:{srv.port}", "Content-Type": "application/json"}
    try:
        for auth in (None, "Bearer wrong-key-0123456789", KEY, f"Basic {KEY}", f"Bearer {KEY}x"):
            headers = dict(me, **({"Authorization": auth} if auth else {}))
            status, body = _raw(srv, headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (auth, body)
            assert _raw.headers["www-authenticate"] == "Bearer" and KEY not in json.dumps(body)
            assert _raw(srv, headers, path="/v1/models", method="GET")[0] == 401
        assert be.submitted == 0
        assert _raw(srv, me, path="/health", method="GET")[0] == 200
        assert _raw(srv, me, path="/metrics", method="GET")[0] == 404  # past the gate (this app has no metrics)
        for auth in (f"Bearer {KEY}", f"bearer {KEY}"):
            status, body = _raw(srv, dict(me, Authorization=auth))
            assert status == 200 and body["choices"][0]["text"] is not None
        assert _raw(srv, dict(me, Authorization=f"Bearer {KEY}"), path="/v1/models", method="GET")[0] == 200
        assert be.submitted == 2
        # a listed origin's page: its preflight needs no key, and it can read the 401 (CORS headers on it)
        ui = dict(me, Origin="https://ui.example.com")
        status, _ = _raw(srv, dict(ui, **{"Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization,content-type"}),
                         method="OPTIONS")
        assert status == 200 and _raw.headers["access-control-allow-origin"] == "https://ui.example.com"
        assert _raw(srv, ui)[0] == 401 and _raw.headers["access-control-allow-origin"] == "https://ui.example.com"
        assert _raw(srv, dict(ui, Authorization=f"Bearer {KEY}"))[0] == 200
        for headers in (me, ui, dict(me, **{"Access-Control-Request-Method": "POST"})):  # no preflight: the key
            assert _raw(srv, headers, method="OPTIONS")[0] == 401
        assert srv.guard.app.app.refused == 14  # (CORSMiddleware -> ApiKeyGate)
        with pytest.raises(RuntimeError, match="HTTP 401.*invalid_api_key"):  # the load tool without the key
            served_model(f"http://127.0.0.1:{srv.port}/v1")
        monkeypatch.setenv("FLASHPD_API_KEY", KEY)  # ... and with the environment's
        assert served_model(f"http://127.0.0.1:{srv.port}/v1") == "fake"
    finally:
        be.release.set()
        srv.stop()


def test_a_keyed_service_serves_its_tokens_to_keyed_clients_only(tmp_path, monkeypatch):
    """Colocated, the demo pair: gRPC and HTTP with the key give the tokens of the same prompt through gRPC; without
    it both refuse; `flashpd client --api-key-file` sends it; a bad key file fails the start, naming the file."""
    openai = pytest.importorskip("openai")
    from flashpd.cli import main
    from flashpd.cluster.config import ServeConfig
    from flashpd.cluster.service import start_service

    monkeypatch.delenv("FLASHPD_API_KEY", raising=False)
    key_file = _key_file(tmp_path)
    base = dict(target=str(DEMO / "target"), draft=str(DEMO / "drafter"), device="cpu", dtype="float32",
                kv_cache_tokens=2048, torch_threads=1, http_port=0, engine_process=False)
    with pytest.raises(ValueError, match="chmod 600"):
        (tmp_path / "loose").mkdir()
        start_service(ServeConfig(**base, api_key_file=str(_key_file(tmp_path / "loose", mode=0o644))))
    svc = start_service(ServeConfig(**base, api_key_file=str(key_file)))
    try:
        with GenerationClient(svc.address, timeout_s=60, api_key=KEY) as g:
            ref = g.generate_once("def add(a, b):\n", max_tokens=8, ignore_eos=True)
        assert len(ref.token_ids) == 8
        with GenerationClient(svc.address, timeout_s=60) as g:
            with pytest.raises(GenerationUnauthenticated):
                g.generate_once("def add(a, b):\n", max_tokens=8)
            assert g.health()["kv_blocks_free"] == g.health()["kv_blocks_total"]
        ok = openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key=KEY, max_retries=0, timeout=60.0)
        r = ok.completions.create(model="target", prompt="def add(a, b):\n", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref.token_ids and r.choices[0].text == ref.text
        bad = openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="not-the-key-0123", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="target", prompt="x", max_tokens=2)
        ok.close()
        bad.close()
        out = io.StringIO()
        with redirect_stdout(out):
            rc = main(["client", "--address", svc.address, "--prompt", "def add(a, b):\n", "--max-tokens", "8",
                       "--ignore-eos", "--api-key-file", str(key_file)])
        assert rc == 0 and json.loads(out.getvalue().splitlines()[-1])["token_ids"] == ref.token_ids
        assert main(["client", "--address", svc.address, "--prompt", "x", "--max-tokens", "2"]) == 1
    finally:
        svc.stop()


def test_a_refused_request_ends_its_connection_unread():
    """A 401 goes out before the body is read, and ends the connection: an unauthenticated client cannot push its
    body (up to 100 MB here) into the server for request_timeout_s (a review saw 12 MB in 2 s read and dropped)."""
    import socket

    srv = start_http(build_app(_Backend(), None, "fake", None), api_key=KEY)
    total = 100 << 20
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % total)
            sent, chunk = 0, b"x" * (1 << 16)
            with pytest.raises(OSError):  # reset or broken pipe, once the server has closed
                while sent < total:
                    sent += s.send(chunk)
        assert sent < total // 4, sent
    finally:
        srv.stop()
