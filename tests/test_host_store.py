"""The host tier (kv_bridge/host_store.py), on the CPU: bit-exact round trips of both halves, LRU by
bytes, first put wins, a layout mismatch as a counted miss, an arena that stops allocating once
warm, a backing store behind it, and a prefix hit through it that gives the tokens AND acceptance
lengths of a cold run (float32, the trained fixture pair)."""
from __future__ import annotations

import pytest
import torch

from flashpd.engine.runner import ModelRunner
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.auth import process_secret
from flashpd.kv_bridge.chunk import KVChunk, LayoutMismatch
from flashpd.kv_bridge.device_store import DeviceStore
from flashpd.kv_bridge.host_store import HostStore
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.store import MemoryStore
from flashpd.engine.scheduler import generate

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)

T, LAYERS, DRAFT_LAYERS, HEADS, DIM = 16, 3, 2, 2, 8
FP = "fp-a"


def layout(fp: str | None = FP, dtype: str = "float32", tokens: int = T, draft: bool = True) -> ChunkLayout:
    return ChunkLayout(LAYERS, HEADS, DIM, tokens, dtype, DRAFT_LAYERS if draft else None, fp)


SLOT = layout().payload_bytes()


def chunk(i: int, dtype: torch.dtype = torch.float32, draft: bool = True, fp: str = FP,
          parent: str = "") -> KVChunk:
    """Chunk k{i}: each the first of its own prompt unless `parent` names the chunk before it."""
    g = torch.Generator().manual_seed(i)
    tk = torch.randn(LAYERS, 2, T, HEADS, DIM, generator=g).to(dtype)
    dk = torch.randn(DRAFT_LAYERS, 2, T, HEADS, DIM, generator=g).to(dtype) if draft else None
    return KVChunk(f"k{i}", parent, fp, list(range(i, i + T)), tk, dk)


