"""The worker side of the KV connector: a prefix fetch runs off the engine loop.

A request whose prefix is still loading from a slow store waits on its own: the running batch keeps
stepping (and streaming) meanwhile, and once the data is here the request is admitted with the hit,
its tokens and acceptance lengths equal to a cold run's. The scheduler side's lookup counts what a
restore would take without moving data or counting a request.
"""
from __future__ import annotations

import threading

import pytest
import torch

from flashpd.engine.scheduler import generate, Scheduler
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    return target, load_drafter(dflash_pair.draft_dir, target)


class _GatedStore(MemoryStore):
    """A real memory store whose reads block until `gate` is set (a slow bridge)."""

    def __init__(self) -> None:
        super().__init__(1 << 28)
        self.gate = threading.Event()
        self.gate.set()
        self.reading = threading.Event()

    def _wait(self) -> None:
        self.reading.set()
        assert self.gate.wait(60), "test gate never opened"

    def get(self, key, layout=None):
        self._wait()
        return super().get(key, layout)

    def get_shared(self, key, layout=None):  # a restore's read
        self._wait()
        return super().get_shared(key, layout)


def _runner(target, drafter) -> ModelRunner:
    return ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids))


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 126, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


def _publish(target, drafter, cache: PrefixCache, prompts: list[list[int]], sp: SamplingParams,
             method: str = "dflash") -> None:
    """Run the prompts through a scheduler over `cache`, so their full chunks are in its store (DFlash: both halves,
    a hit for either method)."""
    warm = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache)
    for p in prompts:
        warm.add(p, sp, method)
    warm.run_until_idle()
    warm.flush_saves()


def _cold(target, drafter, prompt: list[int], sp: SamplingParams):
    """The prompt's DFlash run alone, no cache: the tokens and acceptance lengths every path must give."""
    return generate(DFlashGenerator(_runner(target, drafter), drafter, ()), [prompt], [sp])[0]


def test_a_loading_request_does_not_stop_the_running_batch(pair):
    target, drafter = pair
    store = _GatedStore()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=32)
    slow = _prompts(1, 21, 150, 151)[0]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    _publish(target, drafter, cache, [slow], sp)
    assert store.stats()["entries"] == 4

    cold = _cold(target, drafter, slow, sp)
    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache)
    assert cache.lookup_tokens(sched.spec, slow) == 128 and cache.stats.requests == 1  # no side effect
    others = [sched.add(p, SamplingParams(max_tokens=60, ignore_eos=True), "native")
              for p in _prompts(3, 22, 20, 40)]
    for _ in range(3):
        sched.step()
    store.gate.clear()
    store.reading.clear()
    r = sched.add(slow, sp, "dflash")
    assert store.reading.wait(30), "the fetch did not start"
    before = {o.id: len(o.seq.output) for o in others}
    for _ in range(5):  # the fetch is blocked: the batch steps on without it
        sched.step()
    assert r in sched.waiting and not r.seq.output
    assert all(len(o.seq.output) > before[o.id] for o in others), "the running batch stalled on a load"
    store.gate.set()
    sched.run_until_idle()
    assert cache.stats.per_request_hits[-1] == 128  # admitted with its prefix restored
    assert r.seq.output == cold.output and r.seq.stats.acceptance_lengths == cold.stats.acceptance_lengths


