"""A decode worker's scheduler: the engine's Scheduler (engine/scheduler.py) plus what only a decode node
has, a prefill worker's KV to import at admission instead of prefilling (decode_node/handoff_import.py), and
holding a step while that prefill worker computes on the same GPU.

Two import forms. The same-host device path copies device to device at admission, on the engine thread (a
local copy between two epoch checks). The dist path receives over a pair from another host, which can take up
to the importer's timeout per wait: done at admission it would stall every running stream that long. So it is
split as a prefix fetch is (engine/scheduler.py, async_load): the request's fetch (open the pair, SendLease,
receive both halves into staging buffers) runs on a thread of `_import_pool` while the batch steps on, started
for the queue's first requests only (LOAD_AHEAD fetches held at once, prefix fetches included: each holds a
whole prompt's KV); the request is admitted once it is done, and its admission writes the staged buffers into
the blocks it is given then (or, if the fetch failed, counts the fallback and computes the prompt here).

The lease is the request's `handoff` until one engine-thread path takes it and releases it, so exactly once:
the fetch's end (`_release_fetched`: the exporter read the blocks before it answered, so the prefill worker's
blocks need not wait for this admission), the admission, or `_release` (cancel, failure, abort, shutdown). A
fetch thread never touches it, and writes only into its own staging buffers: a request cancelled mid-fetch
leaves nothing in blocks anyone owns. `async_import = False` receives at admission instead (the old form).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from flashpd.engine.scheduler import LOAD_AHEAD, Request
from flashpd.engine.scheduler import Scheduler as EngineScheduler
from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.kv_bridge.handoff import Handoff, HandoffError, prompt_digest

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.0002  # how often a held step looks at the prefill worker's busy word again


class Scheduler(EngineScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handoff: HandoffImport | None = None  # the prefill worker's KV importer (device or dist path)
        # > 0: while a prefill worker sharing this GPU computes (its exporter's busy word), the next step waits,
        # at most this long for one prefill, so the prefill gets the GPU as it would in a colocated engine
        self.hold_for_prefill_s = 0.0
        # an importer that can fetch off the engine thread (the dist path) does, unless this is False
        self.async_import = True
        self._import_pool: ThreadPoolExecutor | None = None
        self._fetching: list[Request] = []  # requests whose fetch started and whose lease is still theirs

    def _release_lease(self, lease) -> None:
        if self.handoff is not None:
            self.handoff.release(lease)

    # ---- the dist path's fetch, off the engine thread -----------------------------------------------
    def _fetches_handoffs(self) -> bool:
        return self.async_import and self.handoff is not None and self.handoff.can_fetch

    def _wants_load(self, req: Request) -> bool:
        """A request with a lease wants its fetch started ahead of admission when the importer can (dist path)."""
        if req.handoff is not None:
            return self._fetches_handoffs()
        return super()._wants_load(req)

    def _may_load(self) -> bool:
        return self._fetches_handoffs() or super()._may_load()

    def _submit_load(self, req: Request) -> Future:
        """A lease's fetch goes to the import threads (one per fetch the window holds: a fetch waiting for its
        pair's lock never delays another exporter's); a prefix fetch to the engine's load threads."""
        if req.handoff is None:
            return super()._submit_load(req)
        req.handoff_load = True
        self._fetching.append(req)
        try:  # a lease that cannot be this prompt's is refused before its KV crosses the network
            _check_lease(req, req.handoff)
        except HandoffError as e:
            refused: Future = Future()
            refused.set_exception(e)
            return refused
        return self._importers().submit(self.handoff.fetch, req.handoff)

    def _importers(self) -> ThreadPoolExecutor:
        if self._import_pool is None:
            self._import_pool = ThreadPoolExecutor(max_workers=LOAD_AHEAD, thread_name_prefix="kv-import")
        return self._import_pool

    def _start_loads(self) -> None:
        self._release_fetched()
        super()._start_loads()

    def _release_fetched(self) -> None:
        """Release the leases whose fetch ended (received or failed): the exporter gathered the blocks before its
        OK and reads them no more. A request no longer holding its lease (admitted, cancelled) is dropped here."""
        still = []
        for r in self._fetching:
            if r.handoff is None or not r.handoff_load:
                continue
            if r.load is not None and r.load.done():
                h, r.handoff = r.handoff, None
                self._release_lease(h)
                continue
            still.append(r)
        self._fetching = still

    def close(self) -> None:
        """Also let the import threads end: fetches not started are dropped (their requests fall back if ever
        admitted), a running one ends within its importer's timeout."""
        super().close()
        pool, self._import_pool = self._import_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
            self.let_go.append(pool)

    # ---- admission ---------------------------------------------------------------------------------
    def _import(self, r: Request, method: str) -> bool:
        """Admit a fresh request with its prompt's KV (both halves) from the prefill worker instead of prefilling:
        afterwards it is exactly as after a local prefill (every prompt position cached, the prefill's first token
        committed). False: no handoff, or one that cannot be used (counted; the prompt is computed here). The
        lease is released either way, and tried once: a retry computes the prompt."""
        if r.handoff_load:
            return self._import_fetched(r, method)
        h, r.handoff = r.handoff, None
        if h is None or self.handoff is None:  # a lease with no importer here expires at its deadline
            return False
        try:
            self._take_blocks(r, h)
            self.handoff.copy(h, list(r.seq.table.blocks))
        except HandoffError as e:
            self._fall_back(r, e)
            return False
        finally:
            self.handoff.release(h)
        self._imported(r, method)
        return True

    def _import_fetched(self, r: Request, method: str) -> bool:
        """Admission of a request whose fetch ran ahead (done: _pick admits none still loading): its staged buffers
        written into the blocks it gets now, or its fetch's failure counted as a fallback."""
        fut, r.load, r.handoff_load = r.load, None, False
        h, r.handoff = r.handoff, None  # None when _release_fetched already gave it back
        try:
            staged = _fetched(fut)
            self._take_blocks(r, staged.handoff)
            self.handoff.apply(staged, list(r.seq.table.blocks))
        except HandoffError as e:
            self._fall_back(r, e)
            return False
        finally:
            if h is not None:
                self._release_lease(h)
        self._imported(r, method)
        return True

    def _take_blocks(self, r: Request, h: Handoff) -> None:
        """Check that the lease holds this request's prompt, then allocate the prompt's blocks here."""
        s, alloc = r.seq, self.runner.allocator
        n = len(s.prompt)
        _check_lease(r, h)
        alloc.ensure(s.table, n)
        if len(h.blocks) != len(s.table.blocks):
            raise HandoffError(f"lease of {len(h.blocks)} blocks; the prompt takes {len(s.table.blocks)} here")

    def _fall_back(self, r: Request, e: HandoffError) -> None:
        """An unusable handoff: its blocks back, the fallback counted by reason; the prompt is computed here."""
        self.runner.allocator.free(r.seq.table)
        self.handoff.fallback(str(e).split(" (")[0][:60])
        log.warning("import of request %d's prompt KV failed (%s); computing its prompt here", r.id, e)

    def _imported(self, r: Request, method: str) -> None:
        """The request's prompt positions are cached: commit the prefill worker's first token."""
        s = r.seq
        n = len(s.prompt)
        s.table.num_tokens = n
        if method == "dflash":
            s.draft_len = n
        s.stats.ttft_ms = (time.perf_counter() - s.t_start) * 1e3
        s.commit([s.forced_first])
        self.stats.handoff_imports += 1

    def _hold_for_prefill(self) -> None:
        """Wait while a prefill worker on this GPU computes (bounded: a flag older than the bound is stale)."""
        if self.hold_for_prefill_s <= 0 or self.handoff is None:
            return
        imp = self.handoff.importer
        if not imp.peer_busy(self.hold_for_prefill_s):
            return
        t0 = time.perf_counter()
        while imp.peer_busy(self.hold_for_prefill_s) and time.perf_counter() - t0 < self.hold_for_prefill_s:
            time.sleep(HOLD_POLL_S)
        self.stats.prefill_holds += 1
        self.stats.prefill_hold_ms += (time.perf_counter() - t0) * 1e3


def _check_lease(r: Request, h: Handoff) -> None:
    """The lease holds this fresh request's prompt: its length and digest (HandoffError otherwise)."""
    s = r.seq
    n = len(s.prompt)
    if h.num_tokens != n or s.forced_first is None or s.table.blocks or s.output:
        raise HandoffError(f"lease of {h.num_tokens} positions for a {n}-token prompt")
    if h.prompt_digest != prompt_digest(s.prompt):
        raise HandoffError("lease of another prompt (its digest differs from this request's)")


def _fetched(fut: Future):
    """A finished fetch's staged buffers; its failure (or its cancellation at shutdown) as a HandoffError."""
    try:
        return fut.result(timeout=0)
    except HandoffError:
        raise
    except Exception as e:  # noqa: BLE001  CancelledError (the import threads shut down), or an importer's bug
        raise HandoffError(f"fetch did not complete: {type(e).__name__}: {e}") from None
