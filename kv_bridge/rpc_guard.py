"""Register a gRPC servicer so that undecodable requests and missing credentials get clear statuses.

grpcio's generated `add_XServicer_to_server` parses each request with the message's FromString
before the handler runs; bytes that do not parse (garbage, a truncated message, invalid UTF-8 in a
string field, an over-long varint) then end the call with INTERNAL "Exception deserializing
request!". A client error is INVALID_ARGUMENT, so `add_guarded` builds the method handlers itself
from the service descriptor: the deserializer never raises, and the handler answers
INVALID_ARGUMENT for a request that did not parse. `TokenGate`, a server interceptor, checks a call's
metadata while grpcio looks up its handler, before a request byte is read: a call without the token gets
UNAUTHENTICATED at once, and no worker thread waits on a stranger's request. `CallLimit` bounds the calls in
flight but Health's.
"""
from __future__ import annotations

import hmac
import threading
from typing import Any, Callable, Iterator, Sequence

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

TOKEN_HEADER = "x-flashpd-token"
MAX_ECHO = 64  # characters of a client's value an error message may quote


def echo(value: object) -> str:
    """repr() of a client-supplied value, capped at MAX_ECHO characters (error messages travel in
    trailing metadata, whose size is limited: a long echo would turn INVALID_ARGUMENT into
    RESOURCE_EXHAUSTED)."""
    r = repr(value)
    return r if len(r) <= MAX_ECHO else r[:MAX_ECHO] + f"...({len(r)} chars)"


