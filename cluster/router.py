"""The router: the generation service's backend over M prefill and N decode workers.

Per request: pick the least-loaded healthy decode worker (refusing at once what can never fit its
KV cache), ask a prefill worker to prefill the prompt and publish its KV + drafter state to the
bridge, stream the first token to the client as soon as it returns (TTFT), then stream the
decode worker's tokens, which continue from that first token after importing the prefix.

Faults, each logged and counted: a prefill that fails (worker killed, bridge down, timeout) falls
back to the decode worker computing the prompt itself (output unchanged); a decode worker that
dies is marked down, and its requests are retried on another (decode_retries): from the prefill's
first token while the client has none of that decode's tokens, else resumed after the tokens
streamed (the next worker recomputes prompt + them, as a preempted request, and streams what follows);
with no retry left the request ends with UNAVAILABLE. A decode worker that refuses a request because it is overloaded (RESOURCE_EXHAUSTED other than
a prompt it cannot fit) is busy, not gone: another is tried (the same bound, decode_retries), else the request ends
with Overloaded (RESOURCE_EXHAUSTED saying so), never as a prompt error. Every internal call is bounded by the request's deadline (the
client's when shorter than request_timeout_s): past it, the request ends with TimeoutError (DEADLINE_EXCEEDED)
having released what it held; a client's cancellation cancels the calls.
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter

import grpc

from flashpd.decode_node.engine_loop import EngineStopped, Event, Overloaded
from flashpd.cluster.generation_client import build_request, stats_dict
from flashpd.cluster.generation_server import PROTOCOL_VERSION
from flashpd.cluster.metrics import Metrics
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.worker_pool import Slot, WorkerPool
from flashpd.engine.kv_cache import blocks_needed
from flashpd.engine.scheduler import REQUEST_FAILED, PromptTooLong, RequestFailed
from flashpd.engine.load import Load
from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# Codes with which a call ends when its worker went away (the router's own cancels are told apart).
WORKER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
RELEASE_TIMEOUT_S = 2.0
# How a worker's RESOURCE_EXHAUSTED says the request itself cannot fit: generation_server.abort_for's "prompt: "
# (the scheduler's PromptTooLong) and _parse's field names. Those and grpcio's message-size limits ("... larger than
# max") are the request's; any other is the worker's load (grpcio's "Concurrent RPC limit exceeded!" when every slot
# of its server is taken): see _overloaded.
PROMPT_REFUSALS = ("prompt", "max_tokens:")
FIRST_TOKEN_WAIT_S = 0.01  # the longest the decode call waits for the first token to reach the client's transport


class _Cancelled(Exception):
    """The client cancelled: end quietly."""



class RouterHandle:
    """One request in the router: its events, and the internal calls to cancel with it."""

    def __init__(self, prompt: list[int], params: SamplingParams, method: str, draft_width: int | None,
                 timeout_s: float) -> None:
        self.prompt, self.params, self.method, self.draft_width = prompt, params, method, draft_width
        self.events: queue.Queue[Event] = queue.Queue()
        self.cancelled = False
        self.t0 = time.perf_counter()
        self.deadline = time.monotonic() + timeout_s
        self.ttft_ms: float | None = None
        self.prefill_slot: Slot | None = None  # the prefill worker that answered (its lease is released there)
        self._calls: list = []
        self._lock = threading.Lock()

    def get(self, timeout: float) -> Event | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def remaining(self) -> float:
        """Time left to the request's deadline, the bound of each internal call; TimeoutError once it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed (the client's, or request_timeout_s)")
        return left

    def check(self) -> None:
        """Raise _Cancelled once the client cancelled: no internal call starts for such a request."""
        if self.cancelled:
            raise _Cancelled

    def track(self, call) -> None:
        """Remember a call so a cancel reaches it (cancelled at once if the request already was)."""
        with self._lock:
            if not self.cancelled:
                self._calls.append(call)
                return
        call.cancel()
        raise _Cancelled

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls, self._calls = self._calls, []
        for c in calls:
            c.cancel()

    def tokens(self, toks: list[int], sent: threading.Event | None = None) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1e3
        self.events.put(Event("tokens", tokens=toks, sent=sent))


