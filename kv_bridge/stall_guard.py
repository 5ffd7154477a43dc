"""Cancel a call that stalls on its peer, so that a client cannot hold a server's worker thread forever.

A grpcio sync server gives every call a worker for its whole life. A client that opens a call and never
sends its request, stops in the middle of a request stream, or stops reading a response stream leaves that
worker blocked in grpcio, and max_workers such calls stop the server for everyone. `StallGuard` (a server
interceptor) marks the moments a handler waits on its peer (a request message to arrive, a response to be
taken) and a watchdog cancels a call that has waited longer than `idle_s`. Time the handler spends on its
own work (a store read, an engine step) never counts: only the peer can stall a call. A peer that does send,
but a byte now and then, is never idle: a handler that buffers what it receives holds such a peer to a byte
rate itself (the KV bridge's Put: server.py, _check_pace).

Unary requests are read inside the guard: their handlers are registered as request-streaming ones that take
the first message (a call that half-closes without one is INVALID_ARGUMENT, as grpcio's own check would be).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

import grpc

log = logging.getLogger(__name__)

DEFAULT_IDLE_S = 60.0  # a healthy peer sends or takes a message within a fraction of this


class _Watch:
    """One call: since when it waits on its peer (None while its handler works)."""

    __slots__ = ("context", "method", "since")

    def __init__(self, context: grpc.ServicerContext, method: str) -> None:
        self.context, self.method, self.since = context, method, None


class StallGuard(grpc.ServerInterceptor):
    """on_cancel(method) is called for each call the watchdog cancels (a counter)."""

    def __init__(self, idle_s: float = DEFAULT_IDLE_S, on_cancel: Callable[[str], None] | None = None) -> None:
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.idle_s = idle_s
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._calls: set[_Watch] = set()
        self._thread: threading.Thread | None = None

    # -- the watchdog: runs while calls are open -------------------------------------------------------
    def _register(self, context: grpc.ServicerContext, method: str) -> _Watch:
        w = _Watch(context, method)
        with self._lock:
            self._calls.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="stall-guard", daemon=True)
                self._thread.start()
        if not context.add_callback(lambda: self._forget(w)):  # however the call ends
            self._forget(w)  # it has ended already
        return w

    def _forget(self, w: _Watch) -> None:
        with self._lock:
            self._calls.discard(w)

    def _watch(self) -> None:
        period = min(1.0, self.idle_s / 4)
        while True:
            time.sleep(period)
            now = time.monotonic()
            with self._lock:
                if not self._calls:
                    self._thread = None
                    return
                stale = [w for w in self._calls if w.since is not None and now - w.since > self.idle_s]
                for w in stale:
                    self._calls.discard(w)
            for w in stale:
                log.warning("%s: the peer sent or took nothing for %.0f s; call cancelled", w.method, self.idle_s)
                w.context.cancel()
                if self._on_cancel is not None:
                    self._on_cancel(w.method)

    # -- the handlers ----------------------------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        h = continuation(handler_call_details)
        if h is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        opts = dict(request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
        if h.request_streaming and h.response_streaming:
            inner, unary_in = h.stream_stream, False
        elif h.request_streaming:
            inner, unary_in = h.stream_unary, False
        elif h.response_streaming:
            inner, unary_in = h.unary_stream, True
        else:
            inner, unary_in = h.unary_unary, True
        if h.response_streaming:
            return grpc.stream_stream_rpc_method_handler(self._streaming(inner, unary_in, method), **opts)
        return grpc.stream_unary_rpc_method_handler(self._unary(inner, unary_in, method), **opts)

    def _request(self, it: Iterator[Any], w: _Watch, unary_in: bool, context: grpc.ServicerContext) -> Any:
        """The handler's argument: the request iterator (watched), or the unary request read here."""
        watched = _watched(it, w)
        if not unary_in:
            return watched
        first = next(watched, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{w.method}: expects exactly one request message")
        return first

    def _unary(self, inner: Callable, unary_in: bool, method: str) -> Callable:
        def behavior(it, context):
            w = self._register(context, method)
            return inner(self._request(it, w, unary_in, context), context)
        return behavior

    def _streaming(self, inner: Callable, unary_in: bool, method: str) -> Callable:
        def behavior(it, context):
            w = self._register(context, method)
            responses = iter(inner(self._request(it, w, unary_in, context), context))
            try:
                for r in responses:  # computing the next one is the handler's own time
                    w.since = time.monotonic()  # grpcio sends `r` before it asks for the next
                    yield r
                    w.since = None
            finally:
                w.since = None
        return behavior


def _watched(it: Iterator[Any], w: _Watch) -> Iterator[Any]:
    while True:
        w.since = time.monotonic()
        try:
            msg = next(it)
        except StopIteration:
            return
        finally:
            w.since = None
        yield msg