class _Undecodable:
    """What the guarded deserializer returns for bytes that are not a valid message."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name = type_name
        self.reason = str(error).split(": ", 1)[-1][:MAX_ECHO]


def _deserializer(cls: type) -> Callable[[bytes], Any]:
    name = cls.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as e:  # noqa: BLE001  DecodeError, RuntimeWarning-as-error, anything the runtime raises
            return _Undecodable(name, e)

    return parse


def _reject(msg: Any, context: grpc.ServicerContext, on_invalid: Callable[[], None] | None = None) -> None:
    """INVALID_ARGUMENT for a request that did not decode; on_invalid() first (the service counts its rejections)."""
    if isinstance(msg, _Undecodable):
        if on_invalid is not None:
            on_invalid()
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"request: not a valid {msg.type_name} message ({msg.reason})")


def _checked_stream(it: Iterator[Any], context: grpc.ServicerContext,
                    on_invalid: Callable[[], None] | None = None) -> Iterator[Any]:
    for msg in it:
        _reject(msg, context, on_invalid)
        yield msg


Metadata = Sequence[tuple[str, str | bytes]]


def token_authorizer(token: str) -> Callable[[Metadata], bool]:
    """Accept a call whose metadata carries `x-flashpd-token: <token>` (constant-time comparison)."""
    want = token.encode()

    def ok(metadata: Metadata) -> bool:
        for k, v in metadata or ():
            if k == TOKEN_HEADER:
                got = v.encode() if isinstance(v, str) else bytes(v)
                return hmac.compare_digest(got, want)
        return False

    return ok


class TokenGate(grpc.ServerInterceptor):
    """UNAUTHENTICATED for a call whose metadata `authorize` refuses, decided from the call's metadata alone.

    grpcio reads a unary request on a worker thread before the handler runs, so a gate inside the handler
    lets a stranger hold a worker by never sending its message. The refusal handler is request-streaming
    and aborts without reading: the call ends as soon as a worker picks it up."""

    def __init__(self, authorize: Callable[[Metadata], bool], exempt: Sequence[str] = (),
                 credential: str = TOKEN_HEADER) -> None:
        self._authorize = authorize
        self.exempt = frozenset(exempt)  # methods answered without it (the public API's Health)
        self.credential = credential  # what the refusal says is missing

    def intercept_service(self, continuation, handler_call_details):
        name = handler_call_details.method.rsplit("/", 1)[-1]
        if name in self.exempt or self._authorize(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)

        def refuse(request_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: missing or wrong {self.credential}")

        return grpc.stream_unary_rpc_method_handler(refuse)


class CallLimit(grpc.ServerInterceptor):
    """At most `limit` calls at once of every method but the `exempt` ones (Health): a server full of requests still
    answers its probes. grpcio's own bound (maximum_concurrent_rpcs) counts every call, so a saturated server
    answered Health RESOURCE_EXHAUSTED, and a probe read that as down. The server is given a few threads more than
    `limit` (HEALTH_RESERVE) for the exempt calls and the refusals, and room for calls waiting for them (rpc_bound);
    a call past the limit ends RESOURCE_EXHAUSTED on the thread that picks it up, before its request is read."""

    def __init__(self, limit: int, exempt: Sequence[str] = ("Health",)) -> None:
        self.limit = limit
        self.exempt = frozenset(exempt)
        self._lock = threading.Lock()
        self.in_flight = 0

    def _enter(self, context: grpc.ServicerContext, name: str) -> None:
        with self._lock:
            full = self.in_flight >= self.limit
            if not full:
                self.in_flight += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{name}: the server has {self.limit} calls in flight, its limit; try again later")

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def intercept_service(self, continuation, handler_call_details):
        h = continuation(handler_call_details)
        name = handler_call_details.method.rsplit("/", 1)[-1]
        if h is None or name in self.exempt:
            return h
        kind = (h.request_streaming, h.response_streaming)
        inner = {(False, False): h.unary_unary, (False, True): h.unary_stream, (True, False): h.stream_unary,
                 (True, True): h.stream_stream}[kind]

        # counted until the handler's thread leaves it, not until the call ends: a cancelled call's handler may run
        # on (blocked in a submit) and hold its thread, which then the Health reserve paid for
        if h.response_streaming:
            def behavior(arg, context):
                self._enter(context, name)
                try:
                    yield from inner(arg, context)
                finally:
                    self._leave()
        else:
            def behavior(arg, context):
                self._enter(context, name)
                try:
                    return inner(arg, context)
                finally:
                    self._leave()
        return _FACTORIES[kind](behavior, request_deserializer=h.request_deserializer,
                                response_serializer=h.response_serializer)


HEALTH_RESERVE = 4  # threads and concurrent RPCs a server keeps for the calls CallLimit exempts
# calls grpcio admits beyond the threads (at least this, or the limit's own size): they wait for a thread. A call
# CallLimit refuses still counts in grpcio's bound while it is refused, so with that bound at the threads' count a
# flood of retried calls took the Health reserve and probes got grpcio's RESOURCE_EXHAUSTED; a refusal takes
# microseconds, so Health queued behind some waits that long
REFUSAL_QUEUE = 64


def rpc_bound(limit: int) -> tuple[int, int]:
    """(threads, grpcio's maximum_concurrent_rpcs) of a server whose CallLimit is `limit`."""
    threads = limit + HEALTH_RESERVE
    return threads, threads + max(REFUSAL_QUEUE, limit)


def _wrap(fn: Callable, m: MethodDescriptor, on_invalid: Callable[[], None] | None = None) -> Callable:
    if m.client_streaming and m.server_streaming:
        def behavior(it, context):
            yield from fn(_checked_stream(it, context, on_invalid), context)
    elif m.client_streaming:
        def behavior(it, context):
            return fn(_checked_stream(it, context, on_invalid), context)
    elif m.server_streaming:
        def behavior(req, context):
            _reject(req, context, on_invalid)
            yield from fn(req, context)
    else:
        def behavior(req, context):
            _reject(req, context, on_invalid)
            return fn(req, context)
    return behavior


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_guarded(server: grpc.Server, servicer: object, service: ServiceDescriptor,
                on_invalid: Callable[[], None] | None = None) -> None:
    """Add every method of `service` (a ServiceDescriptor of a generated _pb2 module) to `server`,
    served by the servicer's method of the same name, undecodable requests answered INVALID_ARGUMENT (a
    token, where one is needed, is TokenGate's: give it to grpc.server as an interceptor). on_invalid: called
    once for each such request (so that a service's count of invalid requests includes them)."""
    handlers = {}
    for m in service.methods:
        fn = getattr(servicer, m.name)
        in_cls = message_factory.GetMessageClass(m.input_type)
        factory = _FACTORIES[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = factory(_wrap(fn, m, on_invalid), request_deserializer=_deserializer(in_cls),
                                   response_serializer=lambda msg: msg.SerializeToString())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, d: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = getattr(d, "wait_for_ready", None), getattr(d, "compression", None)
        self.metadata = metadata


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._entry = (TOKEN_HEADER, token)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(d, [*(d.metadata or ()), self._entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class ChannelClosed(grpc.RpcError, ValueError):
    """A call on a channel closed under its caller (a worker restart swapped the client, a pool stopping): an
    RpcError whose code is UNAVAILABLE, since the peer is being replaced or gone, and the ValueError that grpc
    raises for a plain closed channel. Raised by a blocking call, a future's result() and a stream's iteration."""

    MESSAGE = "Cannot invoke RPC on closed channel!"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.MESSAGE


class _CloseGuard(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Closes the channel under an intercepted one only when no call is being made on it. grpcio (1.85) makes a
    call's handle on the channel under the interceptors at each call, and on a closed channel that crashed the
    process (SIGSEGV in _get_registered_call_handle), where a plain channel raises ValueError. A call after
    close() now raises ChannelClosed; a call in progress when close() comes closes the channel as it returns
    (a blocking call ends with its reply or its deadline; a stream or future already made is cancelled then)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._calls = 0
        self._closing = False
        self._closed = False

    def _call(self, continuation, details, arg):
        with self._lock:
            if self._closing:
                raise ChannelClosed()
            self._calls += 1
        try:
            return continuation(details, arg)
        finally:
            with self._lock:
                self._calls -= 1
                last = self._closing and self._calls == 0 and not self._closed
                self._closed = self._closed or last
            if last:
                self._channel.close()

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _call

    def close(self) -> None:
        with self._lock:
            self._closing = True
            now = self._calls == 0 and not self._closed
            self._closed = self._closed or now
        if now:
            self._channel.close()


class _GuardedChannel(grpc.Channel):
    """An intercepted channel whose close() goes through its _CloseGuard."""

    def __init__(self, inner: grpc.Channel, guard: _CloseGuard) -> None:
        self._inner, self._guard = inner, guard

    def subscribe(self, callback, try_to_connect=False):
        return self._inner.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        return self._inner.unsubscribe(callback)

    def unary_unary(self, *args, **kwargs):
        return self._inner.unary_unary(*args, **kwargs)

    def unary_stream(self, *args, **kwargs):
        return self._inner.unary_stream(*args, **kwargs)

    def stream_unary(self, *args, **kwargs):
        return self._inner.stream_unary(*args, **kwargs)

    def stream_stream(self, *args, **kwargs):
        return self._inner.stream_stream(*args, **kwargs)

    def close(self) -> None:
        self._guard.close()

    def __enter__(self) -> "_GuardedChannel":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """The channel, with `x-flashpd-token: <token>` added to every call's metadata (what token_authorizer checks
    on the other side). Close the returned channel, not `channel`: its close waits for calls being made on it
    (_CloseGuard says why)."""
    guard = _CloseGuard(channel)
    return _GuardedChannel(grpc.intercept_channel(channel, guard, _TokenInterceptor(token)), guard)
