"""A restore's chunks copied to the GPU while the next is read (kv_bridge/stage.py), and the read it rests on: a
fetch takes a store's chunks one by one (iter_many), hands each on before it reads the next, and ends a read it
does not finish. The copies themselves need CUDA (the tests marked so run on a GPU machine)."""
from __future__ import annotations

import gc
import time

import pytest
import torch

from flashpd.cluster.bridge_meter import MeteredStore
from flashpd.engine.config import Qwen3Config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.kv_bridge.chunk import KVChunk, Lease
from flashpd.kv_bridge.client import BridgeClient, BridgeError, RemoteStore
from flashpd.kv_bridge.device_store import DeviceStore
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.stage import StagedChunk, Stager
from flashpd.kv_bridge.store import MemoryStore, leading_gets

CHUNK = 32
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="staging copies to a GPU")


def pair(device: str):
    cfg = Qwen3Config.from_dict(TINY, source="tiny")
    target = dummy_target(cfg, device, torch.float32, seed=3)
    drafter = dummy_drafter(drafter_config_for(cfg, 2, 16), target, seed=4)
    return target, drafter


def spec_gen(target, drafter) -> DFlashGenerator:
    return DFlashGenerator(ModelRunner(target, 128, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)


def prompts(n: int = 2, length: int = 140) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (length,), generator=g).tolist() for _ in range(n)]


class Recording:
    """A store in front of another whose iter_many notes each chunk it hands out and an early close. It keeps its
    generator, so only an explicit close() ends it early (not the collector, once the fetch dropped it)."""

    def __init__(self, inner, events: list[str], tamper_at: int | None = None, fail_at: int | None = None) -> None:
        self.inner, self.events, self.tamper_at, self.fail_at = inner, events, tamper_at, fail_at
        self.gen = None

    def iter_many(self, keys, layout=None):
        self.gen = self._gen(keys, layout)
        return self.gen

    def _gen(self, keys, layout):
        try:
            for i, c in enumerate(leading_gets(self.inner, keys, layout)):
                if i == self.fail_at:
                    self.events.append("raise")
                    raise BridgeError("Get", "the bridge went away mid-run")
                self.events.append(f"read {i}")
                if i == self.tamper_at:  # another prompt's tokens: the fetch must refuse it and stop reading
                    c = KVChunk(c.key, c.parent, c.fingerprint, [t + 1 for t in c.token_ids], c.target_kv, c.draft_kv)
                yield c
        except GeneratorExit:  # closed before its end
            self.events.append("close")
            raise

    def get(self, key, layout=None):
        return self.inner.get(key, layout)

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def put(self, c):
        return self.inner.put(c)


def logged_runs(pc: PrefixCache, events: list[str]) -> None:
    """pc's stage runs note each add and their finish in events."""
    real_run = pc.stager.run

    def run():
        r = real_run()
        add, finish = r.add, r.finish
        r.add = lambda c, *a: (events.append(f"add {sum(e.startswith('add') for e in events)}"), add(c, *a))[1]
        r.finish = lambda: (events.append("finish"), finish())[1]
        return r
    pc.stager.run = run


def test_a_fetch_hands_each_chunk_on_before_it_reads_the_next():
    """The overlap rests on this order: chunk i's copy starts (StageRun.add) before chunk i+1 is read and verified.
    A fetch that read the whole run first (get_many) would give every read before any add."""
    target, drafter = pair("cpu")
    p = prompts(1)[0]
    store = MemoryStore(1 << 26)
    fp = "fp-stage"
    generate(spec_gen(target, drafter), [p], [PARAMS], prefix_cache=PrefixCache(store, fp, CHUNK))
    events: list[str] = []
    pc = PrefixCache(Recording(store, events), fp, CHUNK)
    logged_runs(pc, events)
    got = pc.fetch(spec_gen(target, drafter), p)
    n = (len(p) - 1) // CHUNK
    assert len(got.chunks) == n == 4
    assert events == [e for i in range(n) for e in (f"read {i}", f"add {i}")] + ["finish"]  # read to its end


