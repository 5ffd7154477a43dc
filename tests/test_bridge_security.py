"""The KV bridge as a trust boundary (real gRPC server on 127.0.0.1, real files on disk, the trained
fixture pair on the CPU in float32):

- every call needs the cluster's token (UNAUTHENTICATED otherwise, nothing stored);
- a client without the cluster secret cannot plant K/V: a later request's tokens AND acceptance
  lengths equal a cold run;
- malformed, lying, truncated or foreign-MAC chunks are refused at Put, and authentic chunks of the
  wrong layout are counted misses at restore, with output equal to cold (never an exception);
- a Put announcing more than the largest valid chunk is refused on its first frame;
- a disk file with a bad MAC is a miss; TLS round trip; undecodable requests are INVALID_ARGUMENT;
- the secret never shows in repr, str, pickles or error text.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import pickle
import threading
import time

import grpc
import pytest
import torch

from flashpd.cluster.config import ServeConfig
from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge import frame_codec
from flashpd.kv_bridge.auth import ENV_VAR, ClusterSecret
from flashpd.kv_bridge.chunk import FORMAT_VERSION, MAGIC, PREFIX, KVChunk, LayoutMismatch, max_chunk_bytes
from flashpd.kv_bridge.client import BridgeClient, BridgeUnauthenticated, BridgeUnavailable, RemoteStore
from flashpd.kv_bridge.disk import DiskStore
from flashpd.kv_bridge.keys import MethodFingerprint, chunk_keys
from flashpd.kv_bridge.layout import ChunkLayout
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.proto_gen import kv_bridge_pb2 as pb
from flashpd.kv_bridge.server import serve
from flashpd.kv_bridge.store import MemoryStore
from flashpd.kv_bridge.tls import BridgeTls
from flashpd.kv_bridge.wire import PROTOCOL_VERSION, Assembler, FrameError, split_frames
from flashpd.engine.scheduler import generate

from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests._kv_bridge_helpers import BridgeHarness, disk_listing

CHUNK = 64
FRAME = 4096
TIMEOUT_S = 10.0
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
N_PROMPTS = 24


# ---- the model side: a DFlash request through a PrefixCache, compared with a cold run ------------

@pytest.fixture(scope="module")
def setup(dflash_pair):  # noqa: F811
    target = load_target(dflash_pair.target_dir)
    drafter = load_drafter(dflash_pair.draft_dir, target)
    fp = MethodFingerprint("fixture-target", "fixture-drafter", tuple(drafter.cfg.target_layer_ids),
                           "float32").digest()
    g = torch.Generator().manual_seed(1919)
    prompts = [torch.randint(0, 126, (int(n),), generator=g).tolist()
               for n in torch.randint(140, 200, (N_PROMPTS,), generator=g)]
    cold = generate(gen_for(target, drafter), prompts, [PARAMS] * N_PROMPTS)
    layout = ChunkLayout.of_caches(*caches(gen_for(target, drafter)), CHUNK, fp)
    return dict(target=target, drafter=drafter, fp=fp, prompts=prompts, cold=cold, layout=layout)


def gen_for(target, drafter) -> DFlashGenerator:
    return DFlashGenerator(ModelRunner(target, 512, 16, taps=tuple(drafter.cfg.target_layer_ids)), drafter, (), 16)


def caches(gen: DFlashGenerator) -> tuple[torch.Tensor, torch.Tensor]:
    return gen.runner.cache.data, gen.drafts.cache.data


def run_and_compare(setup, store, idx: list[int]) -> PrefixCache:
    """Requests for prompts[idx] through a PrefixCache on `store`: tokens and acceptance equal cold."""
    pc = PrefixCache(store, setup["fp"], CHUNK)
    seqs = generate(gen_for(setup["target"], setup["drafter"]), [setup["prompts"][i] for i in idx],
                                                               [PARAMS] * len(idx), prefix_cache=pc)
    for i, s in zip(idx, seqs):
        cold = setup["cold"][i]
        assert s.output == cold.output, f"prompt {i}: tokens differ from the cold run"
        assert s.stats.acceptance_lengths == cold.stats.acceptance_lengths, f"prompt {i}: acceptance differs"
    assert max(max(setup["cold"][i].stats.acceptance_lengths) for i in idx) > 1  # the drafter's state matters
    return pc


def forged(setup, i: int, secret_fp: str | None = None, seed: int = 0) -> list[KVChunk]:
    """Chunks for prompt i with the right keys, token ids and shapes, and random K/V."""
    p, lay = setup["prompts"][i], setup["layout"]
    keys = chunk_keys(p, CHUNK, setup["fp"])
    g = torch.Generator().manual_seed(seed)
    return [KVChunk(k, keys[j - 1] if j else "", secret_fp or setup["fp"], p[j * CHUNK:(j + 1) * CHUNK],
                    torch.randn(lay.target_shape, generator=g), torch.randn(lay.draft_shape, generator=g))
            for j, k in enumerate(keys)]


# ---- the bridge side ------------------------------------------------------------------------------

def Bridge(store=None, secret: ClusterSecret | None = None, **kw) -> BridgeHarness:  # noqa: N802
    return BridgeHarness(store, secret, timeout_s=TIMEOUT_S, frame_bytes=FRAME, **kw)


@pytest.fixture
def bridge():
    b = Bridge()
    yield b
    b.stop()


def put_frames(key: str, data: bytes) -> list[pb.PutFrame]:
    return [pb.PutFrame(version=PROTOCOL_VERSION, frame=f) for f in split_frames(key, data, FRAME)]


def seal(header: dict, payload: bytes, secret: ClusterSecret) -> bytes:
    """A chunk written by hand (format 2: prefix, JSON header, payload, keyed BLAKE3 MAC): any header."""
    hb = json.dumps(header).encode()
    body = PREFIX.pack(MAGIC, FORMAT_VERSION, len(hb)) + hb + payload
    return body + secret.mac_key.tag([body])


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


# ---- authentication -------------------------------------------------------------------------------

def test_calls_without_the_token_or_with_a_wrong_one_are_unauthenticated(bridge):
    data = KVChunk("k", "", "fp", list(range(4)), torch.zeros(1, 2, 4, 1, 2), None).to_bytes(bridge.secret.mac_key)
    other = ClusterSecret.generate()
    # the workers' token (a subkey of the same secret, sent on every router and decode-worker call) opens no bridge
    for md in (None, bridge.md("0" * 64), bridge.md(other.token), bridge.md(""), bridge.md(bridge.secret.worker_token)):
        calls = [
            lambda: bridge.raw.Lookup(pb.LookupRequest(version=PROTOCOL_VERSION, keys=["k"]), timeout=TIMEOUT_S,
                                      metadata=md),
            lambda: list(bridge.raw.Get(pb.GetRequest(version=PROTOCOL_VERSION, keys=["k"]), timeout=TIMEOUT_S,
                                        metadata=md)),
            lambda: bridge.raw.Put(iter(put_frames("k", data)), timeout=TIMEOUT_S, metadata=md),
            lambda: bridge.raw.Stats(pb.StatsRequest(version=PROTOCOL_VERSION), timeout=TIMEOUT_S, metadata=md),
            lambda: bridge.raw.Health(pb.HealthRequest(version=PROTOCOL_VERSION), timeout=TIMEOUT_S, metadata=md),
        ]
        assert [code_of(c) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * len(calls)
    with BridgeClient(bridge.address, TIMEOUT_S, FRAME, secret=other) as stranger:
        for call in (lambda: stranger.put_bytes([("k", data)]), lambda: stranger.lookup(["k"]),
                     lambda: stranger.get(["k"]), stranger.health):
            with pytest.raises(BridgeUnauthenticated) as e:
                call()
            assert other.token not in str(e.value) and bridge.secret.token not in str(e.value)
    st = bridge.store.stats()
    assert st["entries"] == st["puts"] == st["corrupt_refused"] == 0  # nothing reached the store
    counters = bridge.client.stats()
    assert counters["server.unauthenticated_calls"] == 5 * 5 + 4
    assert counters["server.frames_received"] == 0 and counters["server.puts_streams"] == 0
    assert bridge.client.put_bytes([("k", data)]).stored == 1  # the cluster's own client is served


def test_undecodable_request_bytes_are_invalid_argument(bridge):
    lookup = bridge.channel.unary_unary("/flashpd.kvbridge.v1.KVBridge/Lookup")  # raw bytes in and out
    put = bridge.channel.stream_unary("/flashpd.kvbridge.v1.KVBridge/Put")
    get = bridge.channel.unary_stream("/flashpd.kvbridge.v1.KVBridge/Get")
    garbage = [b"\xff\xff\xff\xff", b"\x12\x05ab", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
    for g in garbage:
        assert code_of(lambda: lookup(g, timeout=TIMEOUT_S, metadata=bridge.md())) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: put(iter([g]), timeout=TIMEOUT_S, metadata=bridge.md())) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: list(get(g, timeout=TIMEOUT_S, metadata=bridge.md()))) == \
            grpc.StatusCode.INVALID_ARGUMENT
        # the token is checked first: a stranger learns nothing about what parses
        assert code_of(lambda: lookup(g, timeout=TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
    assert bridge.client.health()["serving"] and bridge.store.stats()["entries"] == 0


def test_a_put_message_of_countless_fields_is_refused_at_once(bridge):
    """A token holder's PutFrame of 4 MiB of 2-byte empty fields: the codec walked every field in Python (about
    1 s of CPU per 4 MiB, 7-8 s for a 32 MiB message, with every other client stalled) before any check. More than
    frame_codec.MAX_FIELDS fields, at any level, is refused at once; the work is counted, not timed."""
    put = bridge.channel.stream_unary("/flashpd.kvbridge.v1.KVBridge/Put")
    top = b"\x08\x01" * (2 << 20)  # version, again and again
    inner = b"\x28\x00" * (2 << 20)  # the frame's `last`, again and again
    nested = b"\x12" + frame_codec._varint(len(inner)) + inner
    seen = []
    real = frame_codec._read_varint

    def counting(b, pos, end):
        seen.append(pos)
        return real(b, pos, end)

    for msg in (top, nested):
        seen.clear()
        frame_codec._read_varint = counting
        try:
            with pytest.raises(frame_codec.DecodeError, match="more than 64 fields"):
                frame_codec.decode_put_frame(msg)
        finally:
            frame_codec._read_varint = real
        assert len(seen) < 300, len(seen)  # every field's tag and value read: 4 million
        assert code_of(lambda: put(iter([msg]), timeout=TIMEOUT_S, metadata=bridge.md())) == \
            grpc.StatusCode.INVALID_ARGUMENT
    assert bridge.client.health()["serving"] and bridge.store.stats()["entries"] == 0


# ---- poisoning ------------------------------------------------------------------------------------

def test_a_client_without_the_secret_cannot_plant_kv(setup, bridge):
    i = 0
    attacker = ClusterSecret.generate()
    chunks = forged(setup, i, seed=5)
    assert len(chunks) >= 2
    # (a) its own secret: its token is refused
    with BridgeClient(bridge.address, TIMEOUT_S, FRAME, secret=attacker) as stranger:
        with pytest.raises(BridgeUnauthenticated):
            stranger.put(chunks)
    # (b) the right token (leaked), but chunks sealed with its own MAC key: every chunk refused
    frames = [f for c in chunks for f in put_frames(c.key, c.to_bytes(attacker.mac_key))]
    reply = bridge.raw.Put(iter(frames), timeout=TIMEOUT_S, metadata=bridge.md())
    assert (reply.stored, list(reply.refused_keys)) == (0, [c.key for c in chunks])
    assert bridge.store.stats()["entries"] == 0
    assert bridge.client.stats()["server.chunks_refused_corrupt"] == len(chunks)
    # the real request is a miss and equals cold; it publishes the genuine chunks ...
    pc = run_and_compare(setup, RemoteStore(bridge.client), [i])
    assert pc.stats.hit_tokens == 0 and pc.stats.refused_chunks == 0
    assert bridge.store.stats()["entries"] == len(setup["prompts"][i]) // CHUNK
    # ... which the next request restores (tokens and acceptance still equal cold)
    pc = run_and_compare(setup, RemoteStore(bridge.client, transport="shm"), [i])
    assert pc.stats.hit_tokens == ((len(setup["prompts"][i]) - 1) // CHUNK) * CHUNK


# ---- malformed and lying chunks --------------------------------------------------------------------

def _cases(setup, secret: ClusterSecret) -> list[tuple[str, str, int, str, bytes]]:
    """(name, where it must be stopped: "put" | "restore", prompt index, key, bytes filed under key)."""
    lay, fp = setup["layout"], setup["fp"]
    out = []

    def header(i: int, **over) -> tuple[str, dict]:
        p = setup["prompts"][i]
        key = chunk_keys(p, CHUNK, fp)[0]
        h = {"key": key, "parent": "", "fingerprint": fp, "token_ids": p[:CHUNK], "dtype": "float32",
             "target_shape": lay.target_shape, "draft_shape": lay.draft_shape}
        h.update(over)
        return key, h

    def payload(shapes, item: int = 4) -> bytes:
        n = sum(torch.Size(s).numel() for s in shapes if s is not None) * item
        return torch.randn(n // 4 + 1).numpy().tobytes()[:n]

    full = payload([lay.target_shape, lay.draft_shape])
    t, d = lay.target_shape, lay.draft_shape

    def add(name: str, where: str, i: int, key: str, data: bytes) -> None:
        out.append((name, where, i, key, data))

    i = 1
    for name, dim in (("list dim", [t[0]]), ("string dim", str(t[0])), ("negative dim", -1), ("float dim", float(t[0])),
                      ("bool dim", True), ("null dim", None)):
        key, h = header(i, target_shape=[dim, *t[1:]])
        add(name, "put", i, key, seal(h, full, secret))
        i += 1
    key, h = header(i)
    del h["target_shape"]
    add("missing target_shape", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, target_shape=t[:4])
    add("4 dims", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, dtype="int8")
    add("unknown dtype", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, extra="x")
    add("extra header field", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, token_ids=[str(x) for x in setup["prompts"][i][:CHUNK]])
    add("token ids not ints", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, key=chunk_keys(setup["prompts"][0], CHUNK, fp)[0])
    add("another key in the header", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, target_shape=[t[0] + 1, *t[1:]])
    add("shape that lies about the length", "put", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i)
    add("truncated", "put", i, key, seal(h, full, secret)[:-100])
    i += 1
    key, h = header(i, target_shape=[0, 2, t[2], 1 << 62, 1 << 62])  # no bytes, but no tensor can take its strides
    add("dimension past 2**31", "put", i, key, seal(h, payload([d]), secret))
    i += 1
    key, h = header(i)
    add("zeroed K/V under another key", "put", i, key, seal(h, bytes(len(full)), ClusterSecret.generate()))
    i += 1
    # authentic (the cluster's MAC: a buggy peer), well-formed, but not what this reader holds
    key, h = header(i, dtype="bfloat16")
    add("other dtype", "restore", i, key, seal(h, payload([t, d], 2), secret))
    i += 1
    n = CHUNK - 1
    key, h = header(i, token_ids=setup["prompts"][i][:n], target_shape=[t[0], 2, n, *t[3:]],
                    draft_shape=[d[0], 2, n, *d[3:]])
    add("wrong token count", "restore", i, key, seal(h, payload([h["target_shape"], h["draft_shape"]]), secret))
    i += 1
    key, h = header(i, fingerprint=MethodFingerprint("other", "d", (1,), "float32").digest())
    add("wrong fingerprint", "restore", i, key, seal(h, full, secret))
    i += 1
    key, h = header(i, target_shape=[t[0] + 1, *t[1:]])
    add("other geometry", "restore", i, key, seal(h, payload([h["target_shape"], d]), secret))
    i += 1
    key, h = header(i, draft_shape=None)
    add("no drafter half", "restore", i, key, seal(h, payload([t]), secret))
    i += 1
    assert i <= N_PROMPTS
    return out


def test_malformed_lying_or_foreign_chunks_are_refused_or_missed(setup, bridge):
    cases = _cases(setup, bridge.secret)
    for name, where, i, key, data in cases:
        s = bridge.client.put_bytes([(key, data)])
        assert s.refused_keys == ([key] if where == "put" else []), name
        assert s.stored == (where == "restore"), name
    # every case's prompt in one batch: each is a miss (hit 0), restore-time cases counted, tokens equal cold
    idx = [i for _, _, i, _, _ in cases]
    pc = run_and_compare(setup, RemoteStore(bridge.client), idx)
    assert pc.stats.per_request_hits == [0] * len(idx)
    assert pc.stats.refused_chunks == sum(where == "restore" for _, where, *_ in cases)
    st = bridge.client.stats()
    assert st["server.chunks_refused_corrupt"] == sum(where == "put" for _, where, *_ in cases)
    assert bridge.client.health()["serving"]


def test_layout_mismatch_in_a_store_is_a_counted_miss_that_keeps_the_entry(setup):
    secret = ClusterSecret.generate()
    store = MemoryStore(1 << 26, secret)
    c = forged(setup, 0)[0]
    assert store.put(c)
    other = ChunkLayout(**{**setup["layout"].__dict__, "layers": setup["layout"].layers + 1})
    with pytest.raises(LayoutMismatch):
        store.get(c.key, other)
    assert store.get(c.key, setup["layout"]) is not None
    st = store.stats()
    assert (st["layout_refused"], st["entries"], st["corrupt_dropped"]) == (1, 1, 0)


# ---- bounds before buffering -----------------------------------------------------------------------

def test_a_put_announcing_more_than_the_largest_chunk_is_refused_on_its_first_frame(setup):
    limit = max_chunk_bytes(setup["layout"])
    b = Bridge(max_chunk_bytes=limit)
    try:
        genuine = forged(setup, 0)[0]
        assert len(genuine.to_bytes(b.secret.mac_key)) <= limit  # a real chunk fits
        release = threading.Event()

        def frames():
            yield pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                key="big", offset=0, total_length=limit + 1, data=b"x" * FRAME, last=False))
            release.wait(TIMEOUT_S)  # the rest would follow: the server must not wait for it
            yield pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                key="big", offset=FRAME, total_length=limit + 1, data=b"x" * FRAME, last=False))

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            b.raw.Put(frames(), timeout=TIMEOUT_S, metadata=b.md())
        release.set()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("frame.total_length")
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        st = b.client.stats()
        # refused on the first frame (the one the server received), not after waiting for the rest; the client
        # may not even have asked its iterator for a second frame yet (a flag set there raced the refusal)
        assert st["server.frames_received"] == 1 and st["store.entries"] == 0
        assert b.client.put([genuine]).stored == 1
    finally:
        b.stop()
    asm = Assembler(1000)
    with pytest.raises(FrameError, match="total_length"):
        asm.feed(pb.ChunkFrame(key="k", offset=0, total_length=1001, data=b"x", last=False))
    assert (asm.parts, asm.received, asm.in_flight) == ([], 0, None)


def test_the_service_bound_is_the_model_pairs_largest_chunk(setup, dflash_pair):  # noqa: F811
    from flashpd.cluster.worker_main import max_chunk_bytes as service_limit
    cfg = ServeConfig(target=str(dflash_pair.target_dir), draft=str(dflash_pair.draft_dir), chunk_tokens=CHUNK,
                      dtype="float32")
    limit = service_limit(cfg)
    assert limit == max_chunk_bytes(ChunkLayout(**{**setup["layout"].__dict__, "fingerprint": None}))
    c = forged(setup, 0)[0]
    c.token_ids = [2**32 - 1] * CHUNK  # the longest header token ids can make
    assert len(c.to_bytes(ClusterSecret.generate().mac_key)) <= limit < 2 * setup["layout"].payload_bytes()


# ---- disk tier -------------------------------------------------------------------------------------

def test_a_disk_file_with_a_bad_mac_is_a_miss_and_is_dropped(setup, tmp_path):
    secret = ClusterSecret.generate()
    idx = [0, 1]
    run_and_compare(setup, DiskStore(tmp_path, 1 << 28, secret), idx)  # publishes the genuine chunks
    files = [tmp_path / n for n in disk_listing(tmp_path)]
    assert len(files) == sum(len(setup["prompts"][i]) // CHUNK for i in idx)
    foreign = ClusterSecret.generate()
    for f in files:  # every file re-sealed under another secret (another service, or someone else)
        body = f.read_bytes()[:-32]
        f.write_bytes(body + foreign.mac_key.tag([body]))
    store = DiskStore(tmp_path, 1 << 28, secret)
    pc = run_and_compare(setup, store, idx)
    assert pc.stats.hit_tokens == 0
    st = store.stats()
    assert st["corrupt_dropped"] == len(idx) and st["hits"] == 0  # the first chunk of each prompt, read once
    # the unreadable first files are gone; the prompts' genuine chunks were published again
    assert store.lookup(chunk_keys(setup["prompts"][0], CHUNK, setup["fp"])) == len(setup["prompts"][0]) // CHUNK


# ---- TLS -------------------------------------------------------------------------------------------

def _self_signed(tmp_path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flashpd test bridge")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "bridge.crt", tmp_path / "bridge.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_round_trip(tmp_path):
    cert, key = _self_signed(tmp_path)
    with pytest.raises(ValueError, match="together"):
        BridgeTls(cert=cert)
    secret = ClusterSecret.generate()
    store = MemoryStore(1 << 24, secret)
    server, port = serve(store, secret=secret, tls=BridgeTls(cert, key))
    try:
        c = KVChunk("tls", "", "fp", list(range(8)), torch.randn(2, 2, 8, 1, 4), torch.randn(1, 2, 8, 1, 4))
        with BridgeClient(f"127.0.0.1:{port}", TIMEOUT_S, secret=secret, tls=BridgeTls(ca=cert)) as client:
            assert client.put([c]).stored == 1
            (got,) = client.get(["tls"])
            assert torch.equal(got.target_kv, c.target_kv) and torch.equal(got.draft_kv, c.draft_kv)
        with BridgeClient(f"127.0.0.1:{port}", 2.0, secret=secret) as plain:  # no TLS: no handshake, no call
            with pytest.raises(BridgeUnavailable):
                plain.lookup(["tls"])
        assert store.stats()["entries"] == 1
    finally:
        server.stop(grace=None).wait(TIMEOUT_S)


def test_tls_material_that_is_not_pem_is_refused_by_name(tmp_path):
    """A certificate or key that is not PEM (or a key of another certificate) gets a ValueError naming the files
    before gRPC sees them: gRPC failed the bind with "Failed to bind to address", blaming the port."""
    cert, key = _self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = _self_signed(other)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    secret = ClusterSecret.generate()
    for c, k in ((str(junk), key), (cert, str(junk)), (cert, other_key)):
        with pytest.raises(ValueError, match="tls_cert / tls_key: .* not a PEM certificate and its"):
            serve(MemoryStore(1 << 20, secret), secret=secret, tls=BridgeTls(c, k))
    with pytest.raises(ValueError, match="tls_ca: .* holds no PEM certificate"):
        BridgeTls(ca=str(junk)).channel_credentials()
    BridgeTls(ca=cert).channel_credentials()


def test_a_weak_but_valid_pem_pair_is_served_as_grpc_serves_it(tmp_path):
    """The PEM check only parses and matches: a 1,024-bit RSA key, which OpenSSL's default security level refuses
    and gRPC serves, still starts the bridge (the check must not refuse what worked)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weak")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "w.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "w.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    secret = ClusterSecret.generate()
    server, _ = serve(MemoryStore(1 << 20, secret), secret=secret,
                      tls=BridgeTls(str(tmp_path / "w.crt"), str(tmp_path / "w.key")))
    server.stop(grace=None).wait(TIMEOUT_S)


