"""Method-aware prefix cache: a hit restores target KV AND drafter state, so tokens and per-step
acceptance lengths equal a cold colocated run (float32, CPU, the trained fixture pair)."""
from __future__ import annotations

import time

import pytest
import torch

from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.kv_transfer import position_slots, read_positions
from flashpd.engine.runner import ModelRunner
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.keys import MethodFingerprint, chunk_keys, weights_identity
from flashpd.kv_bridge.prefix_cache import Pending, PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine.scheduler import generate
from flashpd.engine.sequence import Sequence

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

CHUNK = 64


class DictStore:
    """The smallest store with the protocol's semantics (the tiered stores are tested on their own)."""

    def __init__(self) -> None:
        self.d: dict[str, KVChunk] = {}

    def put(self, c: KVChunk) -> bool:
        return self.d.setdefault(c.key, c) is c

    def get(self, k: str, layout=None) -> KVChunk | None:  # the layout is checked by the PrefixCache
        return self.d.get(k)

    def lookup(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.d:
            n += 1
        return n


@pytest.fixture(scope="module")
def setup(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    fp = MethodFingerprint(weights_identity(dflash_pair.target_dir), weights_identity(dflash_pair.draft_dir),
                           tuple(drafter.cfg.target_layer_ids), "float32").digest()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in torch.randint(300, 460, (20,), generator=g)]
    return target, drafter, fp, prompts


def spec_gen(target, drafter) -> DFlashGenerator:
    return DFlashGenerator(ModelRunner(target, 2048, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)


PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True)]


