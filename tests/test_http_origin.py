"""The HTTP API refuses what a web page's browser sends for it (cluster/http_origin.py): on loopback a Host that is
not a loopback name (DNS rebinding), and an Origin other than the request's own or a configured one (a cross-origin
"simple" POST ran a generation before). Clients that are not browsers are served as before. Real HTTP servers on
127.0.0.1 with a fake backend; the requests as a browser sends them, over raw sockets."""
from __future__ import annotations

import json
import socket

import pytest

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.http_api import build_app
from flashpd.cluster.http_origin import normalise_host, normalise_origin, origin_matches, split_host
from flashpd.cluster.http_server import HttpServer, start_http

from tests.test_http_frontdoor import _Backend

BODY = b'{"prompt": [5, 6], "max_tokens": 1}'


def _raw(srv: HttpServer, headers: dict[str, str], path: str = "/v1/completions", body: bytes = BODY,
         method: str = "POST", version: str = "1.1") -> tuple[int, dict]:
    """One request with exactly these headers (urllib sets its own Host); the status and the JSON body (the
    response's headers in `_raw.headers`)."""
    head = f"{method} {path} HTTP/{version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    with socket.create_connection((srv.host, srv.port), timeout=30) as s:
        s.sendall(head.encode("latin-1") + b"Connection: close\r\n\r\n" + (body if method == "POST" else b""))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    _raw.headers = {k.strip().lower(): v.strip() for k, _, v in
                    (line.decode("latin-1").partition(":") for line in head.split(b"\r\n")[1:])}
    try:
        return status, json.loads(body or b"null")
    except ValueError:  # (a CORS preflight's answer is plain text)
        return status, {"text": body.decode("latin-1")}


@pytest.fixture(scope="module")
def srv():
    be = _Backend()
    s = start_http(build_app(be, None, "fake", None), allowed_origins=("https://ui.example.com",),
                   allowed_hosts=("api.example.com",))
    yield s
    be.release.set()
    s.stop()


def test_clients_that_are_not_browsers_are_served(srv):
    me = f"127.0.0.1:{srv.port}"
    for host in (me, f"localhost:{srv.port}", "127.0.0.2", "LOCALHOST", "[::1]:80", "localhost.",
                 "api.example.com", "API.example.com.:443"):  # (the last: a proxy's public name, allowed)
        assert _raw(srv, {"Host": host, "Content-Type": "application/json"})[0] == 200, host
    assert _raw(srv, {"Content-Type": "application/json"}, version="1.0")[0] == 200  # HTTP/1.0: no Host at all
    assert srv.guard.refused == 0


def test_a_rebound_name_is_refused_before_the_app_runs(srv):
    """DNS rebinding: the page's own name resolves to 127.0.0.1, so its requests are same-origin to the API."""
    before = srv.guard.refused
    for host in ("attacker.example:%d" % srv.port, "localhost.attacker.example", "127.0.0.1.nip.io", "x", "",
                 "127.0.0.1:notaport", "user@127.0.0.1", "api.example.com.evil.example"):
        status, body = _raw(srv, {"Host": host, "Origin": f"http://{host}", "Content-Type": "text/plain"})
        assert status == 403 and body["error"]["code"] == "forbidden_host", (host, body)
    status, body = _raw(srv, {"Host": "attacker.example"}, path="/metrics", method="GET")
    assert status == 403  # every path: /health and /metrics tell a page about the service too
    assert srv.guard.refused == before + 9