def test_serve_config_tls_keys_are_validated():
    assert ServeConfig(target="t", tls_cert="c", tls_key="k", tls_ca="a").tls_ca == "a"
    for kw in (dict(tls_cert="c"), dict(tls_key="k"), dict(tls_ca="a")):
        with pytest.raises(ValueError, match="tls_"):
            ServeConfig(target="t", **kw)


# ---- the secret itself -----------------------------------------------------------------------------

def test_the_secret_never_shows_and_travels_only_on_purpose():
    s = ClusterSecret.generate()
    hexed = s.export_hex()
    assert len(hexed) == 64
    for text in (repr(s), str(s), repr(s.mac_key), str(s.mac_key), f"{s}"):
        assert hexed not in text and s.token not in text and "hidden" in text
    with pytest.raises(TypeError):
        pickle.dumps(s)
    assert ClusterSecret.from_env({ENV_VAR: hexed}) == s and ClusterSecret.from_env({}) is None
    assert s.child_env() == {ENV_VAR: hexed}
    for bad in ("zz" * 32, hexed[:-2], hexed + "00"):
        with pytest.raises(ValueError) as e:
            ClusterSecret.from_env({ENV_VAR: bad})
        assert bad not in str(e.value) and ENV_VAR in str(e.value)
    other = ClusterSecret.generate()
    assert other != s and other.token != s.token and other.mac_key != s.mac_key
    assert s.token != hexed and s.mac_key.tag([b"x"]) != other.mac_key.tag([b"x"])