def test_a_resumed_request_fetches_its_prefix_off_the_engine_loop(pair):
    """A request resumed after its worker died (a failover lands many at once) fetches its prompt's prefix as a
    fresh one does: the batch steps on while the fetch is blocked, and the recompute at its admission starts from
    the fetched prefix; its tokens and acceptance lengths are the uninterrupted run's."""
    target, drafter = pair
    store = _GatedStore()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=32)
    slow = _prompts(1, 23, 150, 151)[0]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    _publish(target, drafter, cache, [slow], sp)
    assert store.stats()["entries"] == 4
    cold = _cold(target, drafter, slow, sp)
    acc = cold.stats.acceptance_lengths
    cut = 1 + sum(acc[:2])  # where the dead worker's stream stopped: its prefill's token and two steps
    assert cut < len(cold.output) - 5

    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache)
    others = [sched.add(p, SamplingParams(max_tokens=60, ignore_eos=True), "native")
              for p in _prompts(3, 24, 20, 40)]
    for _ in range(3):
        sched.step()
    store.gate.clear()
    store.reading.clear()
    r = sched.add(slow, sp, "dflash", resumed=cold.output[:cut])
    try:
        assert store.reading.wait(30), "the resumed request's fetch did not start"
        before = {o.id: len(o.seq.output) for o in others}
        for _ in range(5):  # the fetch is blocked: the batch steps on without it
            sched.step()
        assert r in sched.waiting and len(r.seq.output) == cut
        assert all(len(o.seq.output) > before[o.id] for o in others), "the running batch stalled on a load"
    finally:
        store.gate.set()
    sched.run_until_idle()
    assert cache.stats.per_request_hits[-1] == 128  # its recompute started from the fetched prefix
    assert sched.stats.recomputed_tokens == len(slow) + cut - 1 - 128
    assert r.seq.output == cold.output and r.seq.stats.acceptance_lengths == acc[2:]


class _ReadersStore(MemoryStore):
    """A real memory store noting the threads that look prefixes up in it (every fetch and restore does)."""

    def __init__(self) -> None:
        super().__init__(1 << 28)
        self.readers: list[str] = []

    def lookup(self, keys):
        self.readers.append(threading.current_thread().name)
        return super().lookup(keys)