def test_a_cross_origin_page_is_refused_and_a_same_or_listed_origin_is_served(srv):
    me = f"127.0.0.1:{srv.port}"
    for origin in ("http://evil.example", "null", f"http://localhost:{srv.port}", "http://127.0.0.1",
                   "https://ui.example.com:8443", "not a url"):
        # text/plain: a "simple" request a browser sends cross-origin with no preflight
        status, body = _raw(srv, {"Host": me, "Origin": origin, "Content-Type": "text/plain"})
        assert status == 403 and body["error"]["code"] == "forbidden_origin", (origin, body)
        assert "http_allowed_origins" in body["error"]["message"]
    for origin in (f"http://{me}", f"HTTP://127.0.0.1:{srv.port}", "https://ui.example.com",
                   "https://UI.example.com:443"):
        assert _raw(srv, {"Host": me, "Origin": origin, "Content-Type": "application/json"})[0] == 200, origin
    _raw(srv, {"Host": me, "Origin": "https://ui.example.com", "Content-Type": "application/json"})  # (as browsers
    assert _raw.headers.get("access-control-allow-origin") == "https://ui.example.com"  # write it): the page reads it
    # a listed origin's preflight (a JSON POST from a page served there) is answered, a foreign one's refused
    pre = {"Host": me, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, _ = _raw(srv, {**pre, "Origin": "https://ui.example.com"}, method="OPTIONS")
    assert status == 200 and _raw.headers["access-control-allow-origin"] == "https://ui.example.com"
    assert "POST" in _raw.headers["access-control-allow-methods"]
    assert _raw(srv, {**pre, "Origin": "http://evil.example"}, method="OPTIONS")[0] == 403
    _raw(srv, {"Host": me, "Origin": f"http://{me}", "Content-Type": "application/json"})
    assert "access-control-allow-origin" not in _raw.headers  # same origin: no CORS needed, none given
    with socket.create_connection((srv.host, srv.port), timeout=30) as s:  # two Origin headers: refused
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {me}\r\nOrigin: http://{me}\r\nOrigin: http://evil.example\r\n"
                  f"Connection: close\r\n\r\n".encode())
        assert s.recv(65536).split(b" ", 2)[1] == b"403"


def test_beyond_loopback_the_host_is_not_checked_but_the_origin_is():
    be = _Backend()
    s = HttpServer(build_app(be, None, "fake", None), host="0.0.0.0", allow_remote=True).start()  # (no CORS)
    try:
        s.host = "127.0.0.1"  # (dialled on loopback)
        assert _raw(s, {"Host": "gpu-box.internal:8000", "Content-Type": "application/json"})[0] == 200
        status, body = _raw(s, {"Host": "gpu-box.internal:8000", "Origin": "http://evil.example"})
        assert status == 403 and body["error"]["code"] == "forbidden_origin"
        assert _raw(s, {"Host": "gpu-box.internal:8000", "Origin": "http://gpu-box.internal:8000",
                        "Content-Type": "application/json"})[0] == 200
        assert "access-control-allow-origin" not in _raw.headers
    finally:
        be.release.set()
        s.stop()


def test_the_helpers_and_the_config_key():
    assert split_host("[::1]:8000") == ("::1", 8000) and split_host("LocalHost") == ("localhost", None)
    assert split_host("a:b") is None and split_host("a/b") is None and split_host("u@h") is None
    assert origin_matches("http://h:80", "h") and origin_matches("https://h", "h:443")
    assert not origin_matches("http://h", "h:8080") and not origin_matches("ftp://h", "h")
    assert not origin_matches("http://h/x", "h") and not origin_matches("http://h", "")
    assert normalise_origin("HTTPS://UI.Example.com:443") == "https://ui.example.com"
    assert normalise_origin("http://[::1]:81") == "http://[::1]:81" and normalise_origin("*") == "*"
    for bad in ("ui.example.com", "http://h/path", "ws://h", "http://h:99999"):
        with pytest.raises(ValueError, match="allowed origin"):
            normalise_origin(bad)
    assert normalise_host("API.Example.com.") == "api.example.com" and normalise_host("[::1]") == "::1"
    for bad in ("h:80", "h:", "http://h", "h/x", " h", "", "u@h"):
        with pytest.raises(ValueError, match="allowed host"):
            normalise_host(bad)
    cfg = ServeConfig.from_dict({"target": "t", "http_allowed_origins": ["https://UI.example.com"],
                                 "http_allowed_hosts": ["API.example.com"]})
    assert cfg.http_allowed_origins == ("https://ui.example.com",) and hash(cfg)
    assert cfg.http_allowed_hosts == ("api.example.com",)
    with pytest.raises(ValueError, match="http_allowed_hosts: .*allowed host"):
        ServeConfig.from_dict({"target": "t", "http_allowed_hosts": ["api.example.com:443"]})
    for bad, what in (("https://a.example", "must be a list"), (["https://a.example/x"], "allowed origin"),
                      ([3], "not a string")):
        with pytest.raises(ValueError, match=f"http_allowed_origins: .*{what}"):
            ServeConfig.from_dict({"target": "t", "http_allowed_origins": bad})