def test_a_launched_bridge_worker_takes_the_launchers_secret(dflash_pair, tmp_path):  # noqa: F811
    """The local launcher's child gets the secret in its environment (not its command line or log); the
    bridge it serves admits that secret's token only and bounds a chunk by the model pair's layout."""
    from flashpd.cluster.launcher import WorkerSpec
    from flashpd.cluster.local_launcher import LocalLauncher
    from flashpd.cluster.worker_main import max_chunk_bytes as service_limit

    cfg = ServeConfig(target=str(dflash_pair.target_dir), draft=str(dflash_pair.draft_dir), mode="local",
                      chunk_tokens=CHUNK, dtype="float32", worker_metrics=False)
    launcher = LocalLauncher(tmp_path / "logs")
    try:
        (w,) = launcher.start([WorkerSpec("bridge", 0, cfg)], 120.0)
        hexed = launcher.secret.export_hex()
        assert not any(hexed in a for a in w.handle.proc.args)
        with BridgeClient(w.address, TIMEOUT_S, FRAME, secret=launcher.secret) as ok:
            assert ok.health()["serving"]
            big = [pb.PutFrame(version=PROTOCOL_VERSION, frame=pb.ChunkFrame(
                key="big", offset=0, total_length=service_limit(cfg) + 1, data=b"x", last=False))]
            with pytest.raises(grpc.RpcError) as e:  # the client's stub carries the token
                ok.stub.Put(iter(big), timeout=TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("frame.total_length")
        with BridgeClient(w.address, TIMEOUT_S, secret=ClusterSecret.generate()) as stranger:
            with pytest.raises(BridgeUnauthenticated):
                stranger.health()
    finally:
        launcher.shutdown()
    assert all(hexed not in f.read_text(errors="replace") for f in (tmp_path / "logs").iterdir())
