"""Integrity of the prefix cache's store and restore path: what the method fingerprint covers, how the
LMCache backend refuses what it cannot hold, how a failed import is counted, and that a chain with a
hole or a corrupt middle entry restores only its intact prefix (tokens and acceptance as a cold run).

Real stores (MemoryStore, LMCacheStore on LMCache 0.5.3, a gRPC bridge), real checkpoint files, the tiny
float32 models of conftest.py and the trained DFlash fixture pair; outputs compared token for token
against uncached runs."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashpd.decode_node.bridge_import import GuardedPrefixCache
from flashpd.engine.drafter import load_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge import keys as keys_mod
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
from flashpd.kv_bridge.keys import MethodFingerprint, chunk_keys, weights_identity
from flashpd.kv_bridge.lmcache_layout import PackedLayout
from flashpd.kv_bridge.lmcache_store import LMCacheStore
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests._kv_bridge_helpers import CHUNK_TOKENS, DRAFT_LAYERS, HEAD_DIM, KV_HEADS, TARGET_LAYERS, make_chunk
from tests.conftest import build_hf_model, new_runner, random_prompts, save_sharded_checkpoint


# ---- (b) the fingerprint: a weights identity covers exactly the files the loader reads ----------------------------
def _checkpoint_with_shards_in_a_subfolder(model, directory: Path) -> Path:
    """A sharded HF checkpoint whose index names its shards under shards/ (the loader reads what the index names)."""
    shards = save_sharded_checkpoint(model, directory, "40KB")
    (directory / "shards").mkdir()
    for s in shards:
        shutil.move(str(s), str(directory / "shards" / s.name))
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return directory


def test_two_checkpoints_whose_index_names_subfolder_shards_never_share_entries(tmp_path):
    """Two different checkpoints (same config, other weights) whose index names shards in a subfolder: the loader
    reads those shards, so the identity must hash them. Else both get one fingerprint and B restores A's K/V as
    its own: other tokens than B computes. Checked end to end on a real MemoryStore against B's uncached run."""
    a = _checkpoint_with_shards_in_a_subfolder(build_hf_model(seed=0), tmp_path / "a")
    b = _checkpoint_with_shards_in_a_subfolder(build_hf_model(seed=1), tmp_path / "b")
    fp = {d: MethodFingerprint(weights_identity(d), "none", (), "float32").digest() for d in (a, b)}
    prompts = random_prompts([100, 90], 256, seed=3)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    store = MemoryStore(1 << 24)
    generate(NativeGenerator(new_runner(a)), prompts, params, prefix_cache=PrefixCache(store, fp[a], 32))
    assert store.stats()["entries"] == sum(len(p) // 32 for p in prompts)
    cold_b = generate(NativeGenerator(new_runner(b)), prompts, params)
    pc = PrefixCache(store, fp[b], 32)
    hit_b = generate(NativeGenerator(new_runner(b)), prompts, params, prefix_cache=pc)
    assert [s.output for s in hit_b] == [s.output for s in cold_b]
    assert pc.stats.hit_tokens == 0 and fp[a] != fp[b]


def test_identity_of_a_weight_file_rewritten_in_place_with_its_size_and_mtime_is_hashed_again(tmp_path):
    """A weight file rewritten in place (same inode) with its size and mtime kept (cp -p, tar -x and rsync -t keep
    mtimes) holds other bytes: the per-process identity cache must not hand back the old identity."""
    (tmp_path / "config.json").write_text('{"x": 1}')
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4096)}, str(path))
    before = weights_identity(tmp_path)
    st = os.stat(path)
    time.sleep(0.05)  # past the file system's timestamp granularity: the rewrite's ctime is another one
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(path)
    assert (st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert weights_identity(tmp_path) != before


def test_the_identity_cache_keeps_one_entry_per_directory(tmp_path):
    """(f) A checkpoint directory changed N times (a training run writing into it) costs one cached identity,
    not N: the stale ones can never be asked for again."""
    (tmp_path / "config.json").write_text('{"x": 1}')
    path = tmp_path / "model.safetensors"
    n0 = len(keys_mod._IDENTITIES)
    seen = set()
    for i in range(5):
        save_file({"w": torch.full((256,), float(i))}, str(path))
        os.utime(path, ns=(i * 10**9, (i + 1) * 10**9))  # a distinct stamp each time, whatever the clock does
        seen.add(weights_identity(tmp_path))
    assert len(seen) == 5
    assert len(keys_mod._IDENTITIES) - n0 <= 1


def _touch_weights(d: Path) -> None:
    """Rewrite model.safetensors with its own bytes: a new ctime, the same content (a copy of the same checkpoint)."""
    time.sleep(0.05)  # past the file system's timestamp granularity
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes())