def test_a_preempted_request_fetches_its_prefix_off_the_engine_loop(pair):
    """Policy preempt, 24 blocks for 6 requests that need ~600 positions: each preempted request's prompt prefix is
    fetched on a load thread when it is preempted, never read on the engine thread at its re-admission (the batch
    waited on the store there), and every request still gives a cold run's tokens and acceptance lengths."""
    target, drafter = pair
    store = _ReadersStore()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=16)
    prompts = _prompts(6, 3, 40, 140)
    methods = ["dflash", "dflash", "native", "dflash", "native", "dflash"]
    _publish(target, drafter, cache, prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    store.readers.clear()
    applied = cache.stats.requests
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    sched = Scheduler(ModelRunner(target, 25, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter,
                      prefix_cache=cache, policy="preempt")
    reqs = [sched.add(p, sp, m) for p, m in zip(prompts, methods)]
    for _ in range(2000):
        if sched.idle:
            break
        sched.step()
    assert sched.idle and sched.stats.preemptions > 0 and sched.stats.load_errors == 0
    assert sched.runner.allocator.num_free == 24
    readers = set(store.readers)  # the load threads fetch, the save thread looks up what it need not store again
    assert "kv-load_0" in readers and all(t.startswith(("kv-load", "kv-save")) for t in readers), readers
    assert cache.stats.requests - applied == len(reqs) + sched.stats.preemptions  # every admission applied a fetch
    assert all(h > 0 for h in cache.stats.per_request_hits[applied:])  # (each prompt is in the store)
    for r, p, m in zip(reqs, prompts, methods):
        gen = DFlashGenerator(_runner(target, drafter), drafter, ()) if m == "dflash" else \
            NativeGenerator(_runner(target, drafter))
        cold = generate(gen, [p], [sp])[0]
        assert r.seq.output == cold.output and r.seq.stats.acceptance_lengths == cold.stats.acceptance_lengths, r.id


def test_preempted_fetches_wait_on_no_save_and_stay_within_load_ahead(pair, monkeypatch):
    """A preempted request's fetch does not wait on saves queued before it (a new request's does, to find a prompt
    finished just before it): its re-admission used to restore at once, and a slow save must not hold it. Fetches
    held stay within LOAD_AHEAD: a preemption past it restores at admission. Every request ends as a cold run."""
    from concurrent.futures import Future

    from flashpd.engine import scheduler as sch

    monkeypatch.setattr(sch, "LOAD_AHEAD", 1)
    target, drafter = pair
    store = MemoryStore(1 << 28)
    cache = PrefixCache(store, "f" * 64, chunk_tokens=16)
    prompts = _prompts(3, 5, 40, 80)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    _publish(target, drafter, cache, prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache, policy="preempt")
    sched.overlap = False  # (no device-loop session: the rows are preempted between steps, as _make_room does)
    reqs = [sched.add(p, sp, "dflash") for p in prompts]
    while len(sched.running) < 3 or any(r.load is not None for r in reqs):
        sched.step()
    sched.step()
    slow_save: Future = Future()  # a save still running (a slow bridge write)
    sched._saves.append(slow_save)
    newest, second = sched.running[-1], sched.running[-2]
    try:
        sched._preempt(newest)
        sched._preempt(second)
        assert newest.load is not None and newest.load.result(timeout=10) is not None  # did not wait on the save
        assert second.load is None and not second.wants_load  # past LOAD_AHEAD: restored at its admission
        assert list(sched.waiting) == [second, newest]
    finally:
        slow_save.set_result(None)
    sched.run_until_idle()
    free = _runner(target, drafter).allocator.num_free
    assert sched.stats.load_errors == 0 and sched.runner.allocator.num_free == free
    for r, p in zip(reqs, prompts):
        cold = _cold(target, drafter, p, sp)
        assert r.seq.output == cold.output and r.seq.stats.acceptance_lengths == cold.stats.acceptance_lengths, r.id


class _SlowPutStore(MemoryStore):
    """A real memory store whose writes block until `gate` is set (a slow bridge)."""

    def __init__(self) -> None:
        super().__init__(1 << 28)
        self.gate = threading.Event()
        self.putting = threading.Event()

    def put(self, chunk) -> bool:
        self.putting.set()
        assert self.gate.wait(60), "test gate never opened"
        return super().put(chunk)


def test_a_slow_save_does_not_stop_the_batch_and_a_later_fetch_waits_for_it(pair):
    target, drafter = pair
    store = _SlowPutStore()
    cache = PrefixCache(store, "e" * 64, chunk_tokens=32)
    first = _prompts(1, 31, 100, 101)[0]
    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache)
    others = [sched.add(p, SamplingParams(max_tokens=50, ignore_eos=True), "native") for p in _prompts(2, 32, 20, 40)]
    short = sched.add(first, SamplingParams(max_tokens=2, ignore_eos=True), "dflash")
    while not short.seq.done:
        sched.step()
    assert store.putting.wait(30), "the save did not start"
    before = {o.id: len(o.seq.output) for o in others}
    for _ in range(4):  # the save is blocked in its thread: the batch steps on
        sched.step()
    assert all(len(o.seq.output) > before[o.id] for o in others), "the running batch stalled on a save"
    again = sched.add(first, SamplingParams(max_tokens=20, ignore_eos=True), "dflash")  # queued behind the save
    store.gate.set()
    sched.run_until_idle()
    assert cache.stats.per_request_hits[-1] == 96  # the save landed before the fetch read the store
    cold = generate(DFlashGenerator(_runner(target, drafter), drafter, ()),
        [first], [SamplingParams(max_tokens=20, ignore_eos=True)])[0]
    assert again.seq.output == cold.output and again.seq.stats.acceptance_lengths == cold.stats.acceptance_lengths


class _FlakyStore(MemoryStore):
    """A real memory store whose first lookup raises an OSError (a disk tier's transient read error)."""

    def __init__(self) -> None:
        super().__init__(1 << 28)
        self.fail = 0

    def lookup(self, keys):
        if self.fail:
            self.fail -= 1
            raise OSError("transient read error")
        return super().lookup(keys)


def test_a_fetch_that_raised_is_read_again_not_fatal(pair):
    """Its future is taken before it is read: the admission reads the prefix on the engine thread instead and
    the request finishes as a cold run would, with the hit (a retry used to re-read the failed future)."""
    target, drafter = pair
    store = _FlakyStore()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=32)
    p = _prompts(1, 31, 100, 101)[0]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    _publish(target, drafter, cache, [p], sp)
    cold = _cold(target, drafter, p, sp)
    runner = _runner(target, drafter)
    free0 = runner.allocator.num_free
    sched = Scheduler(runner, drafter, prefix_cache=cache)
    assert sched.async_load
    store.fail = 1
    r = sched.add(p, sp, "dflash")
    failed = []
    while not sched.idle:
        failed += sched.step().failed
    assert not failed and r.seq.finish_reason == "length"
    assert sched.stats.load_errors == 1 and store.fail == 0
    assert r.seq.output == cold.output and cache.stats.hit_tokens >= 96
    assert runner.allocator.num_free == free0