class RequestThreads:
    """Daemon threads that each run one request at a time and then wait for the next: starting a thread per
    request put a thread's start on every TTFT (docs/results.md). Never fewer idle threads than needed: a job with no
    idle thread to take it starts a new one. Daemon, unlike concurrent.futures' workers, so a process that
    exits with requests in flight does not wait out their deadlines."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, fn, *args) -> None:
        """Run fn(*args) on an idle thread, or a new one. Raises when a new thread cannot start (RuntimeError:
        can't start new thread): the job is then not queued, so the caller may undo what it took for it without a
        thread running it later (it used to be queued first, and ran once a busy thread came free)."""
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # this job is that thread's
        if start:
            # the first job travels in a list the thread empties: Thread keeps its args for as long as it runs
            threading.Thread(target=self._work, args=([(fn, args)],), name=self.name, daemon=True).start()
        else:
            self._jobs.put((fn, args))

    def _work(self, first: list[tuple]) -> None:
        while True:
            fn, args = first.pop() if first else self._jobs.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001  a job handles its own errors; this thread must survive anyway
                log.exception("%s: a job raised", self.name)
            fn = args = None  # an idle thread must not keep its last request (prompt, stream, calls) alive
            with self._lock:
                self._idle += 1


class Router:
    """Backend of GenerationServicer (see generation_server.Backend)."""

    def __init__(self, cfg, pool: WorkerPool, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics or Metrics("router")
        self.fallbacks: Counter[str] = Counter()
        self.retries = 0
        self.inflight = 0
        self._lock = threading.Lock()
        self._stopped = False
        self._threads = RequestThreads("router-request")
        info = pool.slots["decode"][0].info
        self.has_drafter = bool(info["has_drafter"])
        self.default_draft_width = info["default_block_size"]  # HealthReply's field name
        self.vocab_size = int(info["vocab_size"])
        self.max_positions = int(info["max_positions"])
        self._live_metrics()

    def _live_metrics(self) -> None:
        m = self.metrics
        m.live("flashpd_queue_depth", "Requests in flight at the router", "gauge", (), lambda: {(): self.inflight})
        m.live("flashpd_recompute_fallbacks", "Prefills that failed; the decode worker computed the prompt",
               "counter", ("reason",), self._fallback_counts)
        m.live("flashpd_decode_retries", "Requests retried on another decode worker", "counter", (),
               lambda: {(): self.retries})
        m.live("flashpd_workers_healthy", "Healthy workers by role", "gauge", ("worker",),
               lambda: {(r,): self.pool.healthy_count(r) for r in ("bridge", "prefill", "decode")})
        m.live("flashpd_worker_restarts", "Workers restarted by the router", "counter", ("worker",),
               lambda: {(r,): v for r, v in self.pool.restarts.items()})
        m.live("flashpd_worker_early_crashes", "Restarted workers down again within the pool's stable_s (a crash "
               "loop: each counts as a failed restart)", "counter", ("worker",),
               lambda: {(r,): v for r, v in self.pool.early_crashes.items()})

    def _fallback_counts(self) -> dict[tuple[str, ...], int]:
        """A scrape's copy, taken under the lock: request threads add reasons meanwhile (iterating the Counter
        while one did raised "dictionary changed size during iteration" and emptied the family)."""
        with self._lock:
            return {(k,): v for k, v in self.fallbacks.items()}

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._stopped

    def counts(self) -> Load:
        dec = [s.info for s in self.pool.slots["decode"] if s.healthy]
        return Load(serving=bool(dec) and not self._stopped, running=sum(i["running"] for i in dec),
                    waiting=sum(i["waiting"] for i in dec), kv_blocks_free=sum(i["kv_blocks_free"] for i in dec),
                    kv_blocks_total=max((i["kv_blocks_total"] for i in dec), default=0),
                    kv_block_size=dec[0]["kv_block_size"] if dec else 0)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, method: str, draft_width: int | None,
               timeout_s: float = 30.0, first_token: int | None = None, deadline_s: float | None = None
               ) -> RouterHandle:
        """deadline_s: the client's time left (None: none); the request's deadline is the sooner of it and
        request_timeout_s, and bounds every internal call (the blocking prefill's too, which no cancel reaches).
        timeout_s (how long the caller waits for the request to be taken) is unused: nothing here waits. Whatever
        fails here gives back the decode slot picked and the in-flight count."""
        if first_token is not None:
            raise ValueError("first_token: the router computes the first token itself")
        if self._stopped:
            raise EngineStopped("the router is stopped")
        d = self.pool.pick("decode")
        if d is None:
            raise EngineStopped("no decode worker is available (all are down or restarting)")
        counted = False
        try:
            width = (draft_width or self.default_draft_width or 1) if method == "dflash" else 1
            need = blocks_needed(len(prompt), params.max_tokens, width, d.info["kv_block_size"])
            if need > d.info["kv_blocks_total"]:
                raise PromptTooLong(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {need} "
                                    f"KV blocks; a decode worker has {d.info['kv_blocks_total']}")
            budget = self.cfg.request_timeout_s if deadline_s is None else min(self.cfg.request_timeout_s, deadline_s)
            h = RouterHandle(prompt, params, method, draft_width, budget)
            with self._lock:
                self.inflight += 1
            counted = True
            self._threads.run(self._run, h, d)  # from here on _run releases both
            return h
        except BaseException:
            if counted:
                with self._lock:
                    self.inflight -= 1
            self.pool.release(d)
            raise

    def cancel(self, h: RouterHandle) -> None:
        h.cancel()

    def stop(self) -> None:
        self._stopped = True

    def _run(self, h: RouterHandle, d: Slot) -> None:
        outcome, emitted = "error", []
        p = h.params
        stats: dict = {}
        held: Slot | None = d  # picked for this request; _stream releases it once it runs
        first: pb.PrefillReply | None = None
        try:
            req = build_request(h.prompt, max_tokens=p.max_tokens, method=h.method, block_size=h.draft_width or 0,
                                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                                ignore_eos=p.ignore_eos)
            first = self._prefill(h, req)
            if first is not None:
                emitted.append(first.first_token)
                sent = threading.Event()
                h.tokens([first.first_token], sent)
                # the first token leaves before the decode call starts: started at once, the call's set-up
                # competed with the delivery for the interpreter and lengthened TTFT (docs/results.md)
                sent.wait(FIRST_TOKEN_WAIT_S)
            if first is not None and first.finish_reason:
                reason = first.finish_reason
            else:
                if first is not None and first.publish_ticket:
                    self._await_publish(h, first)
                held = None
                reason, stats = self._decode(h, req, d, first, emitted)
            stats.update(ttft_ms=h.ttft_ms, latency_ms=(time.perf_counter() - h.t0) * 1e3,
                         prefill_ms=first.prefill_ms if first is not None else None)
            stats.setdefault("acceptance_lengths", [])
            stats.setdefault("tau", None)
            h.events.put(Event("done", finish_reason=reason, stats=stats))
            outcome = "ok"
        except _Cancelled:
            outcome = "cancelled"
        except Exception as e:  # noqa: BLE001  every failure reaches the client as a status code
            if h.cancelled:
                outcome = "cancelled"
            else:
                log.warning("request failed: %s: %s", type(e).__name__, e)
                h.events.put(Event("error", error=e))
        finally:
            if outcome != "ok" and first is not None and h.prefill_slot is not None:
                # a request that ended otherwise (cancelled at any phase, decode worker gone, failed) frees its
                # prefill lease now, not at its deadline: the decode worker may never have seen it. Safe even
                # mid-copy (the importer checks the blocks' epochs after copying) and if released already.
                self._release_lease(h.prefill_slot, first)
            if held is not None:
                self.pool.release(held)
            with self._lock:
                self.inflight -= 1
            self.metrics.observe_request(h.method, stats, outcome, len(emitted))

    def _fallback(self, reason: str, detail: str) -> None:
        with self._lock:  # request threads count at once; an unlocked += lost counts
            self.fallbacks[reason] += 1
        log.warning("prefill path failed (%s: %s); the decode worker computes the prompt, or what the bridge lacks "
                    "of it, itself", reason, detail)

    def _prefill(self, h: RouterHandle, req: pb.GenerateRequest) -> pb.PrefillReply | None:
        if not self.pool.slots["prefill"]:
            return None  # no prefill workers configured: the decode worker prefills (not a fallback)
        h.check()
        s = self.pool.pick("prefill")
        if s is None:
            if self.pool.suspended_count("prefill"):
                self._fallback("prefill_suspended", "every prefill worker in rotation timed out a prefill lately")
            else:
                self._fallback("no_prefill_worker", "every prefill worker is down")
            return None
        # a lease the call makes (device and dist paths) is named by this claim too: an answer lost to a cancel or a
        # deadline leaves a lease the router cannot name by its id (cluster/prefill_claims.py)
        claim = (secrets.randbits(64) or 1) if self.cfg.kv_transport != "bridge" else None
        answered = lost = False
        try:
            left = h.remaining()  # the blocking call below cannot be cancelled: only its deadline bounds it
            timeout = min(self.cfg.prefill_timeout_s, left)
            if s.inflight == 1:
                # the worker had nothing else to do: a blocking call (faster, but a cancel cannot stop it; what
                # a cancelled request costs is then this one prefill, and its lease is released below)
                reply = s.client.prefill(req, timeout, claim)
                answered = True
                h.prefill_slot = s
                if h.cancelled:
                    self._release_lease(s, reply)
                    raise _Cancelled
                return reply
            fut = s.client.prefill_future(req, timeout, claim)
            h.track(fut)
            reply = fut.result()
            answered = True
            h.prefill_slot = s
            return reply
        except grpc.FutureCancelledError:
            lost = True  # (its answer may have been on its way)
            raise _Cancelled from None
        except grpc.RpcError as e:
            lost = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # (as a cancel's)
            if h.cancelled:
                raise _Cancelled from None
            code = e.code()
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and left <= self.cfg.prefill_timeout_s:
                # the request's own time ran out (no prefill fault: a recompute has no time left either)
                raise TimeoutError(f"the request's deadline passed during its prefill on prefill worker {s.index} "
                                   f"({e.details()})") from None
            if code in WORKER_GONE and not _request_failed(code, e.details()):
                self.pool.mark_down(s, f"Prefill failed: {code.name}")
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:  # prefill_timeout_s passed: the worker is stuck or far
                # behind; the requests after this one fall back at once rather than each wait out the same timeout
                self.pool.suspend(s, self.cfg.prefill_timeout_s, f"a prefill took over {timeout:g} s")
            self._fallback(code.name.lower(), e.details() or "")
            return None
        finally:
            if not answered and (h.cancelled or lost):
                self._release_claim(s, claim)
            self.pool.release(s)

    def _await_publish(self, h: RouterHandle, first: pb.PrefillReply) -> None:
        """The prefill answered before its chunks reached the bridge (its first token is out): wait until they are
        there, so the decode worker's restore finds the whole prefix. A publish that failed, or an answer that does
        not come in prefill_timeout_s, is a partial fallback (counted): the decode worker computes what is missing,
        exactly as it would the whole prompt."""
        s = h.prefill_slot
        if s is None:
            return
        h.check()
        left = h.remaining()
        try:
            fut = s.client.await_publish_future(first.publish_ticket, min(self.cfg.prefill_timeout_s, left))
            h.track(fut)  # a cancel ends the wait
            reply = fut.result()
        except grpc.FutureCancelledError:
            raise _Cancelled from None
        except grpc.RpcError as e:
            if h.cancelled:
                raise _Cancelled from None
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and left <= self.cfg.prefill_timeout_s:
                raise TimeoutError(f"the request's deadline passed while its prefill's publish ran on prefill "
                                   f"worker {s.index}") from None
            self._fallback("publish_" + e.code().name.lower(), e.details() or "")
            return
        except ValueError as e:  # a channel a restart closed
            self._fallback("publish_unavailable", str(e))
            return
        if not reply.published:
            self._fallback("publish_failed", reply.error)

    def _release_claim(self, s: Slot, claim: int | None) -> None:
        """The lease, if any, that a Prefill call whose answer never arrived made: freed now (or as it is made), not
        at its deadline. Best effort, as _release_lease."""
        if claim is None:
            return
        try:
            s.client.release_claim(claim, RELEASE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  (as _release_lease's)
            what = e.code().name if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            log.warning("releasing the lease of a prefill whose answer was lost failed (%s); it expires at its "
                        "deadline", what)

    def _release_lease(self, s: Slot, reply: pb.PrefillReply | None) -> None:
        """A prefill's device-path lease that no decode worker will import (its request was cancelled): freed
        now rather than at its deadline. Best effort: a failure leaves it to the deadline."""
        if reply is None or not reply.HasField("handoff"):
            return
        try:
            s.client.release(reply.handoff, RELEASE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  any failure (an RPC's, a channel a restart closed: ValueError): the
            # caller's cleanup (its decode slot, the in-flight count) must still run
            what = e.code().name if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
            log.warning("releasing lease %d of a cancelled request failed (%s); it expires at its deadline",
                        reply.handoff.lease_id, what)

    def _decode(self, h: RouterHandle, req: pb.GenerateRequest, d: Slot, first: pb.PrefillReply | None,
                emitted: list[int]) -> tuple[str, dict]:
        tries, base, tried, resume = 0, len(emitted), [d], False
        while True:
            try:
                return self._stream(h, req, d, None if resume else first, emitted, resume)
            except grpc.RpcError as e:
                if h.cancelled:
                    raise _Cancelled from None
                code, details = e.code(), e.details() or ""
                if _request_failed(code, details):  # this request failed on a healthy worker: it alone ends
                    raise RequestFailed(details) from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the call carried the request's deadline
                    raise TimeoutError(f"the request's deadline passed while decode worker {d.index} served it "
                                       f"({details})") from None
                busy = _overloaded(code, details)
                if code not in WORKER_GONE and not busy:
                    raise _error_for(code, details) from None
                if not busy:  # an overloaded worker is alive: it stays in rotation (as the pool's probe keeps it)
                    self.pool.mark_down(d, f"Decode failed: {code.name} {details}")
                nxt = self.pool.pick("decode", exclude=tuple(tried)) if tries < self.cfg.decode_retries else None
                if nxt is None:
                    if busy:
                        raise Overloaded(f"the decode workers are overloaded (decode worker {d.index} at "
                                                f"{d.address}: RESOURCE_EXHAUSTED: {details}; tried {len(tried)} of "
                                                f"{len(self.pool.slots['decode'])}); retry later") from None
                    raise EngineStopped(f"decode worker {d.index} at {d.address} is gone ({code.name}: {details})") \
                        from None
                # the client has seen none of this decode's tokens: the next worker starts from the prefill's
                # first token as if this one had not run. Else it resumes: it rebuilds the caches of the prompt and
                # every token streamed (as a preempted request is recomputed) and continues from there, so a
                # sampled request is retried too, and a replay's draws or draft widths cannot diverge from what
                # the client already has. A worker whose Health does not say it resumes (an older build) would drop
                # resumed_output and stream from the prompt: it replays instead, and a replay that differs from
                # what was streamed fails the request (never a token appended twice)
                resume = len(emitted) > base and bool(nxt.info.get("resumes"))
                if len(emitted) > base and not resume:
                    log.warning("decode worker %d does not say it resumes (an older build?): replaying the request "
                                "from the prefill's first token", nxt.index)
                tries += 1
                with self._lock:
                    self.retries += 1
                log.warning("decode worker %d %s (%s); retrying on decode worker %d after %d streamed tokens%s",
                            d.index, "is overloaded" if busy else "failed", code.name, nxt.index, len(emitted),
                            ", resuming after them" if resume else "")
                d = nxt
                tried.append(d)

    def _stream(self, h: RouterHandle, req: pb.GenerateRequest, d: Slot, first: pb.PrefillReply | None,
                emitted: list[int], resume: bool = False) -> tuple[str, dict]:
        """One decode call. resume: the worker continues after `emitted` (all of it new tokens to the stream);
        else it starts from the prefill's first token, and what the client already has must come back the same."""
        try:
            h.check()  # a decode worker would only take (and then drop) a cancelled request
            dreq = pb.DecodeRequest(version=PROTOCOL_VERSION, request=req)
            if resume:
                dreq.resumed_output.extend(emitted)
            elif first is not None:
                dreq.first_token = first.first_token
                if first.HasField("handoff"):  # the device path: the decode worker copies the prompt's KV
                    dreq.handoff.CopyFrom(first.handoff)
            call = d.client.decode(dreq, h.remaining())
            h.track(call)
            seen = len(emitted) if resume else 0
            for chunk in call:
                new = []
                for tok in chunk.token_ids:
                    if seen < len(emitted):
                        if tok != emitted[seen]:
                            raise EngineStopped(f"a retried decode diverged at token {seen} from what was streamed")
                    else:
                        new.append(tok)
                    seen += 1
                if new:
                    emitted.extend(new)
                    h.tokens(new)
                if chunk.finished:
                    return chunk.finish_reason, stats_dict(chunk.stats)
            raise EngineStopped(f"decode worker {d.index} ended the stream without its final chunk")
        finally:
            self.pool.release(d)


def _request_failed(code: grpc.StatusCode, details: str | None) -> bool:
    """A worker's INTERNAL for one request that failed alone (RequestFailed), not a worker gone."""
    return code == grpc.StatusCode.INTERNAL and (details or "").startswith(REQUEST_FAILED)


def _overloaded(code: grpc.StatusCode, details: str) -> bool:
    """A worker's RESOURCE_EXHAUSTED for its load, not for a request that cannot fit (see PROMPT_REFUSALS)."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and not details.startswith(PROMPT_REFUSALS) \
        and "larger than max" not in details


def _error_for(code: grpc.StatusCode, details: str) -> Exception:
    """A worker's status as the exception the servicer turns back into the same status."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a request that cannot fit (overload never gets here)
        return PromptTooLong(details.removeprefix("prompt: "))  # the servicer puts "prompt: " back
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details)
    return EngineStopped(f"{code.name}: {details}")
