"""A decode worker's scheduler: the engine's Scheduler (engine/scheduler.py) plus what only a decode node
has, a prefill worker's KV to import at admission instead of prefilling (the same-host device path,
decode_node/handoff_import.py), and holding a step while that prefill worker computes on the same GPU.
"""
from __future__ import annotations

import logging
import time

from flashpd.engine.scheduler import Request
from flashpd.engine.scheduler import Scheduler as EngineScheduler
from flashpd.decode_node.handoff_import import HandoffImport
from flashpd.kv_bridge.handoff import HandoffError, prompt_digest

log = logging.getLogger(__name__)

HOLD_POLL_S = 0.0002  # how often a held step looks at the prefill worker's busy word again


class Scheduler(EngineScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handoff: HandoffImport | None = None  # the same-host device path's importer
        # > 0: while a prefill worker sharing this GPU computes (its exporter's busy word), the next step waits,
        # at most this long for one prefill, so the prefill gets the GPU as it would in a colocated engine
        self.hold_for_prefill_s = 0.0

    def _release_lease(self, lease) -> None:
        if self.handoff is not None:
            self.handoff.release(lease)

    def _import(self, r: Request, method: str) -> bool:
        """Admit a fresh request by copying its prompt's KV (both halves) from the prefill worker's caches:
        afterwards it is exactly as after a local prefill (every prompt position cached, the prefill's first
        token committed). False: no handoff, or one that cannot be used (counted; the prompt is computed
        here). The lease is released either way, and tried once: a retry computes the prompt."""
        h, r.handoff = r.handoff, None
        if h is None or self.handoff is None:  # a lease with no importer here expires at its deadline
            return False
        s, alloc = r.seq, self.runner.allocator
        n = len(s.prompt)
        try:
            if h.num_tokens != n or s.forced_first is None or s.table.blocks or s.output:
                raise HandoffError(f"lease of {h.num_tokens} positions for a {n}-token prompt")
            if h.prompt_digest != prompt_digest(s.prompt):
                raise HandoffError("lease of another prompt (its digest differs from this request's)")
            alloc.ensure(s.table, n)
            if len(h.blocks) != len(s.table.blocks):
                raise HandoffError(f"lease of {len(h.blocks)} blocks; the prompt takes {len(s.table.blocks)} here")
            self.handoff.copy(h, list(s.table.blocks))
        except HandoffError as e:
            alloc.free(s.table)
            self.handoff.fallback(str(e).split(" (")[0][:60])
            log.warning("device-path import of request %d failed (%s); computing its prompt here", r.id, e)
            return False
        finally:
            self.handoff.release(h)
        s.table.num_tokens = n
        if method == "dflash":
            s.draft_len = n
        s.stats.ttft_ms = (time.perf_counter() - s.t_start) * 1e3
        s.commit([s.forced_first])
        self.stats.handoff_imports += 1
        return True

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