def test_a_fetch_that_refuses_a_chunk_ends_the_read_there():
    """A chunk the fetch refuses (here: another prompt's tokens) ends the run, and the store's read is closed
    rather than read to its end (a bridge stream is cancelled, an SHM one drained: iter_get's close), after the
    run's copies are waited for (a copy may still read a chunk's bytes)."""
    target, drafter = pair("cpu")
    p = prompts(1)[0]
    store = MemoryStore(1 << 26)
    generate(spec_gen(target, drafter), [p], [PARAMS], prefix_cache=PrefixCache(store, "fp", CHUNK))
    events: list[str] = []
    rec = Recording(store, events, tamper_at=1)
    pc = PrefixCache(rec, "fp", CHUNK)
    logged_runs(pc, events)
    got = pc.fetch(spec_gen(target, drafter), p)
    assert len(got.chunks) == 1 and got.refused
    assert events == ["read 0", "add 0", "read 1", "finish", "close"]


def test_a_read_that_fails_mid_run_raises_after_waiting_and_closing():
    """An error from the store's read (a bridge gone) is the fetch's error, as it was from get_many, raised after
    the copies already started were waited for."""
    target, drafter = pair("cpu")
    p = prompts(1)[0]
    store = MemoryStore(1 << 26)
    generate(spec_gen(target, drafter), [p], [PARAMS], prefix_cache=PrefixCache(store, "fp", CHUNK))
    events: list[str] = []
    pc = PrefixCache(Recording(store, events, fail_at=2), "fp", CHUNK)
    logged_runs(pc, events)
    with pytest.raises(BridgeError, match="went away"):
        pc.fetch(spec_gen(target, drafter), p)
    assert events == ["read 0", "add 0", "read 1", "add 1", "raise", "finish"]


class CallLog:
    """A Get call that notes whether the client cancelled it (a stream not read to its end)."""

    def __init__(self, call, log: list[str]) -> None:
        self._call, self._log = call, log

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._call)

    def cancel(self):
        self._log.append("cancel")
        return self._call.cancel()

    def __getattr__(self, name):
        return getattr(self._call, name)


def test_a_bridge_restore_reads_one_stream_chunk_by_chunk_and_equals_cold():
    """Through a real bridge (one Get stream, metered): the fetch reads it through iter_many, never get_many; a
    full hit reads the stream to its closing message (no cancel); the hit equals cold; the meter counts the
    run's bytes as an import."""
    target, drafter = pair("cpu")
    ps = prompts(2)
    server, port = serve(MemoryStore(1 << 26))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30, streams=1) as c:
            meter = MeteredStore(RemoteStore(c, "inline"))
            cold = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=PrefixCache(meter, "fp", CHUNK))
            calls: list[str] = []
            c._get_calls = [lambda *a, f=f, **k: CallLog(f(*a, **k), calls) for f in c._get_calls]
            meter.store.get_many = lambda *a, **k: pytest.fail("a fetch read the whole run before using any of it")
            pc = PrefixCache(meter, "fp", CHUNK)
            before = meter.bytes["import"], meter.chunks["import"]
            hit = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=pc)
            assert pc.stats.per_request_hits == [128, 128]
            assert calls == []  # two full hits, neither stream cancelled
            layers = TINY["num_hidden_layers"] + drafter.cfg.num_hidden_layers  # both halves, float32
            per_chunk = layers * 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4 * CHUNK
            assert meter.chunks["import"] - before[1] == 8
            assert meter.bytes["import"] - before[0] == 8 * per_chunk
            for a, b in zip(cold, hit):
                assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
    finally:
        server.stop(grace=None).wait(10)


def test_a_device_tier_hands_out_its_own_copy_of_what_it_promoted():
    """A chunk promoted from the backing store is returned as the tier's copy (the entry it now holds), so a
    restore does not copy it from the host a second time."""
    backing = MemoryStore(1 << 26)
    target, drafter = pair("cpu")
    p = prompts(1)[0]
    generate(spec_gen(target, drafter), [p], [PARAMS], prefix_cache=PrefixCache(backing, "fp", CHUNK))
    tier = DeviceStore(1 << 26, "cpu", backing=backing)
    pc = PrefixCache(tier, "fp", CHUNK)
    first = pc.fetch(spec_gen(target, drafter), p).chunks
    second = pc.fetch(spec_gen(target, drafter), p).chunks
    assert len(first) == len(second) == 4 and tier.stats()["hits_backing"] == 4 and tier.stats()["hits_device"] == 4
    assert all(a is b for a, b in zip(first, second))
    one = tier.get(first[0].key)
    assert one is first[0]