def test_a_checkpoint_changed_after_the_load_has_no_identity_for_this_process(make_checkpoint, tmp_path):
    """The identity is hashed lazily (when a cache needs it), so a checkpoint updated in place after a worker loaded
    it would otherwise be hashed as the new files: the worker's KV, made by the old weights, keyed to the new ones,
    and restored by every worker that loads them. Hashed against the stamps the load recorded, it is refused."""
    from flashpd.engine.config import CheckpointError
    from flashpd.engine.factory import load_engine

    _, src = make_checkpoint()
    d = Path(shutil.copytree(src, tmp_path / "ckpt"))
    parts = load_engine(d, device="cpu", kv_cache_tokens=256)
    assert parts.target_stamps and parts.draft_stamps == ()
    assert weights_identity(d, loaded=parts.target_stamps) == weights_identity(d)  # unchanged: the same identity
    _touch_weights(d)
    with pytest.raises(CheckpointError, match="changed after this process loaded them"):
        weights_identity(d, loaded=parts.target_stamps)
    weights_identity(d)  # a process that loads the files now may hash them


def test_a_checkpoint_changed_during_the_load_is_refused(make_checkpoint, tmp_path, monkeypatch):
    """Files rewritten while their tensors are read may give a model of two versions: the load fails, named."""
    from flashpd.engine import factory
    from flashpd.engine.config import CheckpointError

    _, src = make_checkpoint()
    d = Path(shutil.copytree(src, tmp_path / "ckpt"))
    real = factory.load_target

    def load_then_rewrite(*a, **k):
        model = real(*a, **k)
        _touch_weights(d)
        return model

    monkeypatch.setattr(factory, "load_target", load_then_rewrite)
    with pytest.raises(CheckpointError, match="changed while it was loaded"):
        factory.load_engine(d, device="cpu", kv_cache_tokens=256)


def test_a_checkpoint_changed_while_it_is_hashed_has_no_identity(make_checkpoint, tmp_path, monkeypatch):
    """The stamps are read again after the hash: bytes of two versions never make an identity."""
    from flashpd.engine import loader
    from flashpd.engine.config import CheckpointError

    _, src = make_checkpoint()
    d = Path(shutil.copytree(src, tmp_path / "ckpt"))
    real, calls = loader.checkpoint_stamps, []

    def stamps_then_rewrite(model_dir):
        calls.append(model_dir)
        out = real(model_dir)
        if len(calls) == 1:  # after the first stat, before the hash's bytes are read
            _touch_weights(d)
        return out

    monkeypatch.setattr(loader, "checkpoint_stamps", stamps_then_rewrite)
    with pytest.raises(CheckpointError, match="changed while they were hashed"):
        weights_identity(d)
    assert len(calls) == 2
    monkeypatch.setattr(loader, "checkpoint_stamps", real)
    assert weights_identity(d) == weights_identity(src)  # the same bytes: the same identity once it is still


def test_the_paged_block_size_is_not_part_of_an_entry(make_checkpoint):
    """Why kv_block_size is not in the fingerprint: an entry holds K/V by prompt position (read and written through
    each side's own block table), so a worker with 8-token blocks restores what one with 16-token blocks published,
    and gives the tokens its own uncached run gives."""
    _, d = make_checkpoint()
    fp = MethodFingerprint(weights_identity(d), "none", (), "float32").digest()
    prompts = random_prompts([100, 75], 256, seed=6)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    store = MemoryStore(1 << 24)
    generate(NativeGenerator(new_runner(d, kv_block_size=16)), prompts, params, prefix_cache=PrefixCache(store, fp, 32))
    cold = generate(NativeGenerator(new_runner(d, num_blocks=512, kv_block_size=8)), prompts, params)
    pc = PrefixCache(store, fp, 32)
    hit = generate(NativeGenerator(new_runner(d, num_blocks=512, kv_block_size=8)), prompts, params, prefix_cache=pc)
    assert pc.stats.per_request_hits == [96, 64]
    assert [s.output for s in hit] == [s.output for s in cold]


# ---- (c) LMCache backend: what cannot be packed is refused (counted), never an exception -------------------------
def _layout() -> PackedLayout:
    return PackedLayout(TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS, torch.bfloat16)


def test_lmcache_put_whose_metadata_does_not_fit_the_header_row_is_refused_and_counted():
    """A chunk whose header (key, parent, fingerprint, token ids) exceeds the object's header row is refused by
    put (False, layout_refused), before LMCache allocates anything; the store stays usable."""
    with LMCacheStore(_layout(), 1 << 22) as s:
        too_long = make_chunk("k" * 2000, seed=1)
        assert s.put(too_long) is False
        st = s.stats()
        assert (st["layout_refused"], st["entries"], st["puts"]) == (1, 0, 0)
        good = make_chunk("good", seed=2)
        assert s.put(good) and s.get("good") is not None


def test_lmcache_layout_whose_header_row_cannot_hold_a_chunks_metadata_is_refused():
    """A geometry whose header row cannot hold the metadata of a full chunk (64-character keys and fingerprint,
    chunk_tokens token ids of up to 10 digits) is refused when the store is made, not at each put."""
    with pytest.raises(ValueError, match="header row"):
        PackedLayout(1, 1, 1, 1, 128, torch.float32)  # a 1024-byte header row for 128 token ids
    PackedLayout(1, 1, 1, 8, 128, torch.float32)  # 8192 bytes: enough


