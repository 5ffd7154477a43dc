"""A background thread that owns a decode `Scheduler` and steps it while there is work.

Other threads `submit()` requests and `cancel()` them; only the loop thread ever touches the
scheduler (add, step, cancel), so the scheduler needs no locking. A submission is added between
steps and its outcome (a `Handle`, or the scheduler's refusal: PromptTooLong / ValueError) goes
back to the submitter through a future. Each request's new tokens go to its handle's queue as
they are produced, then one final event; a front end that fell behind takes the token events queued
for it as one (`coalesce`). When there is nothing to do the thread sleeps on a
condition variable (with a timeout), never spinning. Every wait here is bounded.
An `on_finish` hook (metrics) sees each finished request in the loop thread. With a `sink`, the events of one
pass of the loop go to it in one call instead of into the handles' queues (cluster/engine_proc.py sends
them to another process that way, one message a step).

A request the scheduler fails alone (RequestFailed) ends with an "error" event while the others go
on. Should a step still raise, every request in flight fails with that error (but one already streamed to
its end, waiting in a held session, ends "done"), every block is freed, and the loop keeps serving new
requests: no request can stop the loop. A stop() ends the same way: what is whole ends "done", the rest "error".
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Callable

from flashpd.decode_node.scheduler import Scheduler
from flashpd.engine.scheduler import REQUEST_FAILED, Request, RequestFailed
from flashpd.engine.load import Load
from flashpd.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_SUBMIT_TIMEOUT_S = 30.0


class EngineStopped(RuntimeError):
    """The loop is stopped (or died): no new work is taken, and in-flight requests end with this."""


class Overloaded(EngineStopped):
    """Every worker that could take the request refused it for its load: the request is fine and may be sent again
    later (gRPC RESOURCE_EXHAUSTED, never a prompt error). An EngineStopped: no worker serves it now."""


@dataclass
class Event:
    """What a handle's queue carries: kind "tokens" (new token ids), "done" (finish_reason + stats),
    "cancelled", or "error" (the exception). `sent`, when given, is set by the front end once the event
    has been handed to the client's transport (the router waits for it before its next internal call)."""

    kind: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict | None = None
    error: BaseException | None = None
    sent: threading.Event | _AllSent | None = None  # _AllSent: the flags of events merged into this one


class _AllSent:
    """The `sent` of token events merged into one (`coalesce`): setting it sets each."""

    def __init__(self, flags: list[threading.Event]) -> None:
        self.flags = flags

    def set(self) -> None:
        for f in self.flags:
            f.set()


# the most tokens one coalesced event carries (a stream far behind still gets its tokens in bounded pieces)
COALESCE_MAX_TOKENS = 256


def coalesce(h: "Handle", ev: Event) -> tuple[Event, Event | None]:
    """A "tokens" event and the "tokens" events already queued behind it (taken without waiting) as one event,
    in order, and the first other event met after them (to go next), or None. Nothing is reordered or lost:
    a front end that fell behind the engine sends one message for all it has, not one for each step."""
    toks = list(ev.tokens)
    flags = [ev.sent] if ev.sent is not None else []
    merged = 0
    nxt = None
    q = getattr(h, "events", None)  # a Handle's (or the router's stream's) queue: look before taking, no exception
    while len(toks) < COALESCE_MAX_TOKENS:
        if q is not None and q.empty():
            break
        nxt = h.get(0)
        if nxt is None or nxt.kind != "tokens":
            break
        toks.extend(nxt.tokens)
        if nxt.sent is not None:
            flags.append(nxt.sent)
        merged += 1
        nxt = None
    if not merged:  # (counted, not read from the tokens: a merged event may carry none, and its flag must go on)
        return ev, nxt
    return Event("tokens", tokens=toks, sent=_AllSent(flags) if flags else None), nxt