def test_hit_gives_same_tokens_and_acceptance_as_cold(setup):
    target, drafter, fp, prompts = setup
    store = DictStore()
    cold = generate(spec_gen(target, drafter), prompts, PARAMS * len(prompts), prefix_cache=PrefixCache(store, fp, CHUNK))
    assert len(store.d) == sum(len(p) // CHUNK for p in prompts)
    assert all(c.draft_kv is not None for c in store.d.values())  # both halves, always
    pc = PrefixCache(store, fp, CHUNK)
    hit = generate(spec_gen(target, drafter), prompts, PARAMS * len(prompts), prefix_cache=pc)
    assert pc.stats.per_request_hits == [((len(p) - 1) // CHUNK) * CHUNK for p in prompts]
    assert min(pc.stats.per_request_hits) >= 256
    for a, b in zip(cold, hit):
        assert a.output == b.output
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
    assert max(max(a.stats.acceptance_lengths) for a in cold) > 1  # the drafter accepts: parity means something


def test_a_memory_store_hit_reads_its_entries_in_place_and_equals_cold(setup):
    """A restore reads a memory store's chunks as views of its entries (get_shared: no copy of each chunk into fresh
    memory, the larger part of such a hit's time on a GPU) and only copies them out: the entries stay byte for byte
    what was published, and the hit's tokens and acceptance equal cold's."""
    target, drafter, fp, prompts = setup
    prompts = prompts[:3]

    class Counting(MemoryStore):
        shared = 0

        def get_shared(self, key, layout=None):
            Counting.shared += 1
            return super().get_shared(key, layout)

    store = Counting(1 << 30)
    cold = generate(spec_gen(target, drafter), prompts, PARAMS * len(prompts), prefix_cache=PrefixCache(store, fp, CHUNK))
    before = {k: store.get_bytes(k) for k in chunk_keys_of(prompts, fp)}
    pc = PrefixCache(store, fp, CHUNK)
    hit = generate(spec_gen(target, drafter), prompts, PARAMS * len(prompts), prefix_cache=pc)
    assert Counting.shared == sum(h // CHUNK for h in pc.stats.per_request_hits) > 0
    assert {k: store.get_bytes(k) for k in before} == before and None not in before.values()
    for a, b in zip(cold, hit):
        assert (a.output, a.stats.acceptance_lengths) == (b.output, b.stats.acceptance_lengths)


def chunk_keys_of(prompts: list[list[int]], fp: str) -> list[str]:
    return [k for p in prompts for k in chunk_keys(p, CHUNK, fp)]


def _gen(target, drafter, fresh: bool) -> DFlashGenerator:
    runner = ModelRunner(target, 2048, 16, taps=tuple(drafter.cfg.target_layer_ids),
                         config=RunnerConfig(fresh_prefill=fresh))
    return DFlashGenerator(runner, drafter, (), 16)


def _prefill_kv(target, drafter, prompt: list[int], pc: PrefixCache | None, fresh: bool):
    """Both caches' K/V at every prompt position after prefilling `prompt` (restoring what `pc` holds first)."""
    gen = _gen(target, drafter, fresh)
    runner = gen.runner
    s = gen.new_sequences([prompt], PARAMS)[0]
    runner.allocator.ensure(s.table, len(prompt))
    restored = pc.restore(gen, s) if pc is not None else 0
    gen.prefill_request([s])
    slots = position_slots(s.table, 0, len(prompt), 16, runner.device)
    return read_positions(runner.cache.data, slots), read_positions(gen.drafts.cache.data, slots), restored


@pytest.mark.parametrize("fresh", [False, True])
def test_a_hit_restores_the_cold_prefills_bits_and_its_tail_agrees_to_rounding(setup, fresh):
    """The restored positions hold, both halves, bit for bit, what a cold prefill of the prompt computes there. The
    tail past them is one forward of its own, a shape the cold prefill never ran (one token here, the whole prompt
    there), so its K/V agree with the cold run's to float32 rounding, not bitwise: a hit's tokens and acceptance
    lengths equal a cold run's except where that rounding decides a near-tie (docs/architecture.md)."""
    target, drafter, fp, prompts = setup
    for n in (CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 300):
        prompt = prompts[0][:n]
        store = DictStore()
        generate(_gen(target, drafter, fresh), [prompt], PARAMS, prefix_cache=PrefixCache(store, fp, CHUNK))  # publish
        t0, d0, _ = _prefill_kv(target, drafter, prompt, None, fresh)
        t1, d1, k = _prefill_kv(target, drafter, prompt, PrefixCache(store, fp, CHUNK), fresh)
        assert k == ((n - 1) // CHUNK) * CHUNK > 0
        assert torch.equal(t0[:, :, :k], t1[:, :, :k]) and torch.equal(d0[:, :, :k], d1[:, :, :k]), n
        assert (t0 - t1).abs().max() < 1e-4 and (d0 - d1).abs().max() < 1e-4, n


def test_the_weights_identity_covers_every_byte(tmp_path):
    """One byte changed anywhere in a weight file (here far from any offset a sampled identity would read) makes
    another identity, so a changed drafter's keys differ and the old one's entries are never restored as its own;
    the same bytes elsewhere give the same identity, and a file changed in place is hashed again."""
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"x": 1}')
        save_file({"w": torch.zeros(3 << 20)}, str(d / "model.safetensors"))  # 12 MiB
    assert weights_identity(a) == weights_identity(b)
    path = b / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 100_000] ^= 1  # between the 33rd and 34th of 64 sampled 64 KiB windows
    path.write_bytes(bytes(data))
    assert weights_identity(a) != weights_identity(b)
    (b / "config.json").write_text('{"x": 2}')
    path.write_bytes((a / "model.safetensors").read_bytes())
    assert weights_identity(a) != weights_identity(b)  # config.json counts too


def test_hit_in_the_same_worker_reuses_freed_blocks(setup):
    target, drafter, fp, prompts = setup
    gen, store = spec_gen(target, drafter), DictStore()
    cold = generate(gen, prompts[:8], PARAMS * 8, prefix_cache=PrefixCache(store, fp, CHUNK))
    free = gen.runner.allocator.num_free
    hit = generate(gen, prompts[:8], PARAMS * 8, prefix_cache=PrefixCache(store, fp, CHUNK))
    assert gen.runner.allocator.num_free == free
    assert [s.output for s in cold] == [s.output for s in hit]
    assert [s.stats.acceptance_lengths for s in cold] == [s.stats.acceptance_lengths for s in hit]


def test_other_fingerprint_is_a_miss_never_a_hit(setup):
    target, drafter, fp, prompts = setup
    store = DictStore()
    generate(spec_gen(target, drafter), prompts[:3], PARAMS * 3, prefix_cache=PrefixCache(store, fp, CHUNK))
    other = MethodFingerprint("other-target", "d", tuple(drafter.cfg.target_layer_ids), "float32").digest()
    pc = PrefixCache(store, other, CHUNK)
    generate(spec_gen(target, drafter), prompts[:3], PARAMS * 3, prefix_cache=pc)
    assert pc.stats.hit_tokens == 0
    assert chunk_keys(prompts[0], CHUNK, fp)[0] != chunk_keys(prompts[0], CHUNK, other)[0]


def test_a_chunk_whose_tokens_disagree_is_refused_and_recomputed(setup):
    target, drafter, fp, prompts = setup
    store = DictStore()
    cold = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=PrefixCache(store, fp, CHUNK))
    key = chunk_keys(prompts[0], CHUNK, fp)[1]
    bad = store.d[key]
    store.d[key] = KVChunk(bad.key, bad.parent, bad.fingerprint, [t + 1 for t in bad.token_ids], bad.target_kv,
                           bad.draft_kv)
    pc = PrefixCache(store, fp, CHUNK)
    again = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=pc)
    assert pc.stats.refused_chunks == 1 and pc.stats.per_request_hits[0] == CHUNK
    assert [s.output for s in again] == [s.output for s in cold]
    assert [s.stats.acceptance_lengths for s in again] == [s.stats.acceptance_lengths for s in cold]


def test_a_fetch_applied_to_another_prompt_of_its_length_is_refused_before_any_write(setup):
    """apply() checks each fetched chunk's tokens against the sequence it writes, not only the prompt's length: a
    restore fetched for one prompt and applied to another (a scheduler bug) would write the wrong KV silently."""
    target, drafter, fp, prompts = setup
    store, gen = DictStore(), spec_gen(target, drafter)
    generate(gen, prompts[:1], PARAMS, prefix_cache=PrefixCache(store, fp, CHUNK))
    pc = PrefixCache(store, fp, CHUNK)
    got = pc.fetch(gen, prompts[0])
    assert len(got.chunks) >= 2
    other = list(prompts[0])
    other[CHUNK + 3] = (other[CHUNK + 3] + 1) % 126  # the same length; its second chunk differs
    seq = Sequence(other, PARAMS[0], frozenset())
    gen.runner.allocator.ensure(seq.table, len(other))
    before = (gen.runner.cache.data.clone(), gen.drafts.cache.data.clone())
    try:
        with pytest.raises(ValueError, match="another prompt"):
            pc.apply(gen, seq, got)
        assert seq.table.num_tokens == 0 and seq.draft_len == 0 and pc.stats.requests == 0
        assert torch.equal(before[0], gen.runner.cache.data) and torch.equal(before[1], gen.drafts.cache.data)
    finally:
        gen.runner.allocator.free(seq.table)


def test_native_prefix_cache_stores_target_kv_only_and_is_exact(setup):
    target, _, _, prompts = setup
    fp = MethodFingerprint("t", "none", (), "float32").digest()
    store = DictStore()
    gen = NativeGenerator(ModelRunner(target, 2048, 16))
    cold = generate(gen, prompts[:4], PARAMS * 4, prefix_cache=PrefixCache(store, fp, CHUNK))
    assert all(c.draft_kv is None for c in store.d.values())
    pc = PrefixCache(store, fp, CHUNK)
    hit = generate(gen, prompts[:4], PARAMS * 4, prefix_cache=pc)
    assert pc.stats.hit_tokens > 0 and [s.output for s in hit] == [s.output for s in cold]


def test_target_only_control_keeps_tokens_exact(setup):
    """The control restores target KV only: the output stays exact (every token is the target's)."""
    target, drafter, fp, prompts = setup
    store = DictStore()
    cold = generate(spec_gen(target, drafter), prompts[:6], PARAMS * 6, prefix_cache=PrefixCache(store, fp, CHUNK))
    pc = PrefixCache(store, fp, CHUNK, restore_draft=False)
    ctl = generate(spec_gen(target, drafter), prompts[:6], PARAMS * 6, prefix_cache=pc)
    assert pc.stats.hit_tokens > 0
    assert [s.output for s in ctl] == [s.output for s in cold]


def test_the_control_never_writes_to_its_store(setup):
    """The control's restored draft halves are zeros: it publishes nothing (were a chunk evicted after its
    restore, it would go back as a full entry of zeroed drafter state under the real fingerprint)."""
    target, drafter, fp, prompts = setup
    store = DictStore()
    pc = PrefixCache(store, fp, CHUNK, restore_draft=False)
    generate(spec_gen(target, drafter), prompts[:3], PARAMS * 3, prefix_cache=pc)
    assert not store.d and pc.stats.published_chunks == 0
    # the scheduler's form (collect on the engine loop, store_pending on another thread) puts nothing either
    assert pc.store_pending(Pending(list(prompts[0]), True, [torch.zeros(1)], [torch.zeros(1)])) == 0 and not store.d


def _cold_and_hit(setup, publish_store, hit_store_factory, n: int = 20):
    target, drafter, fp, prompts = setup
    cold = generate(spec_gen(target, drafter), prompts[:n], PARAMS * n, prefix_cache=PrefixCache(publish_store, fp, CHUNK))
    pc = PrefixCache(hit_store_factory(), fp, CHUNK)
    hit = generate(spec_gen(target, drafter), prompts[:n], PARAMS * n, prefix_cache=pc)
    assert pc.stats.per_request_hits == [((len(p) - 1) // CHUNK) * CHUNK for p in prompts[:n]]
    for a, b in zip(cold, hit):
        assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_transfer_through_a_real_grpc_bridge_equals_cold(setup, transport):
    """Prefill side publishes into the bridge over gRPC (127.0.0.1); the decode side imports from it."""
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore
    from flashpd.kv_bridge.server import serve
    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as prefill_side, \
                BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as decode_side:
            _cold_and_hit(setup, RemoteStore(prefill_side), lambda: RemoteStore(decode_side, transport=transport))
            assert decode_side.stats()["store.entries"] == sum(len(p) // CHUNK for p in setup[3][:20])
    finally:
        server.stop(grace=None).wait(10)


def test_hit_from_the_disk_tier_after_a_restart_equals_cold(setup, tmp_path):
    from flashpd.kv_bridge.disk import DiskStore
    # the decode side opens the directory after the prefill side wrote it: a restart's view
    _cold_and_hit(setup, DiskStore(tmp_path / "kv", 1 << 30), lambda: DiskStore(tmp_path / "kv", 1 << 30))


def test_hit_through_the_lmcache_backend_equals_cold(setup):
    """(d) both halves go through LMCache's engine and CPU backend as one packed object per chunk.
    lmcache is a test requirement: if it cannot be imported this test fails, it is never skipped."""
    from flashpd.kv_bridge.lmcache_layout import PackedLayout
    from flashpd.kv_bridge.lmcache_store import LMCacheStore
    target, drafter, fp, prompts = setup
    layout = PackedLayout.of_models(target.cfg, drafter.cfg, CHUNK, torch.float32)
    with LMCacheStore(layout, 64 << 20) as store:
        _cold_and_hit(setup, store, lambda: store)
        s = store.stats()
        assert s["entries"] == s["puts"] == sum(len(p) // CHUNK for p in prompts[:20])
        assert s["corrupt_dropped"] == s["layout_refused"] == 0
        other = MethodFingerprint("other-target", "d", tuple(drafter.cfg.target_layer_ids), "float32").digest()
        pc = PrefixCache(store, other, CHUNK)  # another method over the same LMCache: a miss, never a hit
        generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=pc)
        assert pc.stats.hit_tokens == 0


def test_hit_from_the_device_tier_equals_cold(setup):
    """The worker's hot tier keeps entries as tensors on the cache's device: a hit is a device copy."""
    from flashpd.kv_bridge.device_store import DeviceStore
    store = DeviceStore(256 << 20, "cpu")
    _cold_and_hit(setup, store, lambda: store)
    s = store.stats()
    assert s["entries"] == s["puts"] == sum(len(p) // CHUNK for p in setup[3][:20]) and s["evictions"] == 0
    assert s["hits_device"] == sum((len(p) - 1) // CHUNK for p in setup[3][:20]) and s["misses"] == 0


def test_device_tier_evicts_whole_entries_and_its_backing_serves_them(setup):
    """A budget of 3 entries: the device tier evicts least-recently-used entries (both halves at once),
    the backing store it writes through still serves them exactly, and a served entry is promoted."""
    from flashpd.kv_bridge.device_store import DeviceStore
    target, drafter, fp, prompts = setup
    probe = DeviceStore(1 << 30, "cpu")
    generate(spec_gen(target, drafter), prompts[:1], PARAMS, prefix_cache=PrefixCache(probe, fp, CHUNK))
    entry = probe.stats()["bytes"] // probe.stats()["entries"]
    store = DeviceStore(3 * entry, "cpu", backing=MemoryStore(1 << 30))
    _cold_and_hit(setup, store, lambda: store)
    s = store.stats()
    assert s["entries"] == 3 and s["bytes"] == 3 * entry and s["evictions"] > 0
    assert s["hits_backing"] > 0 and s["misses"] == 0
    assert s["backing"]["entries"] == sum(len(p) // CHUNK for p in prompts[:20])


def test_native_entries_never_shadow_the_full_entries_dflash_needs(setup):
    """One worker, one fingerprint, mixed traffic: a native request publishes target K/V only, on its own
    chain. A DFlash request for the same prompt then misses (it is never offered a half entry), publishes
    both halves, and the next DFlash request hits fully; a native request uses a full entry's target half."""
    target, drafter, fp, prompts = setup
    store = DictStore()
    runner = ModelRunner(target, 2048, 16, taps=tuple(drafter.cfg.target_layer_ids))
    native, spec = NativeGenerator(runner), DFlashGenerator(runner, drafter, (), 16)
    p = prompts[:1]
    full = ((len(p[0]) - 1) // CHUNK) * CHUNK
    pc = PrefixCache(store, fp, CHUNK)
    first_native = generate(native, p, PARAMS, prefix_cache=pc)
    assert pc.stats.published_chunks == len(p[0]) // CHUNK and all(c.draft_kv is None for c in store.d.values())
    cold = generate(spec, p, PARAMS, prefix_cache=pc)  # target-only entries are not for DFlash: a plain miss
    assert pc.stats.per_request_hits[-1] == 0 and pc.stats.refused_chunks == 0
    hit = generate(spec, p, PARAMS, prefix_cache=pc)
    assert pc.stats.per_request_hits[-1] == full and pc.stats.refused_chunks == 0
    assert hit[0].output == cold[0].output and hit[0].stats.acceptance_lengths == cold[0].stats.acceptance_lengths
    again = generate(native, p, PARAMS, prefix_cache=pc)
    assert pc.stats.per_request_hits[-1] == full and again[0].output == first_native[0].output == cold[0].output


def test_device_tier_over_a_real_grpc_bridge_promotes_what_it_fetches(setup):
    """A decode worker's tiers: the device tier in front of a RemoteStore on a real bridge server. A fresh
    device tier fetches each prompt's run from the bridge in one batched call (exact: same tokens and
    acceptance as cold), promotes it, and serves the next hit on that prompt from the device."""
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore
    from flashpd.kv_bridge.device_store import DeviceStore
    from flashpd.kv_bridge.server import serve
    target, drafter, fp, prompts = setup
    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as prefill_side, \
                BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as decode_side:
            tier = DeviceStore(256 << 20, "cpu", backing=RemoteStore(decode_side))
            _cold_and_hit(setup, RemoteStore(prefill_side), lambda: tier, n=8)
            hits = sum((len(p) - 1) // CHUNK for p in prompts[:8])
            st = tier.stats()
            assert st["hits_backing"] == hits and st["hits_device"] == 0 and st["entries"] == hits
            pc = PrefixCache(tier, fp, CHUNK)
            generate(spec_gen(target, drafter), prompts[:8], PARAMS * 8, prefix_cache=pc)
            assert tier.stats()["hits_device"] == hits and tier.stats()["hits_backing"] == hits
    finally:
        server.stop(grace=None).wait(10)


def test_hits_read_in_place_from_a_bridge_arena_equal_cold(setup):
    """The arena transport: the decode side reads each chunk where the bridge's arena holds it (no segment, no
    copy in between), and the restore equals cold."""
    from flashpd.kv_bridge import shm
    from flashpd.kv_bridge.arena_store import ArenaStore
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore
    from flashpd.kv_bridge.server import serve
    server, port = serve(ArenaStore(256 << 20))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as prefill_side, \
                BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as decode_side:
            before = shm.list_segments()
            _cold_and_hit(setup, RemoteStore(prefill_side, "arena"), lambda: RemoteStore(decode_side, "arena"), n=6)
            st = decode_side.stats()
            hits = sum((len(p) - 1) // CHUNK for p in setup[3][:6])
            assert st["server.arena_handles_sent"] == hits and st["server.shm_segments_sent"] == 0
            assert shm.list_segments() == before
    finally:
        server.stop(grace=None).wait(10)


def test_a_restore_read_past_its_arena_hold_is_recomputed_never_used(setup):
    """A reader slower than its hold (here: the bridge holds a slot 0.2 s past the reader's margin, and the reader
    waits 0.3 s before it restores) must not use what it read: the slot may hold another chunk by then. The
    restore recomputes those positions (tokens and acceptance equal cold), and a device tier in front refuses to
    keep such a chunk."""
    from flashpd.kv_bridge.arena import READER_MARGIN_S
    from flashpd.kv_bridge.arena_store import ArenaStore
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore
    from flashpd.kv_bridge.device_store import DeviceStore
    from flashpd.kv_bridge.server import serve
    target, drafter, fp, prompts = setup

    class SlowReader(RemoteStore):
        def iter_many(self, keys, layout=None):  # get_many reads through it too
            got = list(super().iter_many(keys, layout))
            time.sleep(0.3)
            yield from got

    server, port = serve(ArenaStore(256 << 20, hold_s=READER_MARGIN_S + 0.2))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            cold = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2,
                            prefix_cache=PrefixCache(RemoteStore(c, "arena"), fp, CHUNK))
            pc = PrefixCache(SlowReader(c, "arena"), fp, CHUNK)
            late = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=pc)
            assert pc.stats.per_request_hits == [0, 0] and pc.stats.refused_chunks == 2
            for a, b in zip(cold, late):
                assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
            tier = DeviceStore(64 << 20, "cpu", backing=SlowReader(c, "arena"))
            pc = PrefixCache(tier, fp, CHUNK)
            generate(spec_gen(target, drafter), prompts[:1], PARAMS, prefix_cache=pc)
            assert tier.stats()["stale_refused"] >= 1 and tier.stats()["entries"] == 0
            assert pc.stats.per_request_hits == [0]
    finally:
        server.stop(grace=None).wait(10)


@pytest.mark.parametrize("tiers", ["bridge", "worker"])
def test_a_publish_to_a_bridge_is_one_put_call_for_the_prompts_chunks(setup, tiers):
    """Chunk by chunk, each Put waited for the bridge before the next chunk was serialised; one streamed call lets
    the two overlap. The bridge holds every chunk, in its prompt's order, and a hit from it equals cold. "worker":
    the stores a worker builds (cluster/worker_main.py: a device tier over a metered bridge store) pass it on."""
    from flashpd.cluster.bridge_meter import MeteredStore
    from flashpd.kv_bridge.device_store import DeviceStore
    from flashpd.kv_bridge.client import BridgeClient, RemoteStore
    from flashpd.kv_bridge.server import serve
    target, drafter, fp, prompts = setup
    server, port = serve(MemoryStore(1 << 30))
    try:
        with BridgeClient(f"127.0.0.1:{port}", timeout_s=30) as c:
            calls = []
            real_put = c.put

            def counting_put(chunks, *a, **k):
                chunks = list(chunks)
                calls.append(len(chunks))
                return real_put(chunks, *a, **k)
            c.put = counting_put
            meter = MeteredStore(RemoteStore(c))
            store = RemoteStore(c) if tiers == "bridge" else DeviceStore(64 << 20, "cpu", backing=meter)
            pc = PrefixCache(store, fp, CHUNK)
            cold = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=pc)
            assert calls == [len(p) // CHUNK for p in prompts[:2]] and pc.stats.published_chunks == sum(calls)
            assert c.stats()["store.entries"] == sum(calls)
            if tiers == "worker":
                assert meter.chunks["export"] == sum(calls) and meter.bytes["export"] > 0
            hit_pc = PrefixCache(RemoteStore(c), fp, CHUNK)
            hit = generate(spec_gen(target, drafter), prompts[:2], PARAMS * 2, prefix_cache=hit_pc)
            assert hit_pc.stats.per_request_hits == [((len(p) - 1) // CHUNK) * CHUNK for p in prompts[:2]]
            for a, b in zip(cold, hit):
                assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
    finally:
        server.stop(grace=None).wait(10)
