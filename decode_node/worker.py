"""DecodeWorker: the decode side of disaggregation, as one object a server can drive.

It owns a Scheduler in the preempting policy (admission by free KV blocks, preemption by recompute
when blocks run out) behind an EngineLoop thread that streams each request's tokens, and imports
prompts from the KV bridge through a GuardedPrefixCache (a failed import is recomputed locally,
counted and logged). A request may carry the first token its prefill worker already streamed;
it is committed as is. A `sink` goes to its EngineLoop (an engine process forwards the events
through it). `stats()` is what the worker's metrics and health read. `stalled()` tells a hung engine loop (it has
requests and has finished no step for more than `stall_s`: a device or kernel that never returns) from a busy one;
a decode worker's Health says not serving meanwhile (cluster/worker_services.py), so the pool restarts it.

`stats()` and `failure_reasons()` read counters that other threads add keys to (the engine thread, the load and save
threads: import and publish failures, device-path fallbacks) through `snapshot()`, a copy made in one C call: a
scrape that iterated them in Python while a thread added a new reason failed ("dictionary changed size during
iteration"). `quiesce()` says when nothing of the worker can use its stores any more (its engine loop has ended and
the load, save and import threads its scheduler let go at that end have finished): the bridge client is closed
only then (a call on a closed gRPC channel can crash the process).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Callable

from flashpd.decode_node.engine_loop import EngineLoop, Handle
from flashpd.decode_node.bridge_import import GuardedPrefixCache
from flashpd.decode_node.scheduler import Scheduler
from flashpd.decode_node.step_log import StepLog
from flashpd.engine.scheduler import Request
from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.jit_watch import JitWatch
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine.width_policy import WidthPolicy

log = logging.getLogger(__name__)


def snapshot(counts: Mapping[str, int]) -> dict[str, int]:
    """A copy of a dict of counts that other threads add keys to. dict.copy runs no Python code (the keys are str,
    the values int), so no other thread runs while it copies: iterating it in Python instead (a comprehension over
    its items(), sum() over a subclass's values()) lets a writer in between two items, and a new key then fails the
    read with "dictionary changed size during iteration"."""
    return dict.copy(counts)  # type: ignore[arg-type]  (a Counter, or any dict subclass: its own storage)


SCRATCH_CHUNKS = 4  # the warm-up's private prefix store holds this many chunks (its hit pass keeps 2 at once)


def scratch_cache(cache: PrefixCache | None, scheduler: Scheduler) -> PrefixCache | None:
    """A private, empty prefix cache of the serving cache's kind (fingerprint, chunk size, drafter restores; its
    stager, so no second staging stream) for the warm-up's own hits (engine/warmup.py `warm_hits`), on a host store
    sized for SCRATCH_CHUNKS of this engine's chunks; dropped after the warm-up. None without a cache."""
    if cache is None:
        return None
    gen = scheduler.spec if scheduler.spec is not None else scheduler.native
    drafts = getattr(gen, "drafts", None)
    layout = ChunkLayout.of_caches(gen.runner.cache.data, drafts.cache.data if drafts is not None else None,
                                   cache.chunk_tokens, cache.fingerprint)
    scratch = PrefixCache(MemoryStore(SCRATCH_CHUNKS * (layout.payload_bytes() + (1 << 16))), cache.fingerprint,
                          cache.chunk_tokens, cache.restore_draft, stage_bytes=0)
    scratch.stager = cache.stager
    return scratch


