"""PrefillWorker: compute a prompt's target KV and drafter state, publish both, return the first token.

The prefill side of disaggregation. A prompt is prefilled with the drafter's taps (so the
drafter's context K/V exists for every prompt position), its full chunks are published to the
bridge as two-half entries, and the first token (from the prefill's last logits) is returned at
once for TTFT. A decode worker with a prefix cache on the same bridge then imports those chunks
and recomputes only the partial tail, so its output and acceptance equal a colocated run.

With `publish_after_answer` the first token does not wait for the bridge: the prompt's full chunks are read out
of the caches (device copies, so the blocks go back at once), the answer leaves with a ticket, and a thread of the
worker's own publishes them in order; `await_publish(ticket)` says when they are there (the router waits for it
before it sends the request to a decode worker, which then finds the whole prefix). At the Qwen3-8B shape a
publish took 1.4-3.8x the prefill's own time (arena and inline bridges, docs/results.md), all of it on the first
token's path before. The copies waiting for their publish are bounded (`max_pending_bytes`): a prefill
past it publishes before it answers, as before. A prefill whose prompt begins with a queued publish's first chunk
waits for that publish, so it restores the shared prefix rather than computing it again.

With an exporter (the same-host device path, kv_bridge/handoff.py) nothing is published: the
prompt's blocks stay allocated under a lease that the result carries, the decode worker copies them
device to device, and `release` (or the lease's deadline, `expire`) frees them. While it computes, the
exporter's busy word is set, so a decode worker on the same GPU holds its steps (kv_bridge/handoff.py).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Sequence

from flashpd.engine.drafter import DFlashDrafter
from flashpd.engine.kv_cache import OutOfBlocks
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.handoff import prompt_digest
from flashpd.kv_bridge.handoff import CacheExporter, Handoff
from flashpd.kv_bridge.prefix_cache import Pending, PrefixCache

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 1 << 30  # chunk copies waiting for their publish (device memory): 2 prompts of 2,700
TICKET_TTL_S = 120.0  # a finished publish's outcome is kept this long for its AwaitPublish (or until awaited)
PREFIX_WAIT_S = 30.0  # a prefill waits at most this long for a queued publish of its prompt's first chunk


class UnknownTicket(KeyError):
    """No publish of this ticket (never issued, already awaited, or its outcome expired)."""


class PublishPending(Exception):
    """The ticket's publish still runs (await_publish's timeout passed first)."""


class PublishFailed(Exception):
    """The ticket's publish failed; the message says why. (Raised afresh, without the failure's traceback, whose
    frames would keep the publish's device copies alive for as long as the outcome is kept.)"""


@dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request
    published_chunks: int  # with a publish_ticket: the full chunks the bridge will hold once it is done
    cached_tokens: int  # prompt positions that were already in the bridge (not recomputed)
    prefill_ms: float
    handoff: Handoff | None = None  # the device path's lease on the prompt's blocks
    publish_ticket: int = 0  # nonzero: the publish runs after the answer (await_publish)


def _pending_bytes(p: Pending) -> int:
    return sum(t.numel() * t.element_size() for t in p.target + p.draft)


