"""Closed-loop load through the OpenAI-compatible HTTP API (cluster/http_api.py): bench/load_gen.py's
run_load over HTTP. `concurrency` clients, each streaming one /v1/completions request after another
(server-sent events) until the prompts run out; TTFT is taken at the first streamed token, latency at the
end of the stream, both at the client.

Each client holds one keep-alive connection (the standard library's http.client: no client library's
per-chunk parsing competes with the server for the cores), asks for `return_token_ids` so every token
arrives with its ids, and reads flashpd's stats (acceptance_lengths, prefill_ms) from the final chunk's
"flashpd" field. A request that fails is recorded with its error, never retried, and the run still ends
(each wait is bounded).
"""
from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

from flashpd.bench.load_gen import RequestResult, run_closed_loop
from flashpd.cluster.api_key import key_from_env

# the gRPC API's defaults where OpenAI's differ (greedy), so both APIs serve the same requests
GRPC_DEFAULTS = {"temperature": 0.0}


def _endpoint(base_url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of a base URL such as http://127.0.0.1:8000 or http://127.0.0.1:8000/v1."""
    u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
    if u.scheme != "http":
        raise ValueError(f"base_url: only http:// is supported, got {base_url!r}")
    prefix = u.path.rstrip("/")
    if not prefix.endswith("/v1"):
        prefix += "/v1"
    return u.hostname or "127.0.0.1", u.port or 80, prefix


def request_body(prompt: str | list[int], model: str | None, **request_kw) -> dict:
    """A streamed /v1/completions body from run_load's request keywords (max_tokens, method, block_size,
    temperature, top_p, top_k, seed, ignore_eos); 0 / "" mean the default, as in the gRPC API."""
    body = {**GRPC_DEFAULTS, **{k: v for k, v in request_kw.items() if v is not None}}
    if not body.get("method"):
        body.pop("method", None)
    if not body.get("block_size"):
        body.pop("block_size", None)
    body.update(prompt=prompt, stream=True, return_token_ids=True)
    if model is not None:
        body["model"] = model
    return body


def _headers() -> dict[str, str]:
    """A request's headers: JSON, and the service's key when FLASHPD_API_KEY holds one (cluster/api_key.py)."""
    key = key_from_env()
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _stream_one(conn: http.client.HTTPConnection, path: str, body: dict, r: RequestResult, timeout_s: float) -> None:
    t0 = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers=_headers())
    resp = conn.getresponse()
    if resp.status != 200:
        raw = resp.read()
        try:
            msg = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw[:200].decode(errors="replace")
        r.error = f"HTTP {resp.status}: {msg}"
        return
    done = False
    while True:
        line = resp.readline()
        if not line:
            break
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"the request ran past {timeout_s:g} s")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        ev = json.loads(data)
        if "error" in ev:
            r.error = f"stream error: {ev['error'].get('message')}"
            break
        for c in ev.get("choices") or []:
            toks = c.get("token_ids") or []
            if toks and r.ttft_ms is None:
                r.ttft_ms = (time.perf_counter() - t0) * 1e3
            r.tokens.extend(toks)
            if c.get("finish_reason") is not None:
                stats = ev.get("flashpd") or {}
                r.acceptance_lengths = list(stats.get("acceptance_lengths") or [])
                r.prefill_ms = stats.get("prefill_ms")
                r.service_ttft_ms = stats.get("ttft_ms")
    resp.read()  # the rest of the chunked body, so the connection can carry the next request
    if done and r.error is None:
        r.latency_ms = (time.perf_counter() - t0) * 1e3
    elif r.error is None:
        r.error = "the stream ended without data: [DONE]"


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model GET /v1/models lists."""
    host, port, prefix = _endpoint(base_url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", f"{prefix}/models", headers=_headers())
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:  # (a keyed service without FLASHPD_API_KEY: 401)
            raise RuntimeError(f"GET {prefix}/models: HTTP {resp.status}: {body[:300].decode('utf-8', 'replace')}")
        return json.loads(body)["data"][0]["id"]
    finally:
        conn.close()


def run_load_http(base_url: str, prompts: list, concurrency: int, timeout_s: float = 300.0, model: str | None = None,
                  procs: int = 1, **request_kw) -> tuple[list[RequestResult], float]:
    """Send every prompt (token ids or text) once; request_kw as run_load's (max_tokens, method, ignore_eos,
    ...; greedy unless temperature is given). model: None = the one the server lists. procs > 1: the clients
    run in that many processes (bench/load_procs.py). Returns the results in prompt order and the wall time of
    the whole run in seconds."""
    model = model or served_model(base_url, min(timeout_s, 30.0))
    return run_closed_loop(http_clients, base_url, prompts, concurrency, timeout_s, procs,
                           {**request_kw, "model": model}, "http-load")


class _Conn:
    """One client's keep-alive connection; a request that failed leaves a fresh one for the next."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.conn = http.client.HTTPConnection(host, port, timeout=timeout_s)

    def renew(self) -> None:
        self.conn.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def __enter__(self) -> "_Conn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def http_clients(base_url: str, timeout_s: float, request_kw: dict):
    """A client thread's connection and one streamed /v1/completions request through it (load_procs'
    ClientFactory). request_kw carries the served `model`."""
    host, port, prefix = _endpoint(base_url)
    path = f"{prefix}/completions"
    kw = dict(request_kw)
    model = kw.pop("model")

    def open_conn() -> _Conn:
        return _Conn(host, port, timeout_s)

    def one(c: _Conn, prompt, r: RequestResult) -> None:
        try:
            _stream_one(c.conn, path, request_body(prompt, model, **kw), r, timeout_s)
        except (OSError, http.client.HTTPException, ValueError) as e:
            r.error = f"{type(e).__name__}: {e}"
        if r.error is not None:  # a fresh connection for the next request
            c.renew()

    return open_conn, one
