"""A restore's chunks copied to the GPU while the next is read (kv_bridge/stage.py), and the read it rests on: a
fetch takes a store's chunks one by one (iter_many), hands each on before it reads the next, and ends a read it
does not finish. The copies themselves need CUDA (the tests marked so run on a GPU machine)."""
from __future__ import annotations

import gc

import numpy as np
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
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
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
    """A store in front of another whose iter_many notes each chunk it hands out and whether it was closed."""

    def __init__(self, inner, events: list[str], tamper_at: int | None = None) -> None:
        self.inner, self.events, self.tamper_at = inner, events, tamper_at
        self.closed_early = False

    def iter_many(self, keys, layout=None):
        it = iter(leading_gets(self.inner, keys, layout))
        done = False
        try:
            for i, c in enumerate(it):
                self.events.append(f"read {i}")
                if i == self.tamper_at:  # another prompt's tokens: the fetch must refuse it and stop reading
                    c = KVChunk(c.key, c.parent, c.fingerprint, [t + 1 for t in c.token_ids], c.target_kv, c.draft_kv)
                yield c
            done = True
        finally:
            self.closed_early = not done

    def get(self, key, layout=None):
        return self.inner.get(key, layout)

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def put(self, c):
        return self.inner.put(c)


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
    real_run = pc.stager.run

    def run():
        r = real_run()
        add = r.add
        r.add = lambda c, *a: (events.append(f"add {len([e for e in events if e.startswith('add')])}"), add(c, *a))[1]
        return r
    pc.stager.run = run
    got = pc.fetch(spec_gen(target, drafter), p)
    n = (len(p) - 1) // CHUNK
    assert len(got.chunks) == n == 4
    assert events == [e for i in range(n) for e in (f"read {i}", f"add {i}")]


def test_a_fetch_that_refuses_a_chunk_ends_the_read_there():
    """A chunk the fetch refuses (here: another prompt's tokens) ends the run, and the store's read is closed
    rather than read to its end (a bridge stream is cancelled, an SHM one drained: iter_get's close)."""
    target, drafter = pair("cpu")
    p = prompts(1)[0]
    store = MemoryStore(1 << 26)
    generate(spec_gen(target, drafter), [p], [PARAMS], prefix_cache=PrefixCache(store, "fp", CHUNK))
    events: list[str] = []
    rec = Recording(store, events, tamper_at=1)
    pc = PrefixCache(rec, "fp", CHUNK)
    got = pc.fetch(spec_gen(target, drafter), p)
    assert len(got.chunks) == 1 and got.refused
    assert events == ["read 0", "read 1"] and rec.closed_early


def test_a_bridge_restore_reads_one_stream_chunk_by_chunk_and_equals_cold():
    """Through a real bridge (RemoteStore.iter_many over one Get stream, metered): the hit equals cold, and the
    meter counts the run's bytes as an import."""
    target, drafter = pair("cpu")
    ps = prompts(2)
    server, port = serve(MemoryStore(1 << 26))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            meter = MeteredStore(RemoteStore(c, "inline"))
            cold = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=PrefixCache(meter, "fp", CHUNK))
            pc = PrefixCache(meter, "fp", CHUNK)
            before = meter.bytes["import"]
            hit = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=pc)
            assert pc.stats.per_request_hits == [128, 128]
            assert meter.bytes["import"] - before > 0 and meter.chunks["import"] >= 8
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


@CUDA
def test_a_staged_chunk_is_the_host_chunks_values_on_the_gpu_within_the_budget():
    dev = torch.device("cuda")
    cs = [host_chunk(i, pinned=i % 2 == 0) for i in range(3)]
    one = cs[0].nbytes()
    s = Stager(2 * one)
    run = s.run()
    out = [run.add(c, dev, dev) for c in cs]
    assert run.finish() is None
    assert [type(c) is StagedChunk for c in out] == [True, True, False]  # the third is past the budget
    assert s.stats["over_budget"] == 1 and s.staged_bytes == 2 * one
    for a, b in zip(cs[:2], out[:2]):
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


@CUDA
def test_a_chunk_whose_arena_slot_was_reused_under_its_copy_is_reported_with_the_rest():
    dev = torch.device("cuda")
    word = np.zeros(1, dtype=np.uint32)
    cs = [host_chunk(i) for i in range(3)]
    cs[1].lease = Lease(float("inf"), word, 0)
    s = Stager(1 << 30)
    run = s.run()
    out = [run.add(c, dev, dev) for c in cs]
    word[0] = 1  # the bridge bumped the slot's generation: the bytes read may be another chunk's
    assert run.finish() == 1 and s.stats["stale"] == 1
    assert all(type(c) is StagedChunk for c in out)


@CUDA
@pytest.mark.parametrize("stage_bytes", [1 << 30, 0])
def test_a_restore_from_a_bridge_arena_staged_on_the_gpu_equals_cold(stage_bytes):
    """The whole path on a GPU: a real bridge with an arena, its chunks staged while the next is verified, written
    device to device; tokens and acceptance equal a cold run's, with staging on and off."""
    from flashpd.kv_bridge.arena_store import ArenaStore
    target, drafter = pair("cuda")
    ps = prompts(2)
    server, port = serve(ArenaStore(1 << 27))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30, pin_device=torch.device("cuda")) as c:
            cold = generate(spec_gen(target, drafter), ps, [PARAMS] * 2,
                            prefix_cache=PrefixCache(RemoteStore(c, "arena"), "fp", CHUNK))
            pc = PrefixCache(RemoteStore(c, "arena"), "fp", CHUNK, stage_bytes=stage_bytes)
            hit = generate(spec_gen(target, drafter), ps, [PARAMS] * 2, prefix_cache=pc)
            assert pc.stats.per_request_hits == [128, 128] and pc.stats.refused_chunks == 0
            assert pc.stager.stats["staged_chunks"] == (8 if stage_bytes else 0)
            for a, b in zip(cold, hit):
                assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
    finally:
        server.stop(grace=None).wait(10)