def test_lmcache_layout_of_a_drafter_whose_heads_split_its_width_otherwise_is_refused():
    """The same K/V width split into other heads (8 x 16 against 4 x 32) cannot share the target's object rows: the
    store is refused when made, not found refusing every put later."""
    from types import SimpleNamespace  # noqa: PLC0415

    target = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=32, kv_size=128)
    draft = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=8, head_dim=16, kv_size=128)
    with pytest.raises(ValueError, match="heads"):
        PackedLayout.of_models(target, draft, 128, torch.float32)
    same = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=4, head_dim=32, kv_size=128)
    assert PackedLayout.of_models(target, same, 128, torch.float32).draft_layers == 1


# ---- (d) a failed import: counted as a recomputed prompt, blocks all back, tokens exact -------------------------
def test_a_failed_bridge_import_is_counted_as_a_miss_and_recomputes_exactly(make_checkpoint):
    """The restore path (generate, a prefill worker) over a bridge that went away: every prompt is recomputed
    locally with the tokens an uncached run gives, every block comes back, and each failed import counts as a
    request whose prompt was a miss (prompt_tokens is what the miss metric is computed from)."""
    _, d = make_checkpoint()
    prompts = random_prompts([70, 100, 45], 256, seed=4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    fp = MethodFingerprint("t", "none", (), "float32").digest()
    server, port = serve(MemoryStore(1 << 24))
    client = BridgeClient(f"127.0.0.1:{port}", timeout_s=2)
    try:
        server.stop(grace=None).wait(10)  # gone before the first import
        gen = NativeGenerator(new_runner(d))
        free = gen.runner.allocator.num_free
        cache = GuardedPrefixCache(PrefixCache(RemoteStore(client), fp, 32))
        got = generate(gen, prompts, params, prefix_cache=cache)
        cold = generate(NativeGenerator(new_runner(d)), prompts, params)
        assert [s.output for s in got] == [s.output for s in cold]
        assert gen.runner.allocator.num_free == free
        assert sum(cache.import_failures.values()) == len(prompts)
        st = cache.stats
        assert (st.requests, st.prompt_tokens, st.hit_tokens) == (len(prompts), sum(map(len, prompts)), 0)
        assert st.per_request_hits == [0] * len(prompts)
    finally:
        client.close()


# ---- (c) + (e) on the LMCache backend, end to end with the DFlash pair ------------------------------------------
CHUNK = 64
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    fp = MethodFingerprint("target-fixture", "drafter-fixture", tuple(drafter.cfg.target_layer_ids), "float32").digest()
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, 126, (n,), generator=g).tolist() for n in (300, 330, 290)]
    return target, drafter, fp, prompts


def _spec(target, drafter) -> DFlashGenerator:
    return DFlashGenerator(ModelRunner(target, 1024, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)


@pytest.mark.parametrize("damage", ["evicted", "corrupt"])
def test_lmcache_chain_with_a_damaged_middle_chunk_restores_only_its_prefix(pair, damage):
    """A chain in LMCache whose middle chunk is evicted (removed from LMCache's backend) or whose object rots (one
    bit of its draft rows): the restore stops before it (the later chunks, still held, are never used), the corrupt
    object is dropped and counted, and tokens and acceptance lengths equal a cold run's."""
    target, drafter, fp, prompts = pair
    layout = PackedLayout.of_models(target.cfg, drafter.cfg, CHUNK, torch.float32)
    params = [PARAMS] * len(prompts)
    with LMCacheStore(layout, 64 << 20) as store:
        cold = generate(_spec(target, drafter), prompts, params, prefix_cache=PrefixCache(store, fp, CHUNK))
        held = [chunk_keys(p, CHUNK, fp) for p in prompts]
        assert all(store.lookup(k) == len(k) for k in held)
        k0 = held[0]
        if damage == "evicted":
            store.engine.storage_manager.remove(store._key(k0[2]))
        else:
            first_draft_row = target.cfg.num_hidden_layers  # the object's rows: target layers, drafter layers, header
            store.object_tensor(k0[2])[0, first_draft_row].view(torch.uint8).view(-1)[5] ^= 0x08
        assert len(k0) == 4 and store.contains(k0[3])  # the chunk past the hole is still there
        pc = PrefixCache(store, fp, CHUNK)
        hit = generate(_spec(target, drafter), prompts, params, prefix_cache=pc)
        want = [2 * CHUNK] + [((len(p) - 1) // CHUNK) * CHUNK for p in prompts[1:]]
        assert pc.stats.per_request_hits == want
        for a, b in zip(cold, hit):
            assert a.output == b.output and a.stats.acceptance_lengths == b.stats.acceptance_lengths
        assert max(max(a.stats.acceptance_lengths) for a in cold) > 1
        st = store.stats()
        assert st["corrupt_dropped"] == (1 if damage == "corrupt" else 0)
        assert st["layout_refused"] == 0