def test_a_stager_refuses_a_negative_budget():
    with pytest.raises(ValueError, match="budget_bytes"):
        Stager(-1)


def test_staging_on_a_cpu_cache_leaves_every_chunk_as_it_came():
    s = Stager(1 << 20)
    run = s.run()
    c = KVChunk("k", "", "fp", [1], torch.zeros(2, 2), torch.zeros(1, 2))
    assert run.add(c, torch.device("cpu"), torch.device("cpu")) is c
    assert run.finish() is None and s.staged_bytes == 0 and s.stats["staged_chunks"] == 0


def host_chunk(i: int, pinned: bool = False) -> KVChunk:
    g = torch.Generator().manual_seed(i)
    t = torch.randn(4, 2, 256, 4, 128, generator=g).to(torch.bfloat16)
    d = torch.randn(2, 2, 256, 4, 128, generator=g).to(torch.bfloat16)
    if pinned:
        t, d = t.pin_memory(), d.pin_memory()
    return KVChunk(f"h{i}", "", "fp", list(range(256)), t, d)


def clone(c: KVChunk) -> KVChunk:
    return KVChunk(c.key, c.parent, c.fingerprint, list(c.token_ids), c.target_kv.clone(), c.draft_kv.clone())


@CUDA
def test_a_staged_chunk_is_the_host_chunks_values_on_the_gpu_within_the_budget():
    """The side stream is held busy before the copies are queued: a finish that did not wait for them would let the
    sources be overwritten (below) before the copies read them."""
    dev = torch.device("cuda")
    cs = [host_chunk(i, pinned=i % 2 == 0) for i in range(3)]
    want = [clone(c) for c in cs]
    one = cs[0].nbytes()
    s = Stager(2 * one)
    with torch.cuda.stream(s._stream(dev)):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the stream's time ahead of the copies
    run = s.run()
    out = [run.add(c, dev, dev) for c in cs]
    assert run.finish() is None
    for c in cs:  # the sources change once finish returned: the staged copies must already hold the old values
        c.target_kv.zero_()
        c.draft_kv.zero_()
    assert [type(c) is StagedChunk for c in out] == [True, True, False]  # the third is past the budget
    assert s.stats["over_budget"] == 1 and s.staged_bytes == 2 * one
    for a, b in zip(want[:2], out[:2]):
        assert b.target_kv.is_cuda and b.draft_kv.is_cuda
        assert torch.equal(a.target_kv, b.target_kv.cpu()) and torch.equal(a.draft_kv, b.draft_kv.cpu())
    assert out[2] is cs[2]
    del out, b
    gc.collect()
    assert s.staged_bytes == 0  # a staged chunk dropped gives its bytes back
    # the draft half left on the host (the control restores none): only the target half is staged and counted
    run = s.run()
    c = run.add(cs[1], dev, None)
    assert run.finish() is None and c.target_kv.is_cuda and c.draft_kv is cs[1].draft_kv
    assert s.staged_bytes == cs[1].target_kv.nbytes


class Word:
    """A lease's generation word that notes, each time it is read, whether the side stream had finished its work."""

    def __init__(self, stream, value: int) -> None:
        self.stream, self.value, self.reads = stream, value, []

    def __getitem__(self, i: int) -> int:
        self.reads.append(self.stream.query())
        return self.value


@CUDA
def test_a_chunk_whose_arena_slot_was_reused_under_its_copy_is_reported_with_the_rest():
    """A source's lease is read only after its copy is done (else a slot reused during the copy would pass), and the
    first stale source's index ends the run."""
    dev = torch.device("cuda")
    s = Stager(1 << 30)
    word = Word(s._stream(dev), 0)
    cs = [host_chunk(i) for i in range(3)]
    cs[1].lease = Lease(float("inf"), word, 0)
    with torch.cuda.stream(s._stream(dev)):
        torch.cuda._sleep(200_000_000)
    run = s.run()
    out = [run.add(c, dev, dev) for c in cs]
    word.value = 1  # the bridge bumped the slot's generation: the bytes read may be another chunk's
    assert run.finish() == 1 and s.stats["stale"] == 1
    assert word.reads == [True]
    assert all(type(c) is StagedChunk for c in out)


