"""The gRPC faces of the workers (proto/generation.proto's PrefillWorker and DecodeWorker services).

Both reuse GenerationServicer's request checks and Health; the decode one also reuses its
streaming, so a decode worker answers Decode exactly as a colocated server answers Generate
(it serves Generation too, for colocated runs). A prefill worker runs one prefill at a time
(its runner is not thread-safe); a waiting prefill is bounded by the call's deadline, and one whose
call ended while it waited (the router cancelled it: its client went away) never runs.

A worker that hangs (a device or kernel that never returns) is told apart from a busy one by `stall_s`: a prefill
running longer, or a decode worker's engine loop finishing no step that long while it has requests, makes its
Health say not serving (logged), so the pool takes it out of rotation and restarts it. Its server still answers
Health meanwhile (it used to say serving for good, and the pool never restarted a worker every request then waited
on for its whole timeout); it says serving again once the prefill or the step ends.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

import grpc

from flashpd.cluster.dist_control import DistControlServicer
from flashpd.cluster.generation_server import POLL_S, PROTOCOL_VERSION, GenerationServicer, abort_for
from flashpd.cluster.metrics import Metrics
from flashpd.cluster.prefill_claims import ClaimBook, Claimed, claim_from
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.engine.scheduler import REQUEST_FAILED, RequestFailed
from flashpd.engine.kv_cache import OutOfBlocks
from flashpd.engine.runner import ModelRunner
from flashpd.engine.load import Load
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.client import BridgeError
from flashpd.kv_bridge.handoff import Handoff
from flashpd.prefill_node.worker import PrefillResult, PrefillWorker, PublishFailed, PublishPending, UnknownTicket

log = logging.getLogger(__name__)


class CallEnded(Exception):
    """The call of a waiting prefill ended (cancelled, or its deadline passed): nothing to run."""


class PrefillHost:
    """A PrefillWorker behind a lock, with the facts the request checks and Health read."""

    def __init__(self, worker: PrefillWorker, runner: ModelRunner, default_draft_width: int | None,
                 delay_s: float = 0.0, stall_s: float | None = None) -> None:
        self.worker = worker
        self.runner = runner
        self.has_drafter = default_draft_width is not None
        self.default_draft_width = default_draft_width
        self.vocab_size = int(runner.model.cfg.vocab_size)
        self.max_positions = int(runner.max_positions)
        self.stall_s = stall_s  # a prefill running longer: taken for a hung worker (`alive` False); None: never
        self._running_since: float | None = None  # time.monotonic() the running prefill took the runner
        self._stall_logged = False
        self.delay_s = delay_s  # fault injection (tests): a window in which the worker can be killed mid-request
        self._lock = threading.Lock()
        self._waiting_lock = threading.Lock()  # waiting changes on many threads (running only under _lock)
        self._capacity = runner.allocator.num_free
        # leases to free at the next moment the lock is free (`release`): (lease id, its blocks, their epochs)
        self._releases: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self._releases_lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.prefills = 0

    @property
    def alive(self) -> bool:
        """False while one prefill has run longer than stall_s (what Health's `serving` says)."""
        since = self._running_since
        if self.stall_s is None or since is None or time.monotonic() - since <= self.stall_s:
            return True
        if not self._stall_logged:
            self._stall_logged = True
            log.error("a prefill has run for %.0f s (stall_s %g s): the worker looks hung; its Health says it is not "
                      "serving", time.monotonic() - since, self.stall_s)
        return False

    def counts(self) -> Load:
        return Load(running=self.running, waiting=self.waiting, kv_blocks_free=self.runner.allocator.num_free,
                    kv_blocks_total=self._capacity, kv_block_size=self.runner.kv_block_size)

    def prefill(self, prompt: list[int], params: SamplingParams, timeout_s: float,
                active: Callable[[], bool] = lambda: True) -> PrefillResult:
        """Run one prefill once the worker is free; raises CallEnded when `active()` turns false first."""
        self._count_waiting(1)
        try:
            self._acquire(timeout_s, active)
        finally:
            self._count_waiting(-1)
        try:
            self.running += 1
            self._running_since = time.monotonic()
            self._free_released()  # their blocks first, for this prompt
            if self.delay_s:
                time.sleep(self.delay_s)
            res = self.worker.prefill(prompt, params)
            self.prefills += 1
            return res
        finally:
            self.running -= 1
            if self._stall_logged:
                log.warning("the prefill that ran past stall_s ended after %.0f s: serving again",
                            time.monotonic() - self._running_since)
                self._stall_logged = False
            self._running_since = None
            self._free_released()
            self._unlock()

    def quiesce(self, timeout_s: float) -> bool:
        """For a worker that stops: wait (up to timeout_s) for the running prefill to end, then hold the runner for
        good, so nothing runs on it (or on the clients it uses) any more, and for the publishes queued after their
        answers. False: a prefill or a publish still runs."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            return False
        pub = self.worker.publisher
        return pub is None or pub.drain(max(0.0, deadline - time.monotonic()))

    def await_publish(self, ticket: int, timeout_s: float | None) -> int:
        """A publish after an answer's outcome (PrefillWorker.await_publish); never takes the runner's lock."""
        return self.worker.await_publish(ticket, timeout_s)

    def release(self, exporter_id: str, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """Free a device-path lease (the decode worker is done with it). The allocator is not thread-safe, so
        the blocks are freed under the runner's lock: now if it is free, else by the prefill holding it, as it
        ends. The call never waits for a running prefill (a Release RPC would hold a server thread that long,
        and enough of them would starve Prefill and Health). True: the lease was live, held exactly `blocks` at
        `epochs` (the handoff's), and will be freed; a release naming other blocks is refused, the lease untouched
        (a header carrying another request's lease id must not free that lease)."""
        ex = self.worker.exporter
        if ex is None or exporter_id != ex.exporter_id or not ex.admits_release(lease_id, blocks, epochs):
            return False
        with self._releases_lock:
            self._releases.append((lease_id, tuple(blocks), tuple(epochs)))
        self._free_released_if_idle()
        return True

    def expire(self) -> int:
        """Free leases past their deadline (a decode worker that died or never came), and released ones
        still waiting for the lock."""
        ex = self.worker.exporter
        if ex is None or not ex.held or not self._lock.acquire(timeout=POLL_S):
            return 0
        try:
            self._free_released()
            return ex.expire()
        finally:
            self._unlock()

    def _unlock(self) -> None:
        self._lock.release()
        self._free_released_if_idle()

    def _free_released(self) -> int:
        """Under the lock: free every lease `release` queued (one expired meanwhile is already free)."""
        with self._releases_lock:
            queued, self._releases = self._releases, []
        freed = 0
        for i, blocks, epochs in queued:
            try:
                freed += bool(self.worker.release(i, blocks, epochs))
            except Exception:  # noqa: BLE001  its caller must still let the lock go (else the worker stops for good)
                log.exception("freeing lease %d failed; it expires at its deadline", i)
        return freed

    def _free_released_if_idle(self) -> None:
        """Free queued releases if the lock can be had without waiting. Called after each release of the lock
        too (`_unlock`), so a lease queued while the lock's holder was ending is not left for the next prefill or
        expiry pass."""
        while True:
            with self._releases_lock:
                if not self._releases:
                    return
            if not self._lock.acquire(blocking=False):
                return  # its holder frees them as it ends
            try:
                self._free_released()
            finally:
                self._lock.release()

    def _count_waiting(self, d: int) -> None:
        with self._waiting_lock:
            self.waiting += d

    def _acquire(self, timeout_s: float, active: Callable[[], bool]) -> None:
        """Take the lock for a call that is still active (checked again once it is taken)."""
        deadline = time.monotonic() + timeout_s
        while not self._lock.acquire(timeout=max(0.0, min(POLL_S, deadline - time.monotonic()))):
            if not active():
                raise CallEnded
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prefill worker busy for {timeout_s:g} s")
        if not active():
            self._unlock()
            raise CallEnded


class PrefillWorkerServicer(GenerationServicer, DistControlServicer, pb_grpc.PrefillWorkerServicer):
    def __init__(self, host: PrefillHost, metrics: Metrics | None = None, dist=None,
                 claim_keep_s: float = 240.0) -> None:
        super().__init__(host, None)  # type: ignore[arg-type]  (checks and Health only: no submit)
        self.host = host
        self.metrics = metrics
        self.dist = dist  # kv_transport "dist": OpenPair / SendLease over this DistExporter (cluster/dist_control.py)
        # the leases each router-named Prefill made, for a Release naming the claim (cluster/prefill_claims.py)
        self.claims = ClaimBook(claim_keep_s)

    def Prefill(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.PrefillReply:
        try:
            claim = claim_from(context.invocation_metadata())
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt, params, method, _ = self._parse(request, context)
        remaining = context.time_remaining()
        try:
            res = self.host.prefill(prompt, params, remaining if remaining is not None else 120.0, context.is_active)
        except CallEnded:
            context.abort(grpc.StatusCode.CANCELLED, "request cancelled")
        except OutOfBlocks as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt: the prefill worker's KV cache: {e}")
        except BridgeError as e:
            # not UNAVAILABLE: the router reads that as this worker gone and marks a healthy worker down; this
            # request falls back to a decode-side prefill, and the worker takes the next one
            # (restoring a cached prefix from the bridge or publishing the prompt to it: both go through it)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the KV bridge failed: {type(e).__name__}: {e}")
        except (TimeoutError, ValueError) as e:
            abort_for(context, e)
        except Exception as e:  # noqa: BLE001  this prefill failed alone; its blocks are back, the worker goes on
            abort_for(context, RequestFailed(f"{REQUEST_FAILED}: prefill: {type(e).__name__}: {e}"))
        if self.metrics is not None:
            self.metrics.ttft.labels("prefill", method).observe(res.prefill_ms / 1e3)
        reply = pb.PrefillReply(version=PROTOCOL_VERSION, first_token=res.first_token,
                                finish_reason=res.finish_reason or "", published_chunks=res.published_chunks,
                                cached_tokens=res.cached_tokens, prefill_ms=res.prefill_ms,
                                publish_ticket=res.publish_ticket)
        if res.handoff is not None:
            h = res.handoff
            reply.handoff.CopyFrom(pb.Handoff(exporter_id=h.exporter_id, exporter_address=h.exporter_address,
                                              blob=h.blob, lease_id=h.lease_id, blocks=h.blocks, epochs=h.epochs,
                                              num_tokens=h.num_tokens, prompt_digest=h.prompt_digest))
            # nobody will import it: free it now (a claim released already: the router gave up on this call)
            if res.finish_reason or not context.is_active() or (
                    claim is not None and not self.claims.register(
                        claim, Claimed(h.exporter_id, h.lease_id, tuple(h.blocks), tuple(h.epochs)))):
                self.host.release(h.exporter_id, h.lease_id, h.blocks, h.epochs)
                reply.ClearField("handoff")
        return reply

    def AwaitPublish(self, request: pb.AwaitPublishRequest, context: grpc.ServicerContext) -> pb.AwaitPublishReply:
        if request.version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: {request.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        ticket = int(request.ticket)
        try:
            while True:  # in slices, so that a cancelled or expired call frees its server thread
                try:
                    put = self.host.await_publish(ticket, POLL_S)
                    break
                except PublishPending:
                    if not context.is_active():
                        context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        except UnknownTicket:
            context.abort(grpc.StatusCode.NOT_FOUND, f"ticket: no publish {ticket} (unknown, awaited or expired)")
        except PublishFailed as e:  # the publish's own failure: the answer says so, the call succeeded
            return pb.AwaitPublishReply(version=PROTOCOL_VERSION, published=False, error=str(e))
        return pb.AwaitPublishReply(version=PROTOCOL_VERSION, published=True, published_chunks=put)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        if request.version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: {request.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        if request.claim:  # a lease whose Prefill answer the router never got
            c = self.claims.take(int(request.claim))
            released = c is not None and self.host.release(c.exporter_id, c.lease_id, list(c.blocks), list(c.epochs))
            return pb.ReleaseReply(version=PROTOCOL_VERSION, released=released)
        released = self.host.release(request.exporter_id, int(request.lease_id), list(request.blocks),
                                     list(request.epochs))
        if released:
            self.claims.forget(int(request.lease_id))
        return pb.ReleaseReply(version=PROTOCOL_VERSION, released=released)


class DecodeWorkerServicer(GenerationServicer, pb_grpc.DecodeWorkerServicer):
    """Generation (colocated use) and DecodeWorker (the router's) over one EngineLoop. Health says not serving while
    the loop looks hung (EngineLoop.counts, with its stall_s)."""

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        """A refused request gives the prefill lease it carries back now, as `_start` does (else the prefill
        worker's blocks stay held until the lease's deadline)."""
        first = request.first_token if request.HasField("first_token") else None
        handoff = None
        if request.HasField("handoff"):
            h = request.handoff
            handoff = Handoff(h.exporter_id, h.exporter_address, bytes(h.blob), int(h.lease_id), tuple(h.blocks),
                              tuple(h.epochs), int(h.num_tokens), bytes(h.prompt_digest))
        if request.version != PROTOCOL_VERSION:
            self._release(handoff)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"version: {request.version} is not supported (this server speaks {PROTOCOL_VERSION})")
        if handoff is not None and first is None:
            self._release(handoff)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "handoff: needs first_token (the prefill's)")
        resumed = tuple(request.resumed_output)
        if resumed and first is not None:  # (a handoff needs a first_token: refused above)
            self._release(handoff)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resumed_output: not with first_token or handoff (the "
                          "worker recomputes the prompt and the output)")
        return self._stream(request.request, context, first, handoff, resumed)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        """GenerationServicer's, saying this worker resumes: the router sends a retried request's streamed tokens
        (resumed_output) only to a worker that says so (a build that predates the field would drop it)."""
        reply = super().Health(request, context)
        reply.resumes = True
        return reply