class Publisher:
    """The publishes a prefill worker runs after its answers: one thread, in order, each under a ticket whose
    outcome (chunks put, or PublishFailed) await_ returns once; at most max_bytes of chunk copies wait at once
    (`has_room`: a prefill past it publishes before it answers)."""

    def __init__(self, cache, max_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-publish")
        # tickets start at a random base: a router's AwaitPublish to a restarted worker must not find another's
        self._ids = itertools.count(secrets.randbits(62) + 1)
        # ticket -> (its publish, when it was queued, the prompt's first chunk_tokens tokens)
        self._futures: dict[int, tuple[Future, float, tuple[int, ...]]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.failures = 0

    def has_room(self, pending: Pending) -> bool:
        with self._lock:
            return not self._bytes or self._bytes + _pending_bytes(pending) <= self.max_bytes

    def submit(self, pending: Pending, head: tuple[int, ...]) -> int:
        """Queue a publish (head: the prompt's first chunk's tokens, for `wait_for_prefix`); its ticket."""
        n = _pending_bytes(pending)
        with self._lock:
            self._expire()
            ticket = next(self._ids)
            self._bytes += n
            try:
                self._futures[ticket] = (self._pool.submit(self._publish, pending, n), time.monotonic(), head)
            except BaseException:  # a closed pool (a stopping worker): nothing queued
                self._bytes -= n
                raise
        return ticket

    def _publish(self, pending: Pending, n: int) -> int:
        why = None
        try:
            return self.cache.store_pending(pending)
        except Exception as e:  # noqa: BLE001  the ticket's outcome: its AwaitPublish says so
            why = f"{type(e).__name__}: {e}"
        finally:
            pending.target.clear()  # the device copies go now, not with the ticket's outcome
            pending.draft.clear()
            with self._lock:
                self._bytes -= n
                self.failures += why is not None
        log.warning("publishing a prompt's chunks after its answer failed (%s); its decode worker computes what "
                    "is missing", why)
        raise PublishFailed(why)  # outside the except block: no reference to the failure's frames

    def wait_for_prefix(self, prompt: list[int], chunk_tokens: int, timeout_s: float) -> None:
        """Wait (at most timeout_s) for the queued publishes of prompts that begin with this prompt's first chunk:
        a prefill restores what they put rather than computing it again (the scheduler's saves give the same
        guarantee to its fetches, engine/scheduler.py `_fetch_after`)."""
        head = tuple(prompt[:chunk_tokens])
        if len(head) < chunk_tokens:
            return
        with self._lock:
            waits = [f for f, _, h in self._futures.values() if h == head and not f.done()]
        if waits:
            futures_wait(waits, timeout=timeout_s)

    def await_(self, ticket: int, timeout_s: float | None) -> int:
        """The chunks the ticket's publish put, once: a ticket whose outcome was returned (or raised) is forgotten.
        PublishFailed when it failed; PublishPending while it still runs past timeout_s; UnknownTicket for a ticket
        never issued, already awaited, or whose outcome expired (TICKET_TTL_S after it was queued)."""
        with self._lock:
            entry = self._futures.get(ticket)
        if entry is None:
            raise UnknownTicket(ticket)
        done, _ = futures_wait([entry[0]], timeout=timeout_s)
        if not done:
            raise PublishPending(f"the publish of ticket {ticket} still runs")
        with self._lock:
            self._futures.pop(ticket, None)
        return entry[0].result()

    def _expire(self) -> None:
        """(under the lock) Forget the finished publishes older than TICKET_TTL_S."""
        now = time.monotonic()
        for t in [t for t, (f, at, _) in self._futures.items() if f.done() and now - at > TICKET_TTL_S]:
            del self._futures[t]

    def drain(self, timeout_s: float) -> bool:
        """Whether every queued publish finished within timeout_s (a stopping worker waits for them)."""
        with self._lock:
            futures = [f for f, _, _ in self._futures.values()]
        return not futures_wait(futures, timeout=timeout_s).not_done

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class PrefillWorker:
    def __init__(self, runner: ModelRunner, drafter: DFlashDrafter | None, cache: PrefixCache | None,
                 stop_ids: tuple[int, ...] = (), exporter: CacheExporter | None = None,
                 publish_after_answer: bool = False, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        self.gen = DFlashGenerator(runner, drafter, stop_ids) if drafter is not None else \
            NativeGenerator(runner, stop_ids)
        self.cache = cache
        self.exporter = exporter
        self.publisher = Publisher(cache, max_pending_bytes) if publish_after_answer and cache is not None else None

    def prefill(self, prompt: list[int], params: SamplingParams) -> PrefillResult:
        """Not thread-safe (one runner): the caller serialises prefill, release and expire."""
        t0 = time.perf_counter()
        gen = self.gen
        if self.exporter is not None:
            self.exporter.expire()  # leases nobody came for give their blocks back first
        seq = gen.new_sequences([prompt], [params])[0]
        # the prompt's blocks only: a prefill computes (and a lease holds) nothing past the prompt, so a request's
        # max_tokens must not refuse it here (its decode worker checks the whole request's room)
        need, free = -(-len(prompt) // gen.runner.kv_block_size), gen.runner.allocator.num_free
        if need > free:
            raise OutOfBlocks(f"a {len(prompt)}-token prompt needs {need} KV blocks; {free} are free")
        before = self.cache.stats.hit_tokens if self.cache is not None else 0
        handoff, published, ticket = None, 0, 0
        if self.publisher is not None:  # a queued publish of this prompt's first chunk: restored, not recomputed
            self.publisher.wait_for_prefix(prompt, self.cache.chunk_tokens, PREFIX_WAIT_S)
        try:  # whatever fails (restore, prefill, publish, lease), the blocks go back
            with self.exporter.computing() if self.exporter is not None else contextlib.nullcontext():
                gen.restore_prefixes([seq], self.cache)
                gen.prefill_request([seq])  # DFlash: the drafter's context too, in the same forwards
            if self.exporter is not None:
                table, alloc = seq.table, gen.runner.allocator
                handoff = self.exporter.lease(list(table.blocks), len(prompt), lambda: alloc.free(table),
                                              prompt_digest(prompt))
            elif self.publisher is not None and self.cache.restore_draft:
                pending = self.cache.collect(gen, seq)  # device copies: the blocks go back below
                if not pending.target:
                    pass
                elif self.publisher.has_room(pending):
                    published = len(pending.target)
                    ticket = self.publisher.submit(pending, tuple(prompt[:self.cache.chunk_tokens]))
                else:  # the copies queued already fill the bound: this one publishes before it answers
                    published = self.cache.store_pending(pending)
            elif self.cache is not None:
                published = self.cache.publish(gen, seq)
        finally:
            if handoff is None:
                gen.runner.allocator.free(seq.table)
        cached = (self.cache.stats.hit_tokens - before) if self.cache is not None else 0
        return PrefillResult(seq.output[0], seq.finish_reason, published, cached, (time.perf_counter() - t0) * 1e3,
                             handoff, ticket)

    def await_publish(self, ticket: int, timeout_s: float | None) -> int:
        """The chunks a publish after an answer put (Publisher.await_: once a ticket; thread-safe, not serialised
        with prefill)."""
        if self.publisher is None:
            raise UnknownTicket(ticket)
        return self.publisher.await_(ticket, timeout_s)

    def release(self, lease_id: int, blocks: Sequence[int], epochs: Sequence[int]) -> bool:
        """The decode worker is done with a lease: free its blocks (False: unknown or expired already, or refused:
        not exactly the lease's blocks and epochs, as its handoff named them)."""
        return self.exporter.release(lease_id, blocks, epochs) if self.exporter is not None else False
