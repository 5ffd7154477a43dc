"""The HTTP API's guard against web pages: requests a browser sends on a page's behalf are refused.

The API has no authentication: on loopback (the default bind) only this machine's processes reach it. A web page
open in a browser on this machine reaches it too. A cross-origin POST with a "simple" content type (text/plain)
runs without a CORS preflight, so any page could start generations; with DNS rebinding (the page's own name made
to resolve to 127.0.0.1) the page is same-origin to the API and reads the replies too. Two checks, in front of the
app (an ASGI middleware):

- served on a loopback address, a request's Host must name a loopback host (localhost, 127.0.0.0/8, ::1) or one of
  `allowed_hosts` (the public name of a proxy on this host that passes Host through): a rebound name is refused.
  Served beyond loopback (allow_remote), the names the service is reached by are not known here, and anyone on the
  network can call it directly anyway (the README's proxy advice);
- a request carrying an Origin (browsers send one on every cross-origin request and every POST) must come from the
  origin it is addressed to (Origin's host:port = Host) or one of `allowed_origins`: else refused. Clients that are
  not browsers send no Origin. The allowed origins also get CORS answers (preflights and response headers, by
  Starlette's CORSMiddleware: `guarded`), so a page served from one can call the API and read its replies.

Refusals are OpenAI-style 403s (JSON), counted in `refused`.
"""
from __future__ import annotations

import json
from urllib.parse import urlsplit

from flashpd.kv_bridge.server import is_loopback

DEFAULT_PORTS = {"http": 80, "https": 443}


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (host, port): the host lower-cased, an IPv6 literal without brackets; None when malformed."""
    try:
        u = urlsplit(f"//{value}")
        host, port = u.hostname, u.port
    except ValueError:  # a port that is not a number, or out of range
        return None
    if not host or u.username is not None or u.path or u.query or u.fragment:
        return None
    return host, port


def origin_matches(origin: str, host: str) -> bool:
    """Whether an Origin header names the origin a request's Host addresses (the scheme's default port filled in)."""
    try:
        o = urlsplit(origin)
        h = urlsplit(f"{o.scheme}://{host}")
        oport, hport = o.port or DEFAULT_PORTS.get(o.scheme), h.port or DEFAULT_PORTS.get(o.scheme)
    except ValueError:
        return False
    return o.scheme in DEFAULT_PORTS and bool(o.hostname) and o.hostname == h.hostname and oport == hport \
        and not (o.path or o.query or o.fragment or o.username is not None)


def normalise_host(name: str) -> str:
    """An allowed Host name as it is compared (lower-case, no trailing dot); ValueError for one with a port, a path
    or anything else a Host's name cannot be, named."""
    parsed = split_host(name) if isinstance(name, str) and name.strip() == name else None
    if parsed is None or parsed[1] is not None or name.endswith(":"):
        raise ValueError(f"allowed host {name!r} is not a host name (no scheme, port or path)")
    return parsed[0].rstrip(".")


def normalise_origin(origin: str) -> str:
    """An allowed origin as it is compared ("scheme://host[:port]", lower-cased; "null" and "*" as they are);
    ValueError for anything else (a path, a missing scheme), named."""
    if origin in ("*", "null"):
        return origin
    try:
        o = urlsplit(origin)
        port = o.port
    except ValueError:
        raise ValueError(f"allowed origin {origin!r} is not scheme://host[:port]") from None
    if o.scheme not in DEFAULT_PORTS or not o.hostname or o.path or o.query or o.fragment or o.username is not None:
        raise ValueError(f"allowed origin {origin!r} is not http(s)://host[:port]")
    host = f"[{o.hostname}]" if ":" in o.hostname else o.hostname
    return f"{o.scheme}://{host}" + (f":{port}" if port is not None and port != DEFAULT_PORTS[o.scheme] else "")


class BrowserGuard:
    """ASGI middleware: the module's two checks, then `app`. loopback_only: check Host (the server is bound to a
    loopback address); allowed_origins: origins other than the request's own that may call (normalise_origin's
    form; "*": any)."""

    def __init__(self, app, loopback_only: bool, allowed_origins: tuple[str, ...] = (),
                 allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.loopback_only = loopback_only
        self.allowed = frozenset(normalise_origin(o) for o in allowed_origins)
        self.hosts = frozenset(normalise_host(h) for h in allowed_hosts)
        self.refused = 0

    def _refusal(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, str] | None:
        hosts = [v for k, v in headers if k == b"host"]
        origins = [v for k, v in headers if k == b"origin"]
        if len(hosts) > 1 or len(origins) > 1:
            return "a request carries one Host and at most one Origin header", "bad_headers"
        host = hosts[0].decode("latin-1") if hosts else ""
        if self.loopback_only and hosts:  # (no Host: an HTTP/1.0 client, never a browser)
            parsed = split_host(host)
            name = parsed[0].rstrip(".") if parsed is not None else ""
            if not name or not (is_loopback(name) or name in self.hosts):
                return (f"Host {host[:100]!r} is not a loopback name: this server answers only requests addressed to "
                        "this machine (a web page's rebound name is refused); a proxy's public name passed through "
                        "as Host belongs in http_allowed_hosts", "forbidden_host")
        if origins:
            origin = origins[0].decode("latin-1")
            if "*" in self.allowed or origin_matches(origin, host):
                return None
            try:
                if normalise_origin(origin) in self.allowed:
                    return None
            except ValueError:
                pass
            return (f"requests from the web page origin {origin[:100]!r} are refused (a browser's cross-origin "
                    "request); list it in http_allowed_origins to allow it", "forbidden_origin")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        why = self._refusal(scope.get("headers") or [])
        if why is None:
            await self.app(scope, receive, send)
            return
        self.refused += 1
        body = _error(*why)
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})  # (its body is not read)
        await send({"type": "http.response.body", "body": body})


def guarded(app, loopback_only: bool, allowed_origins: tuple[str, ...] = (),
            allowed_hosts: tuple[str, ...] = (), api_key: str | None = None) -> BrowserGuard:
    """`app` behind the guard, with CORS answers for the allowed origins (none: no CORS headers at all, so a
    browser lets no other origin's page read a reply), and behind cluster/api_key.py's gate when api_key is set
    (inside the CORS layer: an allowed page reads its 401, and its preflights need no key)."""
    inner = app
    if api_key is not None:
        from flashpd.cluster.api_key import ApiKeyGate  # noqa: PLC0415

        inner = ApiKeyGate(app, api_key)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware  # noqa: PLC0415

        origins = [normalise_origin(o) for o in allowed_origins]
        inner = CORSMiddleware(inner, allow_origins=origins, allow_methods=["GET", "POST"], allow_headers=["*"])
    return BrowserGuard(inner, loopback_only, allowed_origins, allowed_hosts)
