"""The public APIs' optional key (`api_key_file`): a bearer key every generation call must carry.

Without it the public APIs (the router's or colocated server's gRPC and HTTP) authenticate nobody and rely on
their loopback bind. With it, as OpenAI's API and `vllm serve --api-key` do, a call carries
`Authorization: Bearer <key>` (HTTP header, or gRPC metadata `authorization`), compared in constant time; a call
without it, or with another, is refused before its body is read: gRPC UNAUTHENTICATED (rpc_guard.TokenGate),
HTTP 401 with an OpenAI-style JSON error. Health stays open on both (load balancers and probes carry no key), and
so does the HTTP server's /metrics, as vLLM leaves them; every /v1 route needs the key.

The key is read from a file, never the config or the command line (which other users of the host can read in
/proc): a regular file (a link to one is followed: mounted secrets are links) with no group or other permission
bits, holding one line of 16 to 4,096 visible ASCII characters. Errors name the file, never its content. Clients
take the key as an argument, or from FLASHPD_API_KEY (key_from_env). The key crosses the network in the clear unless
a TLS proxy fronts the APIs (they serve no TLS themselves).
"""
from __future__ import annotations

import hmac
import json
import os
import stat
from typing import Callable, Sequence

AUTH_HEADER = "authorization"
ENV_VAR = "FLASHPD_API_KEY"  # a client's key when none is passed (key_from_env)
MIN_CHARS = 16
MAX_CHARS = 4096
OPEN_HTTP_PATHS = ("/health", "/metrics")  # answered without the key (probes, scrapers)
OPEN_GRPC_METHODS = ("Health",)


def load_api_key(path: str | os.PathLike) -> str:
    """The key in `path`, checked as the module says; ValueError naming the file and what is wrong with it."""
    name = f"api_key_file {os.fspath(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO in its place must not block the start)
    except OSError as e:
        raise ValueError(f"{name}: cannot read it ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"{name}: mode {st.st_mode & 0o777:o} lets other users read or change it; make it the "
                             "owner's alone (chmod 600)")
        raw = os.read(fd, MAX_CHARS + 3)
    finally:
        os.close(fd)
    text = raw.decode("ascii", errors="replace")
    key = text[:-1] if text.endswith("\n") else text
    key = key[:-1] if key.endswith("\r") else key
    if len(key) > MAX_CHARS:
        raise ValueError(f"{name}: longer than {MAX_CHARS} characters")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(f"{name}: the key must be one line of visible ASCII characters (no spaces, no second "
                         "line, nothing else in the file)")
    if len(key) < MIN_CHARS:
        raise ValueError(f"{name}: the key has {len(key)} characters; at least {MIN_CHARS} (e.g. the output of "
                         "`openssl rand -hex 32`)")
    return key


def _visible(key: object) -> bool:
    return isinstance(key, str) and bool(key) and all(0x21 <= ord(c) <= 0x7E for c in key)


def check_server_key(key: str) -> str:
    """A key a server may ask for: what load_api_key returns (ValueError otherwise, not quoting it). An empty key
    let `Authorization: Bearer` with nothing after it through."""
    if not _visible(key) or len(key) < MIN_CHARS:
        raise ValueError(f"api_key: at least {MIN_CHARS} visible ASCII characters (load_api_key's rules)")
    return key


def bearer_ok(value: str | bytes | None, key: str) -> bool:
    """Whether an Authorization value is `Bearer <key>` (the scheme's case ignored; constant-time in the key)."""
    if value is None:
        return False
    raw = value.encode("latin-1", errors="replace") if isinstance(value, str) else bytes(value)
    scheme, _, given = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(b" "), key.encode())


def grpc_authorizer(key: str) -> Callable[[Sequence[tuple[str, str | bytes]]], bool]:
    """rpc_guard.TokenGate's check: the call's `authorization` metadata is `Bearer <key>` (one such entry)."""
    check_server_key(key)

    def ok(metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        values = [v for k, v in metadata or () if k == AUTH_HEADER]
        return len(values) == 1 and bearer_ok(values[0], key)

    return ok


def key_from_env() -> str | None:
    """FLASHPD_API_KEY, the key clients send when none is passed (as the openai client reads OPENAI_API_KEY): the
    load tools and `flashpd client` then reach a keyed service unchanged; None when unset or empty."""
    key = os.environ.get(ENV_VAR) or None
    if key is not None and not _visible(key):  # (a CR from `$(cat file)` of a CRLF file: a header error quoted it)
        raise ValueError(f"{ENV_VAR}: must be one line of visible ASCII characters (the server's key; no spaces or "
                         "line ends)")
    return key


def grpc_metadata(key: str | None) -> tuple[tuple[str, str], ...] | None:
    """A client's call metadata for the key (None: no key); ValueError for a key no header can carry (gRPC's own
    error for one came at the first call, as a bare ValueError about metadata)."""
    if key is None:
        return None
    if not _visible(key):
        raise ValueError("api_key: must be a non-empty string of visible ASCII characters (the server's "
                         "api_key_file content)")
    return ((AUTH_HEADER, f"Bearer {key}"),)


class ApiKeyGate:
    """ASGI middleware: a request to a path outside OPEN_HTTP_PATHS (and not a CORS preflight: an OPTIONS with
    Origin and Access-Control-Request-Method, which browsers send without credentials and CORSMiddleware answers in
    front of this) must carry the key; else a 401 with an OpenAI-style error and `WWW-Authenticate: Bearer`, before
    its body is read. `refused` counts them. A websocket is refused too (the app has no websocket route)."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = check_server_key(key)
        self.refused = 0

    def _allowed(self, scope) -> bool:
        headers = scope.get("headers") or ()
        if scope.get("path", "") in OPEN_HTTP_PATHS:
            return True
        names = {k for k, _ in headers}
        if scope.get("method") == "OPTIONS" and b"origin" in names and b"access-control-request-method" in names:
            return True
        values = [v for k, v in headers if k == b"authorization"]
        return len(values) == 1 and bearer_ok(values[0], self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket" and not self._allowed(scope):
            self.refused += 1
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        self.refused += 1
        body = json.dumps({"error": {
            "message": "missing or wrong API key: send it as the header 'Authorization: Bearer <key>'",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer"),
                                # the body it sent ahead is not read: the connection ends with the answer
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