@CUDA
def test_out_of_memory_on_a_chunks_second_half_waits_for_its_first_and_pauses_staging(monkeypatch):
    """The device has no memory for the draft half after the target half's copy was queued (an out-of-memory error
    raised in its place): the chunk is left on the host, its bytes are given back, finish still waits for the
    queued copy, and no chunk is staged for OOM_PAUSE_S (each failed allocation frees the allocator's cache)."""
    from flashpd.kv_bridge import stage
    dev = torch.device("cuda")
    s = Stager(1 << 30)
    real_copy = stage.StageRun._copy
    calls = []

    def copy(self, t, device):
        calls.append(t.shape[0])
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("no memory for the draft half")
        return real_copy(self, t, device)
    monkeypatch.setattr(stage.StageRun, "_copy", copy)
    with torch.cuda.stream(s._stream(dev)):
        torch.cuda._sleep(200_000_000)
    run = s.run()
    c = host_chunk(0)
    assert run.add(c, dev, dev) is c and calls == [4, 2]
    assert s.stats["out_of_memory"] == 1 and s.staged_bytes == 0
    assert run.add(host_chunk(1), dev, dev).target_kv.device.type == "cpu" and calls == [4, 2]  # paused
    assert run.finish() is None and s._stream(dev).query()  # the target half's copy was waited for
    monkeypatch.setattr(stage, "OOM_PAUSE_S", 0.0)
    s._paused_until = 0.0
    assert type(s.run().add(host_chunk(2), dev, dev)) is StagedChunk


def arena_restore(stage_bytes: int, slow: bool = False):
    """Cold runs and hits of two prompts through a real arena bridge on the GPU: (cold, hit, the hit's cache, how
    many staged chunks were handed to the engine's stream). slow: the reader waits past its hold after reading."""
    from flashpd.kv_bridge.arena import READER_MARGIN_S
    from flashpd.kv_bridge.arena_store import ArenaStore

    class SlowReader(RemoteStore):
        def iter_many(self, keys, layout=None):
            yield from super().iter_many(keys, layout)
            time.sleep(0.3)  # past the hold below, after the copies were queued: every source is stale by finish

    target, drafter = pair("cuda")
    ps = prompts(2)
    server, port = serve(ArenaStore(1 << 27, hold_s=READER_MARGIN_S + 0.2 if slow else 2.0))
    handed = []
    real = StagedChunk.handed_to_current_stream
    StagedChunk.handed_to_current_stream = lambda self: (handed.append(1), real(self))[1]
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30, pin_device=torch.device("cuda")) as c:
            cold = generate(spec_gen(target, drafter), ps, [PARAMS] * 2,
                            prefix_cache=PrefixCache(RemoteStore(c, "arena"), "fp", CHUNK))
            pc = PrefixCache((SlowReader if slow else RemoteStore)(c, "arena"), "fp", CHUNK, stage_bytes=stage_bytes)
            hit = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=pc)
    finally:
        StagedChunk.handed_to_current_stream = real
        server.stop(grace=None).wait(10)
    return cold, hit, pc, len(handed)


@CUDA
@pytest.mark.parametrize("stage_bytes", [1 << 30, 0])
def test_a_restore_from_a_bridge_arena_staged_on_the_gpu_equals_cold(stage_bytes):
    """The whole path on a GPU: a real bridge with an arena, its chunks staged while the next is verified, handed to
    the engine's stream and written device to device; tokens and acceptance equal a cold run's, with staging on and
    off; the staged bytes are given back once the restores are done."""
    cold, hit, pc, handed = arena_restore(stage_bytes)
    assert pc.stats.per_request_hits == [128, 128] and pc.stats.refused_chunks == 0
    assert pc.stager.stats["staged_chunks"] == handed == (8 if stage_bytes else 0)
    gc.collect()
    assert pc.stager.staged_bytes == 0
    for a, b in zip(cold, hit):
        assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths


@CUDA
def test_a_staged_restore_read_past_its_arena_hold_is_recomputed_never_used():
    """The reader is slower than its hold (the slot could hold another chunk by the time the copies are checked):
    the staged run is dropped from its first stale chunk, those positions are recomputed, tokens equal cold."""
    cold, hit, pc, handed = arena_restore(1 << 30, slow=True)
    assert pc.stats.per_request_hits == [0, 0] and pc.stats.refused_chunks == 2
    assert pc.stager.stats["stale"] == 2 and handed == 0
    for a, b in zip(cold, hit):
        assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
