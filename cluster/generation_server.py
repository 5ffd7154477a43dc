"""The generation gRPC service (proto/generation.proto) over a `Backend`.

A backend is what serves the requests: an `EngineLoop` (one process, colocated) or the `Router`
(prefill and decode workers behind it); the request checks, status codes, streaming and
cancellation here are the same for both. Bad requests get INVALID_ARGUMENT with the field named;
a prompt that cannot fit gets RESOURCE_EXHAUSTED ("prompt: ..."), and so does a request no worker can take now
(overloaded: try again later); method "dflash" on a server without a drafter
gets FAILED_PRECONDITION; a worker that is gone gives UNAVAILABLE. Bytes that are not a request
message get INVALID_ARGUMENT too (services are registered through kv_bridge/rpc_guard.add_guarded),
and an error message quotes at most 64 characters of a client's value (a long echo would overflow
the trailing metadata and turn the status into RESOURCE_EXHAUSTED). When the client goes away or its
deadline passes, the request is cancelled in the backend (its KV blocks are freed): by the RPC's
termination callback, or at once when the RPC had already ended before the request was submitted,
or when the streaming stops early for any other reason. Loopback only unless allow_remote (no
authentication).
"""
from __future__ import annotations

import json
import logging
import math
from concurrent import futures
from typing import Callable, Iterator, Mapping, Protocol

import grpc

from flashpd.cluster.detok import Detokenizer
from flashpd.decode_node.engine_loop import EngineStopped, Event, Overloaded, coalesce
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.engine.scheduler import PromptTooLong, RequestFailed
from flashpd.engine.load import Load
from flashpd.engine.sampling import SamplingParams
from flashpd.cluster.api_key import OPEN_GRPC_METHODS, grpc_authorizer
from flashpd.kv_bridge.rpc_guard import CallLimit, TokenGate, add_guarded, echo, rpc_bound, token_authorizer
from flashpd.kv_bridge.stall_guard import DEFAULT_IDLE_S, StallGuard
from flashpd.kv_bridge.server import is_loopback
from flashpd.kv_bridge.tls import BridgeTls

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
POLL_S = 0.1  # how often a waiting RPC re-checks that its client and the loop are still there
# A prompt_text longer than max_positions * this many characters cannot fit (no tokenizer's tokens
# average that much); it is refused before tokenizing (tokenizing megabytes of text holds a core for
# seconds: docs/results.md).
MAX_CHARS_PER_TOKEN = 64
MAX_DETAILS = 1024  # characters of an internal error's message a status carries


class Stream(Protocol):
    """One submitted request: its events ("tokens", then "done"; or "cancelled" / "error")."""

    def get(self, timeout: float) -> Event | None: ...


class Backend(Protocol):
    """What the servicer needs of whatever generates (EngineLoop, Router)."""

    has_drafter: bool
    default_draft_width: int | None
    vocab_size: int
    max_positions: int
    alive: bool

    def counts(self) -> Load: ...

    def submit(self, prompt: list[int], params: SamplingParams, method: str, draft_width: int | None,
               timeout_s: float, first_token: int | None = None, deadline_s: float | None = None) -> Stream:
        """timeout_s: how long to wait for the backend to take the request; deadline_s: the client's time left
        (None: no deadline), which a backend with calls no cancel reaches (the Router's prefill) must bound."""

    def cancel(self, h: Stream) -> None: ...


def abort_for(context: grpc.ServicerContext, e: BaseException) -> None:
    """End the RPC with the status code the contract gives this failure (the message capped: it
    travels in trailing metadata)."""
    if isinstance(e, RequestFailed):  # this request alone failed while being served; the server goes on
        context.abort(grpc.StatusCode.INTERNAL, _cap(str(e)))
    if isinstance(e, PromptTooLong):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _cap(f"prompt: {e}"))
    if isinstance(e, TimeoutError):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _cap(str(e)))
    if isinstance(e, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, _cap(str(e)))
    if isinstance(e, Overloaded):  # busy, not gone: the client may retry later
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, _cap(str(e)))
    context.abort(grpc.StatusCode.UNAVAILABLE,
                  _cap(str(e) if isinstance(e, EngineStopped) else f"{type(e).__name__}: {e}"))


def _cap(details: str) -> str:
    return details if len(details) <= MAX_DETAILS else details[:MAX_DETAILS] + "..."