def same(a: KVChunk, b: KVChunk) -> bool:
    """Bit for bit, both halves, and the chunk's identity."""
    def bits(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    ident = (a.key, a.parent, a.fingerprint, a.token_ids) == (b.key, b.parent, b.fingerprint, b.token_ids)
    return ident and bits(a.target_kv, b.target_kv) and bits(a.draft_kv, b.draft_kv)


def slots_budget(n: int, store_slot: int = SLOT) -> int:
    """A budget of exactly n slots (a slot is the chunk's bytes, aligned, plus the draft half's pad)."""
    return HostStore(1 << 20, "cpu", slot_bytes=store_slot).stats()["slot_bytes"] * n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_for_both_halves(dtype):
    s = HostStore(slots_budget(8), "cpu")
    lay = layout(dtype=str(dtype).removeprefix("torch."))
    cs = [chunk(i, dtype) for i in range(4)]
    assert all(s.put(c) for c in cs)
    assert all(same(c, s.get(c.key, lay)) for c in cs)
    got = s.get_many([c.key for c in cs], lay)
    assert len(got) == 4 and all(same(c, g) for c, g in zip(cs, got))
    got[0].target_kv.zero_()  # a hit hands out a copy: the entry is not a view the reader can write
    assert same(cs[0], s.get("k0", lay))
    st = s.stats()
    assert (st["hits"], st["misses"], st["entries"], st["bytes"]) == (9, 0, 4, 4 * cs[0].nbytes())


def test_target_only_entry_round_trips():
    s = HostStore(slots_budget(2), "cpu", slot_bytes=SLOT)
    c = chunk(0, draft=False)
    assert s.put(c)
    back = s.get("k0", layout(draft=False))
    assert same(c, back) and back.draft_kv is None
    with pytest.raises(LayoutMismatch):  # a DFlash reader needs the drafter half
        s.get("k0", layout())


def test_lru_eviction_by_bytes():
    s = HostStore(slots_budget(3), "cpu")
    for i in range(3):
        s.put(chunk(i))
    assert s.get("k0", layout()) is not None  # k0 is now the most recently used: k1 goes first
    s.put(chunk(3))
    assert [s.contains(f"k{i}") for i in range(4)] == [True, False, True, True]
    s.put(chunk(4))
    assert [s.contains(f"k{i}") for i in range(5)] == [True, False, False, True, True]
    st = s.stats()
    assert st["evictions"] == 2 and st["entries"] == 3 and st["bytes"] == 3 * chunk(0).nbytes()
    assert st["bytes"] <= st["byte_budget"]
    assert s.get("k1", layout()) is None and s.stats()["misses"] == 1
    assert same(chunk(4), s.get("k4", layout()))  # a reused slot holds the new entry, bit for bit


@pytest.mark.parametrize("tier", ["host", "device"])
def test_worker_tiers_evict_a_prompts_tail_first(tier):
    """Room for 8 chunks; prompt A's 6 (chained), a hit on A's first 3, then prompt B's 6: A keeps its first two
    (plain LRU kept two of its middle chunks, unusable without the first); each held chunk of A is in its hit. A
    prompt longer than the room keeps its first chunks and does not keep the rest here (chain_refused)."""
    size = chunk(0).nbytes()
    s = HostStore(slots_budget(8), "cpu") if tier == "host" else DeviceStore(8 * size + size // 2, "cpu")
    a = [chunk(i, parent=f"k{i - 1}" if i else "") for i in range(6)]
    b = [chunk(i, parent=f"k{i - 1}" if i > 100 else "") for i in range(100, 106)]
    for c in a:
        s.put(c)
    for c in a[:3]:
        assert s.get(c.key, layout()) is not None
    for c in b:
        s.put(c)
    held = [s.contains(c.key) for c in a]
    assert held == [True, True, False, False, False, False], held
    assert s.lookup([c.key for c in b]) == 6
    long = HostStore(slots_budget(4), "cpu") if tier == "host" else DeviceStore(4 * size + size // 2, "cpu")
    for i in range(200, 206):
        long.put(chunk(i, parent=f"k{i - 1}" if i > 200 else ""))
    assert long.lookup([f"k{i}" for i in range(200, 206)]) == 4 and long.stats()["chain_refused"] == 2


def test_first_put_wins():
    s = HostStore(slots_budget(4), "cpu")
    first, other = chunk(0), chunk(0)
    other.target_kv = other.target_kv + 1
    assert s.put(first) and not s.put(other)
    assert same(first, s.get("k0", layout()))
    assert s.stats()["duplicate_puts"] == 1 and s.stats()["entries"] == 1


@pytest.mark.parametrize("bad", [layout(fp="fp-b"), layout(tokens=2 * T), layout(dtype="bfloat16"),
                                 ChunkLayout(LAYERS + 1, HEADS, DIM, T, "float32", DRAFT_LAYERS, FP)])
def test_layout_mismatch_is_a_counted_miss(bad):
    s = HostStore(slots_budget(4), "cpu")
    s.put(chunk(0))
    s.put(chunk(1))
    with pytest.raises(LayoutMismatch):
        s.get("k0", bad)
    assert s.get_many(["k0", "k1"], bad) == []
    st = s.stats()
    assert (st["layout_refused"], st["misses"], st["hits"]) == (2, 2, 0)
    assert same(chunk(0), s.get("k0", layout()))  # the entry is left in place for a reader it fits


def test_arena_stops_allocating_once_warm():
    s = HostStore(slots_budget(4), "cpu", slot_bytes=SLOT)
    for i in range(4):
        s.put(chunk(i))
    warm = s.stats()["allocations"]
    assert warm >= 1
    for i in range(4, 40):
        s.put(chunk(i))
        assert s.get_many([f"k{i}"], layout())
    st = s.stats()
    assert st["allocations"] == warm and st["evictions"] == 36 and st["entries"] == 4
    assert st["host_bytes"] <= st["byte_budget"] and st["slots"] == 4


def test_reserve_allocates_the_arena_up_front():
    s = HostStore(slots_budget(5), "cpu", slot_bytes=SLOT)
    assert s.reserve() == 5
    before = s.stats()["allocations"]
    for i in range(12):
        s.put(chunk(i))
    assert s.stats()["allocations"] == before
    with pytest.raises(ValueError):
        HostStore(1 << 20, "cpu").reserve()  # no slot size yet


def test_a_chunk_larger_than_a_slot_goes_to_the_backing_only():
    back = MemoryStore(1 << 20)
    s = HostStore(slots_budget(4), "cpu", backing=back, slot_bytes=layout(draft=False).payload_bytes())
    assert s.put(chunk(0))  # both halves: too large for a target-only slot, kept by the backing
    st = s.stats()
    assert st["oversize_refused"] == 1 and st["entries"] == 0 and back.contains("k0")


def test_backing_serves_what_was_evicted_and_it_is_promoted():
    back = MemoryStore(1 << 20)
    s = HostStore(slots_budget(2), "cpu", backing=back)
    cs = [chunk(i) for i in range(4)]
    for c in cs:
        s.put(c)  # written through; the host tier keeps the last two
    assert [s.contains(c.key) for c in cs] == [True] * 4 and s.lookup([c.key for c in cs]) == 4
    got = s.get_many([c.key for c in cs[2:]] + [cs[0].key], layout())  # host hits, then the backing
    assert len(got) == 3 and all(same(a, b) for a, b in zip(cs[2:] + cs[:1], got))
    st = s.stats()
    assert st["hits"] == 2 and st["hits_backing"] == 1
    assert s.get("k0", layout()) is not None and s.stats()["hits"] == 3  # promoted


def test_behind_a_device_store():
    s = HostStore(slots_budget(4), "cpu")
    front = DeviceStore(2 * chunk(0).nbytes(), "cpu", backing=s)
    cs = [chunk(i) for i in range(4)]
    for c in cs:
        front.put(c)
    got = front.get_many([c.key for c in cs], layout())  # k0 is not on the device: the run comes from the host
    assert len(got) == 4 and all(same(a, b) for a, b in zip(cs, got))
    assert front.stats()["hits_backing"] == 4 and s.stats()["hits"] == 4
    for i in range(4, 12):  # the host tier reuses its slots; what the device tier promoted is its own copy
        s.put(chunk(i))
    assert all(same(c, front.get(c.key, layout())) for c in cs[2:])


def spec_gen(target, drafter) -> DFlashGenerator:
    return DFlashGenerator(ModelRunner(target, 1024, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)


def test_prefix_hit_through_the_host_tier_equals_a_cold_run(dflash_pair):  # noqa: F811
    from flashpd.engine.drafter import load_drafter
    from flashpd.engine.loader import load_target
    from flashpd.engine.sampling import SamplingParams
    from flashpd.kv_bridge.keys import MethodFingerprint, weights_identity

    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    fp = MethodFingerprint(weights_identity(dflash_pair.target_dir), weights_identity(dflash_pair.draft_dir),
                           tuple(drafter.cfg.target_layer_ids), "float32").digest()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in (300, 333, 390, 420)]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(prompts)
    chunk_tokens = 64
    gen = spec_gen(target, drafter)
    lay = ChunkLayout.of_caches(gen.runner.cache.data, gen.drafts.cache.data, chunk_tokens, fp)
    store = HostStore(64 << 20, "cpu", slot_bytes=lay.payload_bytes())
    cold = generate(gen, prompts, params, prefix_cache=PrefixCache(store, fp, chunk_tokens))
    assert store.stats()["entries"] == sum(len(p) // chunk_tokens for p in prompts)
    pc = PrefixCache(store, fp, chunk_tokens)
    hit = generate(spec_gen(target, drafter), prompts, params, prefix_cache=pc)
    assert pc.stats.per_request_hits == [((len(p) - 1) // chunk_tokens) * chunk_tokens for p in prompts]
    assert pc.stats.refused_chunks == 0
    for a, b in zip(cold, hit):
        assert a.output == b.output
        assert a.stats.acceptance_lengths == b.stats.acceptance_lengths
    assert max(max(a.stats.acceptance_lengths) for a in cold) > 1  # the drafter accepts: parity means something
    assert store.stats()["hits"] == sum((len(p) - 1) // chunk_tokens for p in prompts)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned, asynchronous path needs CUDA")


def big_chunk(i: int, device: str = "cuda") -> KVChunk:
    """A chunk whose copies take long enough for an ordering mistake to show (bf16, a few MB)."""
    g = torch.Generator(device=device).manual_seed(i)
    tk = torch.randn(8, 2, 256, 4, 128, generator=g, device=device).to(torch.bfloat16)
    dk = torch.randn(2, 2, 256, 4, 128, generator=g, device=device).to(torch.bfloat16)
    return KVChunk(f"b{i}", "", FP, list(range(256)), tk, dk)


BIG = ChunkLayout(8, 4, 128, 256, "bfloat16", 2, FP)


@CUDA
def test_cuda_puts_and_hits_are_asynchronous_exact_and_ordered():
    s = HostStore(32 << 20, "cuda", slot_bytes=BIG.payload_bytes())
    n = s.reserve()  # one pinned segment of the whole budget (a power of two): its slots
    st = s.stats()
    assert st["pinned"] and st["allocations"] == 1 and st["host_bytes"] == 32 << 20 and n == st["slots"] >= 2
    cs = [big_chunk(i) for i in range(n)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a put or a hit that syncs the host raises here
    try:
        torch.cuda._sleep(400_000_000)  # the producer's stream is busy: the puts' copies are still queued
        for c in cs:
            assert s.put(c)
        got = s.get_many([c.key for c in cs], BIG)  # must wait for them on the GPU, not read torn slots
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert s.stats()["waits"] >= 1 and all(g.target_kv.is_cuda for g in got)
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(cs, got))
    # a slot is never rewritten under a read still queued on another stream
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):
        torch.cuda._sleep(400_000_000)
        late = s.get_many([c.key for c in cs], BIG)
    fresh = [big_chunk(i) for i in range(n, 2 * n)]
    for c in fresh:  # evicts them all: their slots are reused
        s.put(c)
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(cs, late))
    assert all(same(a, s.get(a.key, BIG)) for a in fresh)
    host = big_chunk(2 * n, "cpu")  # a promotion's chunk comes from the host: copied in place, read back on the GPU
    s.put(host)
    back = s.get(host.key, BIG)
    assert back.target_kv.is_cuda and same(host, KVChunk(back.key, back.parent, back.fingerprint, back.token_ids,
                                                         back.target_kv.cpu(), back.draft_kv.cpu()))
    assert s.stats()["allocations"] == 1 and s.stats()["evictions"] == n + 1


@CUDA
def test_a_cuda_chunk_serialises_through_page_locked_memory_to_the_cpu_chunks_bytes():
    c, new = big_chunk(7), big_chunk(8)
    torch.cuda.synchronize()
    want = KVChunk(c.key, c.parent, c.fingerprint, c.token_ids, new.target_kv.cpu(), new.draft_kv.cpu())
    mac = process_secret().mac_key
    # the chunk's values change on the GPU behind a long kernel: a serialisation that did not wait for its stream
    # would copy the old values, or a mix
    torch.cuda._sleep(400_000_000)
    c.target_kv.copy_(new.target_kv)
    c.draft_kv.copy_(new.draft_kv)
    parts = c.to_parts(mac)
    assert b"".join(parts) == want.to_bytes(mac)
    body = c.body_parts()
    assert all(isinstance(p, memoryview) for p in body[2:])
    assert torch.frombuffer(body[2], dtype=torch.uint8).is_pinned()  # the tensors' bytes are page-locked


@pytest.mark.parametrize("tier", ["host", "device"])
def test_a_worker_tier_hands_a_prompts_chunks_to_its_backing_in_one_call(tier):
    """put_many keeps each chunk here and passes them on in one call where the backing takes one (a bridge: one
    streamed Put, store.put_all); a backing without put_many gets one put a chunk."""
    class Recorder:
        def __init__(self, many: bool) -> None:
            self.calls: list[int] = []
            if many:
                self.put_many = lambda cs: (self.calls.append(len(cs)), len(cs))[1]

        def put(self, c: KVChunk) -> bool:
            self.calls.append(1)
            return True

    cs = [chunk(i) for i in range(3)]
    make = lambda back: (HostStore(slots_budget(8), "cpu", backing=back) if tier == "host"  # noqa: E731
                         else DeviceStore(1 << 24, "cpu", backing=back))
    for many in (True, False):
        back = Recorder(many)
        s = make(back)
        assert s.put_many(cs) == 3
        assert back.calls == ([3] if many else [1, 1, 1])
        assert [s.get(c.key).key for c in cs] == [c.key for c in cs]  # kept here too
    # a chunk that fails to be kept here still leaves them all to the backing store, then the error is raised
    back = Recorder(True)
    s = make(back)
    real_keep = s._keep
    s._keep = lambda c: (_ for _ in ()).throw(RuntimeError("out of memory")) if c.key == "k1" else real_keep(c)
    with pytest.raises(RuntimeError, match="out of memory"):
        s.put_many(cs)
    assert back.calls == [3]