def test_fetches_start_for_the_queues_first_requests_only(pair, monkeypatch):
    """A fetch holds its prefix until admission, so only LOAD_AHEAD of them run or wait ahead of it; the rest
    start as those are admitted, and every request still gets its hit and a cold run's tokens."""
    from flashpd.engine import scheduler as sch

    monkeypatch.setattr(sch, "LOAD_AHEAD", 3)
    target, drafter = pair
    store = _GatedStore()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=32)
    ps = _prompts(8, 41, 70, 100)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    _publish(target, drafter, cache, ps, sp, "native")
    store.gate.clear()
    cache = PrefixCache(store, "f" * 64, chunk_tokens=32)  # its own stats
    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=cache)
    reqs = [sched.add(p, sp, "native") for p in ps]
    try:
        assert sum(r.load is not None for r in reqs) == sch.LOAD_AHEAD
        assert all(r.wants_load for r in reqs[sch.LOAD_AHEAD:])
        for _ in range(3):
            sched.step()  # nothing is ready: no more fetches start while the first ones hold the window
        assert sum(r.load is not None for r in reqs) == sch.LOAD_AHEAD
    finally:
        store.gate.set()
    sched.run_until_idle()
    assert not any(r.wants_load or r.load is not None for r in reqs)
    # in the order the fetches finished (4 load threads): compared as a multiset
    assert sorted(cache.stats.per_request_hits) == sorted((len(p) - 1) // 32 * 32 for p in ps)
    cold = generate(NativeGenerator(_runner(target, drafter)), ps[-2:], [sp] * 2)
    assert [r.seq.output for r in reqs[-2:]] == [c.output for c in cold]


def test_a_stopped_engine_loop_leaves_no_load_or_save_threads(pair):
    """Its scheduler's pools end with it (each stopped worker left a load and a save thread behind); the saves
    it queued still reach the store."""
    from flashpd.decode_node.engine_loop import EngineLoop

    target, drafter = pair
    names = ("kv-load", "kv-save")
    before = set(threading.enumerate())  # other tests' schedulers in this process are not this test's
    store = MemoryStore(1 << 28)
    sched = Scheduler(_runner(target, drafter), drafter, prefix_cache=PrefixCache(store, "f" * 64, chunk_tokens=32))
    loop = EngineLoop(sched)
    h = loop.submit(_prompts(1, 51, 80, 81)[0], SamplingParams(max_tokens=4, ignore_eos=True), "dflash")
    while h.events.get(timeout=60).kind != "done":
        pass
    ours = [t for t in set(threading.enumerate()) - before if t.name.startswith(names)]
    assert {t.name.split("_")[0] for t in ours} == set(names)  # both pools ran
    loop.stop()
    for t in ours:
        t.join(10)
    assert not [t.name for t in ours if t.is_alive()]
    assert store.stats()["entries"] == 2
