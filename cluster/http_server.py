"""The HTTP API's server: uvicorn on a thread of the serving process, started and stopped with the service.

The listening socket is bound here, before uvicorn starts, so port 0 gets a free port whose number is
known at once; the bind rule is the gRPC API's (loopback unless allow_remote). stop() lets requests in
flight finish for a grace period, then ends them with a 503 or a stream's error event (each cancel reaches the
backend: cluster/http_api.py), and joins the thread; every wait is bounded. A connection must deliver each request within request_timeout_s
(cluster/http_guard.py), and take each response's bytes with no pause that long, so clients that trickle bytes
or stop reading cannot hold uvicorn's connection limit.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from flashpd.cluster.http_guard import guarded_h11
from flashpd.cluster.http_origin import guarded
from flashpd.kv_bridge.server import is_loopback

log = logging.getLogger(__name__)

# how long before the grace period ends requests still running are ended by the app (stop()): each sees it within
# http_api's POLL_S (0.1 s), then writes its error
DRAIN_LEAD_S = 0.3


class HttpServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
                 max_concurrent: int = 256, grace_s: float = 2.0, request_timeout_s: float = 30.0,
                 allowed_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = (),
                 api_key: str | None = None) -> None:
        if not (allow_remote or is_loopback(host)):
            raise ValueError(f"host {host!r} is not loopback; pass allow_remote=True to expose the service")
        if api_key is not None and not is_loopback(host):
            log.warning("the HTTP API serves %s without TLS: its API key crosses the network in the clear (put a TLS "
                        "proxy in front)", host)
        self.host = host
        self.app = app
        # web pages' requests refused in front of the app (cluster/http_origin.py), and calls without the API key
        # when one is set (cluster/api_key.py)
        self.guard = guarded(app, is_loopback(host), allowed_origins, allowed_hosts, api_key)
        self.grace_s = grace_s
        self._protocol = guarded_h11(request_timeout_s)
        self.sock = _bind(host, port)
        self.port = int(self.sock.getsockname()[1])
        cfg = uvicorn.Config(self.guard, log_config=None, log_level="warning", access_log=False, lifespan="off",
                             # connections and requests (past it: 503); idle keep-alive connections count too
                             timeout_graceful_shutdown=grace_s, limit_concurrency=2 * max_concurrent + 16,
                             timeout_keep_alive=30, http=self._protocol)
        self.server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._run, name="http-api", daemon=True)
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001  start() reports it
            self._error = e
            log.exception("the HTTP server failed")

    def start(self, timeout_s: float = 30.0) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {self.address}: {self._error!r}")
            time.sleep(0.01)
        return self

    @property
    def requests_timed_out(self) -> int:
        """Connections closed because a request was not delivered whole within request_timeout_s."""
        return self._protocol.timeouts

    @property
    def requests_refused_busy(self) -> int:
        """Requests answered 503 (JSON) because the connection limit was reached."""
        return self._protocol.busy

    @property
    def responses_stalled(self) -> int:
        """Connections aborted because the client took no bytes of a response within request_timeout_s."""
        return self._protocol.stalls

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, give requests in flight grace_s, end the rest with the app's error (its `drain`, some
        DRAIN_LEAD_S before the grace period ends; uvicorn's own cancel at its end gave a bare 500 or a stream cut
        with no error event), join the thread."""
        self.server.should_exit = True
        lead = min(DRAIN_LEAD_S, self.grace_s / 2)
        if self._thread.is_alive():
            self._thread.join(self.grace_s - lead)
        drain = getattr(getattr(self.app, "state", None), "drain", None)
        if self._thread.is_alive() and drain is not None:
            drain()
        if self._thread.is_alive():
            self._thread.join(lead + 1.0)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(max(0.0, timeout_s - self.grace_s - 1.0))
            if self._thread.is_alive():
                log.warning("the HTTP server thread did not stop within %.0f s", timeout_s)
        try:
            self.sock.close()
        except OSError:
            pass


def _bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host.strip("[]"), port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"could not resolve {host}")
    fam, typ, proto, _, addr = infos[0]
    s = socket.socket(fam, typ, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(2048)
        s.setblocking(False)
    except OSError as e:
        s.close()
        raise OSError(f"could not bind {host}:{port}: {e}") from None
    return s


def start_http(app, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False,
               max_concurrent: int = 256, allowed_origins: tuple[str, ...] = (),
               allowed_hosts: tuple[str, ...] = (), api_key: str | None = None) -> HttpServer:
    """A started HTTP server for `app` on host:port (0 picks a free port)."""
    return HttpServer(app, host, port, allow_remote, max_concurrent, allowed_origins=allowed_origins,
                      allowed_hosts=allowed_hosts, api_key=api_key).start()