class DecodeWorker:
    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None = None, stop_ids: tuple[int, ...] = (),
                 prefix_cache: PrefixCache | None = None, max_running: int = 64, policy: str = "preempt",
                 on_finish: Callable[[Request], None] | None = None, warmup: bool = False,
                 width_policy: WidthPolicy | None = None, step_log_s: float = 10.0, hold_fraction: float = 0.0,
                 hold_steps: int = 4, sink=None, stall_s: float | None = None,
                 on_abort: Callable[[str, str, int], None] | None = None) -> None:
        self.cache = GuardedPrefixCache(prefix_cache) if prefix_cache is not None else None
        self.scheduler = Scheduler(runner, drafter, stop_ids, self.cache, max_running, policy, width_policy)
        self.warmup = None
        self.jit: JitWatch | None = None  # compiles and graph captures after the warm-up (none: no warm-up)
        if warmup:  # before the engine thread starts: nothing else touches the scheduler yet
            from flashpd.engine.warmup import lengths_for, warm_scheduler  # noqa: PLC0415
            spec = self.scheduler.spec
            new = 2 * (spec.draft_width if spec is not None else 16) + 1
            self.warmup = warm_scheduler(self.scheduler, lengths_for(runner.max_positions, new), new,
                                         scratch_cache=scratch_cache(prefix_cache, self.scheduler))
            log.info("decode warm-up: %d requests (%s; prompts of %s tokens; prefix hits of %s rows) in %.1f s",
                     self.warmup["requests"], "/".join(self.warmup["methods"]), self.warmup["lengths"],
                     self.warmup["hit_batches"] if prefix_cache is not None else "no", self.warmup["seconds"])
            self.jit = JitWatch()
        # after the warm-up, so that it runs as it always did (engine/scheduler.py: holding a serving session)
        self.scheduler.hold_fraction, self.scheduler.hold_steps = hold_fraction, hold_steps
        self.step_log: StepLog | None = None
        self.loop = EngineLoop(self.scheduler, name="decode-worker", on_finish=on_finish, after_step=self._after_step,
                               sink=sink, on_abort=on_abort)
        self.loop.stall_s = stall_s
        self.step_log = StepLog(self.loop, step_log_s) if step_log_s > 0 else None

    def _after_step(self) -> None:
        """The engine loop's monitors after each step: compiles and captures since the warm-up, the periodic log."""
        if self.jit is not None:
            self.jit.check()
        if self.step_log is not None:
            self.step_log()

    def submit(self, prompt: list[int], params: SamplingParams, method: str = "native", draft_width: int | None = None,
               first_token: int | None = None, timeout_s: float = 30.0) -> Handle:
        """Queue a request (see EngineLoop.submit); its events stream from the returned handle."""
        return self.loop.submit(prompt, params, method, draft_width, timeout_s, first_token)

    @property
    def stall_s(self) -> float | None:
        """How long the engine loop may hold requests without finishing a step before it is taken for hung."""
        return self.loop.stall_s

    @stall_s.setter
    def stall_s(self, value: float | None) -> None:
        self.loop.stall_s = value

    def stalled(self) -> bool:
        """Whether the engine loop looks hung (EngineLoop.stalled); its counts() then say not serving."""
        return self.loop.stalled()

    def stats(self) -> dict:
        """Counters since start (read from any thread; each value is a plain int)."""
        s = self.scheduler
        out = dict(self.loop.counts().as_dict(), preemptions=s.stats.preemptions, recomputed_tokens=s.stats.recomputed_tokens,
                   steps=self.loop.steps, failed_requests=s.stats.failed_requests,
                   handoff_imports=s.stats.handoff_imports, prefill_holds=s.stats.prefill_holds,
                   handoff_fallbacks=sum(snapshot(s.handoff.fallbacks).values()) if s.handoff is not None else 0,
                   jit_compiles_after_warmup=self.jit.compiled_after if self.jit is not None else 0,
                   graph_captures_after_warmup=self.jit.captures_after if self.jit is not None else 0)
        if self.cache is not None:
            c = self.cache.stats
            out.update(cache_hit_tokens=c.hit_tokens, cache_prompt_tokens=c.prompt_tokens,
                       import_failures=sum(snapshot(self.cache.import_failures).values()),
                       publish_failures=sum(snapshot(self.cache.publish_failures).values()))
        return out

    def failure_reasons(self) -> dict[str, int]:
        """Bridge imports that failed and were recomputed, by reason (a copy: see snapshot)."""
        return snapshot(self.cache.import_failures) if self.cache is not None else {}

    def stop(self, timeout_s: float = 10.0) -> None:
        self.loop.stop(timeout_s)

    def quiesce(self, timeout_s: float) -> bool:
        """Wait (up to timeout_s) until nothing of this worker can call its stores (the bridge client behind its
        prefix cache) any more: its engine loop has ended (it is stopped, if it was not), and so have the load,
        save and import threads its scheduler let go at that end (a running fetch, the queued saves). False:
        something may still use them."""
        deadline = time.monotonic() + timeout_s
        try:
            self.loop.stop(timeout_s)
        except TimeoutError:
            return False
        pools = list(self.scheduler.let_go)
        if not pools:
            return True
        done = threading.Event()

        def join() -> None:
            for p in pools:
                p.shutdown(wait=True)
            done.set()

        threading.Thread(target=join, name="decode-quiesce", daemon=True).start()
        return done.wait(max(0.0, deadline - time.monotonic()))