class Handle:
    """One submitted request as seen from outside the loop."""

    def __init__(self, prompt: list[int], params: SamplingParams, method: str, draft_width: int | None,
                 first_token: int | None = None, handoff=None, resumed: tuple[int, ...] = ()) -> None:
        self.prompt = prompt
        self.params = params
        self.method = method
        self.draft_width = draft_width
        self.first_token = first_token  # disaggregation: the prefill worker's first token
        self.handoff = handoff  # disaggregation over the device path: the prefill worker's lease
        self.resumed = resumed  # a retry's output so far (Scheduler.add's `resumed`): not streamed again
        self.events: queue.Queue[Event] = queue.Queue()
        self.request: Request | None = None  # set in the loop thread once the scheduler took it
        self.cancel_requested = False
        self.tag: object = None  # the submitter's name for it (engine_proc: the front end's request id)

    def get(self, timeout: float) -> Event | None:
        """The next event, or None if none came within timeout seconds."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class EngineLoop:
    def __init__(self, scheduler: Scheduler, idle_wait_s: float = 0.5, name: str = "engine-loop",
                 on_finish: Callable[[Request], None] | None = None,
                 after_step: Callable[[], object] | None = None,
                 sink: Callable[[list[tuple[Handle, Event]]], None] | None = None,
                 on_abort: Callable[[str, str, int], None] | None = None) -> None:
        self.scheduler = scheduler
        self.sink = sink  # set: each pass's events go here in one call, not into the handles' queues
        self._out: list[tuple[Handle, Event]] = []
        self.on_finish = on_finish
        # (method, "cancelled" | "error", tokens it had streamed) for a request that ended otherwise (metrics: the
        # served counts missed them, so a service's failures and cancels showed nowhere in /metrics colocated)
        self.on_abort = on_abort
        self.after_step = after_step  # monitors run after each step (DecodeWorker._after_step); must be cheap
        self.idle_wait_s = idle_wait_s
        self._cv = threading.Condition()
        self._inbox: list[tuple[Handle, Future]] = []
        self._cancels: list[Handle] = []
        self._live: dict[int, Handle] = {}  # request id -> handle (loop thread only)
        self._stop = False
        self._error: BaseException | None = None
        self.steps = 0
        self.tokens_out = 0  # tokens streamed (the serving log's rate)
        self.step_s = 0.0  # wall seconds inside the scheduler's steps (the serving log's time a step, idle left out)
        self.stall_s: float | None = None  # see stalled(); None: never taken for hung
        self._moved = time.monotonic()  # when the loop thread last began a pass or woke idle, for stalled()
        self._stall_lock = threading.Lock()
        self._stall_logged = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- facts about the engine (read from any thread) -----------------------------------------
    @property
    def has_drafter(self) -> bool:
        return self.scheduler.spec is not None

    @property
    def default_draft_width(self) -> int | None:
        return self.scheduler.spec.draft_width if self.scheduler.spec is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self.scheduler.runner.model.cfg.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(self.scheduler.runner.max_positions)

    def finish_of(self, params: SamplingParams, output: list[int] | tuple[int, ...]) -> str | None:
        """Scheduler.finish_of: how a retry's output so far ends its request by itself, or None."""
        return self.scheduler.finish_of(params, output)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and self._error is None

    def counts(self) -> Load:
        """Rough, lock-free snapshot (for health). Not serving while the loop looks hung (stalled()): every front end
        reads its health here (gRPC Health, HTTP /health, an engine process's stats), colocated or a worker."""
        s = self.scheduler
        # submitted but not yet taken by the loop count as waiting, so an idle reading means idle
        load = Load(running=len(s.running), waiting=len(s.waiting) + len(self._inbox),
                    kv_blocks_free=s.runner.allocator.num_free, kv_blocks_total=s.capacity,
                    kv_block_size=s.runner.kv_block_size)
        return replace(load, serving=False) if self._stalled(load) else load

    def stalled(self) -> bool:
        """Whether the loop has requests and its current pass (a step: a device or kernel that never returns) has run
        for more than stall_s. The loop thread stamps the start of every pass and every idle wake itself, so the
        clock is the pass's own, whoever asks and however seldom (a probe after a long idle spell measured the
        spell). Logged once a stall; its end too."""
        return self._stalled(None)

    def _stalled(self, load: Load | None) -> bool:
        if self.stall_s is None:
            return False
        s = self.scheduler
        busy = (load.running + load.waiting) if load is not None else \
            len(s.running) + len(s.waiting) + len(self._inbox)
        stuck = time.monotonic() - self._moved
        with self._stall_lock:
            if busy == 0 or stuck <= self.stall_s:
                if self._stall_logged:
                    self._stall_logged = False
                    log.warning("the engine loop steps again (or is idle) after a stall: serving again")
                return False
            if not self._stall_logged:
                self._stall_logged = True
                log.error("the engine loop's pass has run for %.0f s with %d request(s) in it (stall_s %g s): it looks "
                          "hung; its Health says it is not serving", stuck, busy, self.stall_s)
            return True

    # ---- from other threads --------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, method: str = "native",
               draft_width: int | None = None, timeout_s: float = DEFAULT_SUBMIT_TIMEOUT_S,
               first_token: int | None = None, handoff=None, deadline_s: float | None = None,
               resumed: tuple[int, ...] = ()) -> Handle:
        """Queue a request; returns its handle once the scheduler accepted it (timeout_s: how long to wait for
        that). Raises what Scheduler.add raises (PromptTooLong, ValueError), EngineStopped, or TimeoutError.
        resumed: Scheduler.add's (check `finish_of` first: output that ends the request is refused).
        deadline_s (the client's time left) is not needed here: every step of the loop can be cancelled, and the
        front end cancels the request when its call ends (the Router, whose prefill call cannot be, bounds it)."""
        h, fut = self.submit_nowait(prompt, params, method, draft_width, first_token, handoff, resumed=resumed)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.cancel(h)
            raise TimeoutError(f"engine loop did not take the request within {timeout_s:g} s") from None

    def submit_nowait(self, prompt: list[int], params: SamplingParams, method: str = "native",
                      draft_width: int | None = None, first_token: int | None = None, handoff=None,
                      tag: object = None, resumed: tuple[int, ...] = ()) -> tuple[Handle, Future]:
        """Queue a request without waiting: its handle, and a future that resolves to it once the scheduler took it
        (or to the scheduler's refusal). Raises EngineStopped when the loop is not running."""
        h = Handle(list(prompt), params, method, draft_width, first_token, handoff, tuple(resumed))
        h.tag = tag
        fut: Future = Future()
        with self._cv:
            alive = self.alive
            if alive:
                self._inbox.append((h, fut))
                self._cv.notify()
        if not alive:
            self._aborted(h, "error")  # counted as the engine process's front counts it
            raise EngineStopped("engine loop is not running") from self._error
        return h, fut

    def release_handoff(self, handoff) -> None:
        """Give back the prefill worker's lease a request carried (the device path) when this loop will never
        schedule it: refused before submit, cancelled before the loop took it, or queued at shutdown. A second
        release of one lease is a no-op at its exporter."""
        if handoff is not None:
            try:
                self.scheduler.release_unused_lease(handoff)
            except Exception:  # noqa: BLE001  best effort: the lease's deadline frees it anyway
                log.exception("releasing an unused lease failed; it expires at its deadline")

    def cancel(self, h: Handle) -> None:
        """Ask the loop to drop the request and free its KV (idempotent; no-op once it finished)."""
        with self._cv:
            h.cancel_requested = True
            self._cancels.append(h)
            self._cv.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still in flight are cancelled and get an "error" event (one whose output is
        whole, riding a held session, ends "done")."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"engine loop did not stop within {timeout_s:g} s")

    # ---- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._inbox or self._cancels or not self.scheduler.idle):
                        self._cv.wait(self.idle_wait_s)
                        self._moved = time.monotonic()  # idle and awake: not hung (the stall clock's floor)
                    if self._stop:
                        break
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                self._moved = time.monotonic()  # a pass begins: a stall is measured from here
                self._take(inbox)
                try:
                    self._drop(cancels)
                    if not self.scheduler.idle:
                        self._step()
                except Exception as e:  # noqa: BLE001  uncontained: fail what is in flight, keep serving
                    self._abort_in_flight(e)
                self._flush()
        except BaseException as e:  # noqa: BLE001  a failed step: nothing in flight can continue
            log.exception("engine loop failed")
            self._error = e
        finally:
            self._shutdown()
            self._flush()

    def _aborted(self, h: Handle, outcome: str) -> None:
        if self.on_abort is not None:
            try:
                s = h.request.seq if h.request is not None else None  # (a resumed one's earlier output: not ours)
                self.on_abort(h.method, outcome, len(s.output) - s.resumed if s is not None else 0)
            except Exception:  # noqa: BLE001  a broken observer must not stop serving; it is logged
                log.exception("on_abort hook failed")

    def _emit(self, h: Handle, ev: Event) -> None:
        if ev.kind in ("cancelled", "error"):
            self._aborted(h, ev.kind)
        if self.sink is None:
            h.events.put(ev)
        else:
            self._out.append((h, ev))

    def _flush(self) -> None:
        """This pass's events to the sink, in one call (nothing without a sink: they went to the queues)."""
        if self._out:
            out, self._out = self._out, []
            try:
                self.sink(out)
            except Exception:  # noqa: BLE001  a broken sink must not stop serving; it is logged
                log.exception("event sink failed")

    def _abort_in_flight(self, e: Exception) -> None:
        log.exception("engine step failed; failing the %d request(s) in flight and serving on", len(self._live))
        res = self.scheduler.abort_all(e)
        for rid, toks in res.new_tokens.items():  # the last tokens of rows that ended before the error
            h = self._live.get(rid)
            if h is not None:
                self._emit(h, Event("tokens", tokens=list(toks)))
        for r in res.finished:  # streamed to their end before the error: they end as usual
            self._done(r)
        for r, err in res.failed:
            h = self._live.pop(r.id, None)
            if h is not None:
                self._emit(h, Event("error", error=err))
        for h in self._live.values():  # registered but not in the scheduler any more: cannot happen; be safe
            self._emit(h, Event("error", error=RequestFailed(f"{REQUEST_FAILED}: {type(e).__name__}: {e}")))
        self._live.clear()

    def _take(self, inbox: list[tuple[Handle, Future]]) -> None:
        for h, fut in inbox:
            if not fut.set_running_or_notify_cancel():
                self.release_handoff(h.handoff)
                continue
            if h.cancel_requested:  # cancelled before the loop took it: never scheduled, submit returns now
                self.release_handoff(h.handoff)
                self._emit(h, Event("cancelled", finish_reason="cancelled"))
                fut.set_result(h)
                continue
            try:
                h.request = self.scheduler.add(h.prompt, h.params, h.method, h.draft_width, h.first_token,
                                               h.handoff, h.resumed)
            except Exception as e:  # noqa: BLE001  the submitter gets the scheduler's refusal
                self._aborted(h, "error")
                fut.set_exception(e)
                continue
            self._live[h.request.id] = h
            fut.set_result(h)

    def _drop(self, cancels: list[Handle]) -> None:
        for h in cancels:
            if h.request is not None and self._live.pop(h.request.id, None) is h:
                self.scheduler.cancel(h.request)
                self._emit(h, Event("cancelled", finish_reason="cancelled"))

    def _step(self) -> None:
        t0 = time.perf_counter()
        res = self.scheduler.step()
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        self.tokens_out += sum(len(t) for t in res.new_tokens.values())
        if self.after_step is not None:
            try:
                self.after_step()
            except Exception:  # noqa: BLE001  a broken monitor must not stop serving; it is logged
                log.exception("after_step monitor failed")
        for rid, toks in res.new_tokens.items():
            h = self._live.get(rid)
            if h is not None:
                self._emit(h, Event("tokens", tokens=list(toks)))
        for r, err in res.failed:
            h = self._live.pop(r.id, None)
            if h is not None:
                self._emit(h, Event("error", error=err))
        for r in res.finished:
            self._done(r)

    def _done(self, r: Request) -> None:
        """A finished request: the on_finish hook, then its "done" event."""
        if self.on_finish is not None:
            try:
                self.on_finish(r)
            except Exception:  # noqa: BLE001  a broken observer must not stop serving; it is logged
                log.exception("on_finish hook failed")
        h = self._live.pop(r.id, None)
        if h is not None:
            self._emit(h, Event("done", finish_reason=r.seq.finish_reason, stats=r.seq.stats.as_dict()))

    def _shutdown(self) -> None:
        err = EngineStopped("engine loop stopped")
        if self._error is not None:
            err = EngineStopped(f"engine loop failed: {self._error!r}")
        with self._cv:
            self._stop = True
            inbox, self._inbox = self._inbox, []
        for h, fut in inbox:
            self.release_handoff(h.handoff)
            if fut.set_running_or_notify_cancel():
                self._aborted(h, "error")
                fut.set_exception(err)
        try:  # stop_all drops a device session that cannot end (one cancel at a time kept its blocks then)
            res = self.scheduler.stop_all([h.request for h in self._live.values()])
        except Exception:  # noqa: BLE001  best effort: the loop is going away
            log.exception("cancel during shutdown failed")
        else:  # a request whose output is whole ends "done" with its last tokens; a stop is not its failure
            for rid, toks in res.new_tokens.items():
                h = self._live.get(rid)
                if h is not None:
                    self._emit(h, Event("tokens", tokens=list(toks)))
            for r in res.finished:
                self._done(r)
            for r, e in res.failed:
                h = self._live.pop(r.id, None)
                if h is not None:
                    self._emit(h, Event("error", error=e))
        for h in self._live.values():
            self._emit(h, Event("error", error=err))
        self._live.clear()
        self.scheduler.close()
