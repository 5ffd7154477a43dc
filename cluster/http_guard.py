"""uvicorn's h11 protocol with a deadline on reading each request.

uvicorn (0.54) times out only an idle keep-alive connection, and a byte received cancels that timer, so a client
that opens connections and sends their headers or bodies a byte at a time holds each one forever; past
uvicorn's `limit_concurrency` every other client gets 503. Here a connection has `request_timeout_s` to deliver
each request whole (headers and body), counted from the connection's start or the end of the previous response;
past it the connection is closed (an app already reading that body sees a disconnect). Once a request is read,
the deadline is off: a long generation or stream is never cut by it. The response has the same bound the other
way: uvicorn has no write timeout, so a client that stops reading a response larger than the socket buffers (a
long stream) held its connection, the response's task and the output queued behind it for ever; here a connection
whose writes stay paused while the client takes nothing (no byte leaves the transport's buffer or the socket's send
queue) for request_timeout_s is aborted (closing would wait for the
unread bytes to drain), and the app sees a disconnect (a stream's request is cancelled in the backend). Past
uvicorn's connection limit a request gets an OpenAI-style 503 (JSON, Retry-After) instead of uvicorn's plain-text
one; /health and /metrics are answered even then.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import struct
import termios

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# h11 states of the client's side in which a request is still being read
_READING = (h11.IDLE, h11.SEND_BODY)
# answered even at the connection limit: a full server is alive, and a probe or scrape must not read it as down
ALWAYS_SERVED = ("/health", "/metrics")
_BUSY = json.dumps({"error": {"message": "the server is at its connection limit; retry shortly", "type": "server_error",
                              "param": None, "code": "service_unavailable"}}).encode()


async def _busy(send) -> None:
    """An OpenAI-style 503 (uvicorn's own is text/plain, which clients cannot read as an error)."""
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_BUSY)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": _BUSY})


def guarded_h11(request_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class whose connections must deliver each request within request_timeout_s seconds."""
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s!r}")

    class GuardedH11(H11Protocol):
        timeouts = 0  # connections closed by the deadline, over this class's servers (read by tests and metrics)
        busy = 0  # requests answered 503 at the connection limit
        stalls = 0  # connections aborted because the client took no bytes of a response for request_timeout_s

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # uvicorn's limit check answers text/plain: the same bound is kept here, in front of the app, with
            # an OpenAI error body (uvicorn's check is off for these connections)
            cap, self.limit_concurrency = self.limit_concurrency, None
            if cap is not None:
                inner, conns, tasks, cls = self.app, self.connections, self.tasks, type(self)

                async def app(scope, receive, send) -> None:
                    # this connection is among the connections and this request's task among the tasks: at most
                    # `cap` of each (uvicorn's own check, >= for connections, served one connection fewer)
                    if scope["type"] == "http" and (len(conns) > cap or len(tasks) > cap) \
                            and scope.get("path") not in ALWAYS_SERVED:
                        cls.busy += 1
                        await _busy(send)
                        return
                    await inner(scope, receive, send)

                self.app = app

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            self._stall: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state not in _READING:
                self._disarm()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm()  # the next request's clock; a pipelined one already buffered disarms it below
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall is None:  # the client may have stopped taking bytes: it has request_timeout_s to take some
                self._queued_at_pause = self._queued()
                self._stall = self.loop.call_later(request_timeout_s, self._stalled)

        def _queued(self) -> int:
            """Bytes of responses not yet taken by the client: this transport's buffer and the socket's send queue
            (Linux's SIOCOUTQ). The transport stays paused until the kernel's queue, which grows to megabytes, has
            drained by half: a client reading steadily but slower than the response comes paused it longer than
            request_timeout_s, and was cut as if it had stopped reading."""
            n = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
                except (OSError, ValueError):
                    pass
            return n

        def resume_writing(self) -> None:
            super().resume_writing()
            self._unstall()

        def _unstall(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _stalled(self) -> None:
            self._stall = None
            queued = self._queued()
            if queued < self._queued_at_pause:  # it took some bytes: it is reading, however slowly
                self._queued_at_pause = queued
                self._stall = self.loop.call_later(request_timeout_s, self._stalled)
                return
            type(self).stalls += 1
            log.info("aborted a connection to %s: it took no bytes of a response for %.0f s", self.client,
                     request_timeout_s)
            self.transport.abort()  # (close() would wait for the unread bytes, for ever)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self.conn.their_state not in _READING:
                return
            type(self).timeouts += 1
            log.info("closed a connection from %s: no whole request within %.0f s", self.client, request_timeout_s)
            self.transport.close()

    return GuardedH11