def stats_message(d: dict | None) -> pb.Stats:
    d = d or {}
    return pb.Stats(version=PROTOCOL_VERSION, acceptance_lengths=d.get("acceptance_lengths") or [],
                    tau=d.get("tau") or 0.0, ttft_ms=d.get("ttft_ms") or 0.0, latency_ms=d.get("latency_ms") or 0.0,
                    prefill_ms=d.get("prefill_ms") or 0.0)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, loop: Backend, tokenizer=None, settings: Mapping[str, object] | None = None) -> None:
        self.loop = loop  # the backend (named for the EngineLoop it first was)
        self.tokenizer = tokenizer
        # Health's settings_json (ServeConfig.public_settings), encoded once: it never changes while serving
        self.settings_json = json.dumps(dict(settings), sort_keys=True) if settings else ""

    # ---- request checks --------------------------------------------------------------------------
    def _parse(self, r: pb.GenerateRequest, context: grpc.ServicerContext):
        """The request's prompt, SamplingParams, method and block size; every other request ends here
        with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED: cannot fit) naming the field."""
        bad = lambda msg: context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)  # noqa: E731
        too_big = lambda msg: context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)  # noqa: E731
        if r.version != PROTOCOL_VERSION:
            bad(f"version: {r.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        limit = self.loop.max_positions
        which = r.WhichOneof("prompt")
        if which == "prompt_text":
            prompt = self._encode(r.prompt_text, limit, bad, too_big)
        elif which == "prompt_ids":
            prompt = list(r.prompt_ids.ids)
            if not prompt:
                bad("prompt_ids: the prompt is empty")
            if len(prompt) >= limit:
                too_big(f"prompt_ids: {len(prompt)} tokens leave no room for output in the model's {limit} positions")
            vocab = self.loop.vocab_size
            for i, t in enumerate(prompt):
                if t >= vocab:
                    bad(f"prompt_ids[{i}]: token id {t} is out of the vocabulary (size {vocab})")
        else:
            bad("prompt: the prompt is empty (set prompt_text or prompt_ids)")
        if r.max_tokens <= 0:
            bad(f"max_tokens: must be positive, got {r.max_tokens}")
        method = r.method or ("dflash" if self.loop.has_drafter else "native")
        if method not in ("native", "dflash"):
            bad(f"method: must be 'native' or 'dflash', got {echo(r.method)}")
        if method == "dflash" and not self.loop.has_drafter:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "method: 'dflash' needs a server with a drafter")
        draft_width = None  # the request's field block_size is the DFlash draft width
        if method == "dflash" and r.block_size != 0:
            if not 2 <= r.block_size <= 16:
                bad(f"block_size: must be in [2, 16] for dflash (0 = the drafter's default), got {r.block_size}")
            draft_width = int(r.block_size)
        if not (r.temperature >= 0 and math.isfinite(r.temperature)):
            bad(f"temperature: must be a finite number >= 0 (below 1e-5: greedy), got {r.temperature}")
        top_p = r.top_p if r.top_p != 0 else 1.0
        if not 0 < top_p <= 1:  # NaN fails too
            bad(f"top_p: must be in (0, 1] (0 = 1.0), got {r.top_p}")
        if r.top_k < 0:
            bad(f"top_k: must be >= 0, got {r.top_k}")
        if len(prompt) + r.max_tokens > limit:
            too_big(f"max_tokens: {r.max_tokens} with the prompt's {len(prompt)} tokens exceeds the model's "
                    f"{limit} positions")
        params = SamplingParams(max_tokens=int(r.max_tokens), temperature=float(r.temperature), top_p=float(top_p),
                                top_k=int(r.top_k), seed=int(r.seed) if r.HasField("seed") else None,
                                ignore_eos=bool(r.ignore_eos))
        return prompt, params, method, draft_width

    def _encode(self, text: str, limit: int, bad: Callable[[str], None], too_big: Callable[[str], None]) -> list[int]:
        if not text:
            bad("prompt_text: the prompt is empty")
        if self.tokenizer is None:
            bad("prompt_text: this server has no tokenizer; send prompt_ids")
        if len(text) > limit * MAX_CHARS_PER_TOKEN:
            too_big(f"prompt_text: {len(text)} characters cannot fit the model's {limit} positions")
        over = self.tokenizer.tokens_over(text, limit)  # before encoding it whole: memory by tokens, not characters
        if over is not None:
            too_big(f"prompt_text: at least {over} tokens leave no room for output in the model's {limit} positions")
        try:
            prompt = self.tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001  whatever the tokenizer refuses is the client's text
            bad(f"prompt_text: the tokenizer refused it ({echo(str(e))})")
        if not prompt:
            bad("prompt_text: the prompt encodes to no tokens")
        if len(prompt) >= limit:
            too_big(f"prompt_text: {len(prompt)} tokens leave no room for output in the model's {limit} positions")
        return prompt

    def _start(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
               first_token: int | None = None, handoff=None, resumed: tuple[int, ...] = ()) -> Stream:
        try:  # a request refused before the loop takes it gives its prefill lease (handoff) back now
            prompt, params, method, draft_width = self._parse(request, context)
            if first_token is not None and not 0 <= first_token < self.loop.vocab_size:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"first_token: {first_token} is out of the vocabulary (size {self.loop.vocab_size})")
            if not context.is_active():  # the client went away already: submit nothing
                context.abort(grpc.StatusCode.CANCELLED, "request cancelled")
        except BaseException:
            self._release(handoff)
            raise
        timeout = context.time_remaining()
        try:
            extra = {"handoff": handoff} if handoff is not None else {}  # a decode worker's device-path import
            if resumed:  # a decode worker's retry of a request whose worker died (only an EngineLoop gets one)
                extra["resumed"] = resumed
            h = self.loop.submit(prompt, params, method, draft_width,
                                 timeout_s=min(timeout, 60.0) if timeout is not None else 60.0,
                                 first_token=first_token, deadline_s=timeout, **extra)
        except Exception as e:  # noqa: BLE001  each failure gets its status code; none escapes as UNKNOWN
            self._release(handoff)  # refused, timed out or stopped: never imported (a no-op if released already)
            abort_for(context, e)
        # from here on, however the RPC ends (done, client cancel, deadline), the request is dropped. An
        # RPC that ended while the submit waited runs no callbacks (add_callback returns False): drop it now.
        if not context.add_callback(lambda: self.loop.cancel(h)):
            self.loop.cancel(h)
            context.abort(grpc.StatusCode.CANCELLED, "request cancelled")
        return h

    def _resumed_end(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                     resumed: tuple[int, ...]) -> str | None:
        """A retry's output so far, checked: how it ends the request by itself ("stop", "length"), or None."""
        _, params, _, _ = self._parse(request, context)
        vocab = self.loop.vocab_size
        for i, t in enumerate(resumed):
            if t >= vocab:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"resumed_output[{i}]: token id {t} is out of the vocabulary (size {vocab})")
        return self.loop.finish_of(params, resumed)

    def _release(self, handoff) -> None:
        """A decode worker's request carried a prefill lease it will not import: its engine loop gives it back
        (only a decode worker's backend, an EngineLoop, ever gets a handoff)."""
        if handoff is not None:
            self.loop.release_handoff(handoff)

    def _events(self, h: Stream, context: grpc.ServicerContext):
        """The handle's events until the final one; aborts when the loop dies. Ends quietly when
        the RPC is no longer active (the callback has cancelled the request). Token events already queued
        behind one go out with it as one (engine_loop.coalesce): a stream that fell behind catches up in one
        message instead of one a step."""
        pending = None
        while True:
            if pending is not None:
                ev, pending = pending, None
            else:
                if not context.is_active():
                    return
                ev = h.get(POLL_S)
                if ev is None:
                    if not self.loop.alive:
                        context.abort(grpc.StatusCode.UNAVAILABLE, "engine loop stopped")
                    continue
                if ev.kind == "tokens":
                    ev, pending = coalesce(h, ev)
            if ev.kind == "error":
                abort_for(context, ev.error)
            if ev.kind == "cancelled":
                context.abort(grpc.StatusCode.CANCELLED, "request cancelled")
            yield ev
            if ev.kind == "done":
                return

    # ---- RPCs ---------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        return self._stream(request, context)

    def _stream(self, request: pb.GenerateRequest, context: grpc.ServicerContext,
                first_token: int | None = None, handoff=None, resumed: tuple[int, ...] = ()
                ) -> Iterator[pb.GenerateChunk]:
        if resumed:
            end = self._resumed_end(request, context, resumed)
            if end is not None:  # the dead worker streamed the request's last token, not its end: end it now
                yield pb.GenerateChunk(version=PROTOCOL_VERSION, finished=True, finish_reason=end,
                                       stats=stats_message(None))
                return
        h = self._start(request, context, first_token, handoff, resumed)
        done = False
        try:
            detok = Detokenizer(self.tokenizer)
            for ev in self._events(h, context):
                if ev.kind == "tokens":
                    yield pb.GenerateChunk(version=PROTOCOL_VERSION, token_ids=ev.tokens, text=detok.push(ev.tokens))
                    if ev.sent is not None:  # resumed: gRPC took the chunk and asks for the next one
                        ev.sent.set()
                else:
                    done = True
                    yield pb.GenerateChunk(version=PROTOCOL_VERSION, text=detok.finish(), finished=True,
                                           finish_reason=ev.finish_reason or "", stats=stats_message(ev.stats))
        finally:
            if not done:  # the client left, an abort, the generator closed: the backend drops the request now
                self.loop.cancel(h)

    def GenerateOnce(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateReply:
        h = self._start(request, context)
        done = False
        try:
            toks: list[int] = []
            for ev in self._events(h, context):
                if ev.kind == "tokens":
                    toks.extend(ev.tokens)
                    if ev.sent is not None:
                        ev.sent.set()
                else:
                    done = True
                    text = self.tokenizer.decode(toks) if self.tokenizer is not None else ""
                    return pb.GenerateReply(version=PROTOCOL_VERSION, token_ids=toks, text=text,
                                            finish_reason=ev.finish_reason or "", stats=stats_message(ev.stats))
        finally:
            if not done:
                self.loop.cancel(h)
        context.abort(grpc.StatusCode.CANCELLED, "request cancelled")

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        if request.version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: {request.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        return health_reply(self.loop, self.tokenizer is not None, self.settings_json)


def health_reply(backend: Backend, has_tokenizer: bool, settings_json: str = "") -> pb.HealthReply:
    c = backend.counts()
    return pb.HealthReply(version=PROTOCOL_VERSION, serving=backend.alive if c.serving is None else c.serving,
                          has_drafter=backend.has_drafter, has_tokenizer=has_tokenizer, running=c.running,
                          waiting=c.waiting, kv_blocks_free=c.kv_blocks_free, vocab_size=backend.vocab_size,
                          kv_blocks_total=c.kv_blocks_total, kv_block_size=c.kv_block_size,
                          max_positions=backend.max_positions, default_block_size=backend.default_draft_width or 0,
                          settings_json=settings_json)


def new_server(host: str, port: int, allow_remote: bool, max_workers: int, services: Mapping[str, object],
               idle_s: float = DEFAULT_IDLE_S, token: str | None = None, exclusive: bool = False,
               tls: BridgeTls | None = None, api_key: str | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server on host:port (0 picks a free port) serving `services`: service name in
    proto/generation.proto ("Generation", "PrefillWorker", "DecodeWorker") -> its servicer, each
    registered through add_guarded (undecodable requests get INVALID_ARGUMENT). Each in-flight RPC holds
    one worker thread; max_workers bounds the concurrent calls but Health's (rpc_guard.CallLimit: a full server
    still answers its probes); a call whose client sends or takes
    nothing for idle_s is cancelled (kv_bridge/stall_guard.py), so stalled clients cannot hold them all.
    token: every call must carry it (rpc_guard.TokenGate; the cluster's workers take the bridge's token).
    exclusive: no other socket may share the port (grpcio sets SO_REUSEPORT, so a second service on a fixed port
    started and the kernel split the connections between the two). tls: serve TLS with its certificate and key
    (the cluster's workers, when the service has TLS). api_key: every call but Health must carry
    `authorization: Bearer <api_key>` (the public API's api_key_file: cluster/api_key.py). A port that cannot be
    bound is an OSError naming it."""
    if not (allow_remote or is_loopback(host)):
        raise ValueError(f"host {host!r} is not loopback; pass allow_remote=True to expose the service")
    if token is not None and tls is None and not is_loopback(host):
        log.warning("a worker serves %s without TLS: its token, the prompts and the tokens cross the network in the "
                    "clear (set tls_cert, tls_key and tls_ca)", host)
    if api_key is not None and not is_loopback(host):
        log.warning("the public API serves %s without TLS: its API key crosses the network in the clear (put a TLS "
                    "proxy in front)", host)
    creds = tls.server_credentials() if tls is not None else None  # (unreadable files: before any server exists)
    guards = [TokenGate(token_authorizer(token))] if token is not None else []
    if api_key is not None:
        guards.append(TokenGate(grpc_authorizer(api_key), exempt=OPEN_GRPC_METHODS,
                                credential="API key (metadata 'authorization: Bearer <key>')"))
    guards += [CallLimit(max_workers), StallGuard(idle_s)]  # Health is answered past max_workers requests
    threads, rpcs = rpc_bound(max_workers)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="generation"),
                         maximum_concurrent_rpcs=rpcs, interceptors=guards,
                         options=[("grpc.so_reuseport", 0)] if exclusive else None)
    for name, servicer in services.items():
        add_guarded(server, servicer, pb.DESCRIPTOR.services_by_name[name])
    try:  # grpcio returns 0 or raises RuntimeError, by version
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        server.stop(None)
        raise OSError(f"port: could not bind {host}:{port} (in use by another process?)")
    server.start()
    return server, bound


def serve_generation(loop: Backend, host: str = "127.0.0.1", port: int = 0, tokenizer=None,
                     allow_remote: bool = False, max_workers: int = 64,
                     settings: Mapping[str, object] | None = None,
                     api_key: str | None = None) -> tuple[grpc.Server, int]:
    """Start the service on host:port (0 picks a free port); returns the started server and its port.
    settings: what Health reports of how the service runs (ServeConfig.public_settings); api_key: the key every
    call but Health must carry (None: none)."""
    return new_server(host, port, allow_remote, max_workers,
                      {"Generation": GenerationServicer(loop, tokenizer, settings)}, exclusive=True, api_key=api_key)
