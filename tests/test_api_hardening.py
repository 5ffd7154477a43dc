"""A client cannot crash or stall the generation API (real servers on 127.0.0.1).

- Any finite temperature >= 0 is served: a tiny one (1e-40, the float32 subnormals included) is
  greedy and once killed the engine loop with NaN probabilities; a huge one samples near-uniformly.
- Cancel storms (streams cancelled right after they start, or after their first token) free every
  KV block within a second, colocated and in mode "local" (router + worker processes): a cancel that
  reached the server while the request was being submitted used to be lost, and the request ran on
  to max_tokens.
- Oversized fields get a short INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming the field (a 1 MiB
  method string was echoed into the status and turned it into RESOURCE_EXHAUSTED), and bytes that
  are not a request message (garbage, truncated, invalid UTF-8, an over-long varint) get
  INVALID_ARGUMENT instead of INTERNAL, on every method and on the workers' services too.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import GenerationClient, GenerationInvalidArgument, build_request
from flashpd.cluster.proto_gen import generation_pb2 as pb
from flashpd.cluster.proto_gen import generation_pb2_grpc as pb_grpc
from flashpd.cluster.service import start_service
from flashpd.cluster.worker_services import CallEnded, PrefillHost
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.auth import resolve
from flashpd.kv_bridge.rpc_guard import TOKEN_HEADER

from tests._cluster_helpers import dflash_pair, prompts, serve_cfg, stream_chunks, wait_until  # noqa: F401

DEMO = Path(__file__).resolve().parents[1] / "flashpd" / "assets" / "demo_pair"
FREE_WITHIN_S = 1.0  # a cancel frees its request within one engine step: far less than this
HOLD_S = 0.5  # ... and nothing comes back to run after that
SERVICE = "/flashpd.generation.v1.Generation/"
MAX_DETAILS = 300  # a status message about a client's value stays short


@pytest.fixture(scope="module")
def demo():
    """`flashpd serve` colocated over the shipped demo pair (it has a tokenizer), in this process."""
    svc = start_service(ServeConfig(target=str(DEMO / "target"), draft=str(DEMO / "drafter"), device="cpu",
                                    dtype="float32", kv_cache_tokens=8192, torch_threads=1))
    client = GenerationClient(svc.address, timeout_s=60.0)
    yield svc, client
    client.close()
    svc.stop()


def _demo_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (int(k),), generator=g).tolist() for k in torch.randint(8, 48, (n,), generator=g)]


def _idle(h: dict) -> bool:
    return h["running"] == 0 and h["waiting"] == 0 and h["kv_blocks_free"] == h["kv_blocks_total"]


def _assert_freed_within(health, what: str) -> None:
    """`health()` shows nothing running or waiting and every KV block free by FREE_WITHIN_S after the last
    cancel, and still so HOLD_S later: a request whose cancel was lost (its submit was still in flight
    when the first idle reading came) shows up in between and runs on to max_tokens."""
    t0 = time.monotonic()
    idle_seen = False
    while (now := time.monotonic() - t0) < FREE_WITHIN_S + HOLD_S:
        last = health()
        idle_seen = _idle(last)
        assert idle_seen or now < FREE_WITHIN_S, f"{what}: busy {now:.2f} s after the last cancel: {last}"
        time.sleep(0.02)
    assert idle_seen, f"{what}: {last}"


# ---- temperatures ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["native", "dflash"])
def test_any_finite_temperature_is_served_and_the_server_lives(demo, method):
    svc, client = demo
    prompt = _demo_prompts(1, 1)[0]
    kw = dict(max_tokens=10, method=method, ignore_eos=True)
    ref = client.generate_once(prompt, **kw).token_ids
    for t in (1e-40, 1e-38, 1e-30, 1e-6, 9e-6):  # below 1e-5: greedy, seed or not
        assert client.generate_once(prompt, temperature=t, seed=7, **kw).token_ids == ref, t
        assert stream_chunks(client, prompt, temperature=t, **kw)[0] == ref, t
    # huge: near-uniform sampling, still valid; top_k 1 (chosen on the logits) stays greedy even so. Past
    # float32's range (1e300) the client sends float32's largest: the wire's float32 would make it inf, refused
    for t in (1e30, 3.0e38, 1e300):
        out = client.generate_once(prompt, temperature=t, seed=3, **kw).token_ids
        assert len(out) == 10 and all(0 <= x < 4096 for x in out)
        assert client.generate_once(prompt, temperature=t, top_k=1, **kw).token_ids == ref
        assert len(client.generate_once(prompt, temperature=t, top_p=1e-9, seed=1, **kw).token_ids) == 10
    # a top_p below float32's range keeps the most likely token alone (SamplingParams' TOP_P_MIN): greedy. The
    # client once sent it as 0, which the server reads as unset (1.0), sampling from the whole distribution
    for p in (1e-50, 1e-44):
        assert client.generate_once(prompt, temperature=2.0, top_p=p, seed=5, **kw).token_ids == ref, p
    # a tiny temperature next to sampled and greedy requests in one batch
    outs: dict[int, list[int]] = {}
    temps = [0.0, 1e-40, 0.8, 1e-38, 1e30, 0.0]

    def one(i: int) -> None:
        outs[i] = client.generate_once(prompt, temperature=temps[i], seed=i, **kw).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(temps))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert sorted(outs) == list(range(len(temps)))
    assert [i for i, t in enumerate(temps) if t < 1e-5 and outs[i] != ref] == []
    assert svc.alive and client.health()["serving"]
    assert client.generate_once(prompt, **kw).token_ids == ref
    assert _idle(client.health())


@pytest.mark.parametrize("field, kw", [
    ("temperature", dict(temperature=math.inf)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=-1e-40)),
    ("top_p", dict(temperature=1.0, top_p=math.nan)),
    ("top_p", dict(temperature=1.0, top_p=math.inf)),
])
def test_non_finite_sampling_values_are_invalid_argument(demo, field, kw):
    _, client = demo
    with pytest.raises(GenerationInvalidArgument, match=field):
        client.generate_once([5, 6, 7], max_tokens=4, **kw)


# ---- cancel storms -----------------------------------------------------------------------------

def _first_then_cancel(call, took: list[bool]) -> None:
    assert next(call).token_ids
    took.append(call.cancel())


def _storm(address: str, ps: list[list[int]], after_first: int, n_once: int, **kw) -> None:
    """Start a call per prompt at once (the last n_once GenerateOnce, the others Generate); cancel the first
    `after_first` once a token arrived, the rest right after they start, 5 ms apart: those cancels reach the
    server before, during and after its submit of the request (the loop takes a request between steps).

    A cancel that gRPC took (`cancel()` True) must end the call CANCELLED. One it refused came after the call
    had finished, which a small model can do within the storm's spread: that call must have ended OK. Most
    cancels must be taken, or the storm tested nothing."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        calls = []
        for i, p in enumerate(ps):
            req = build_request(p, **kw)
            once = i >= len(ps) - n_once
            calls.append(stub.GenerateOnce.future(req, timeout=60) if once else stub.Generate(req, timeout=60))
        took_first: list[list[bool]] = [[] for _ in range(after_first)]
        firsts = [threading.Thread(target=_first_then_cancel, args=(c, took))
                  for c, took in zip(calls[:after_first], took_first)]
        for t in firsts:
            t.start()
        t0 = time.monotonic()
        took_rest = []
        for i, c in enumerate(calls[after_first:]):
            time.sleep(max(0.0, t0 + 0.005 * i - time.monotonic()))
            took_rest.append(c.cancel())
        for t in firsts:
            t.join(60)
        took = [bool(t and t[0]) for t in took_first] + took_rest
        expected = [grpc.StatusCode.CANCELLED if k else grpc.StatusCode.OK for k in took]
        assert [c.code() for c in calls] == expected
        assert sum(took) >= len(calls) * 3 // 4, took


def test_colocated_cancel_storm_frees_every_block_within_a_second(demo):
    svc, client = demo
    assert _idle(client.health())
    ps = _demo_prompts(20, 2)
    for round_ in range(2):  # the second storm on a server that already took one
        _storm(svc.address, ps, after_first=6, n_once=4, max_tokens=400,
               method=("dflash", "native")[round_], ignore_eos=True)
        _assert_freed_within(client.health, f"storm {round_}")
    ref = client.generate_once(ps[0], max_tokens=8, method="native", ignore_eos=True)
    assert len(ref.token_ids) == 8 and svc.alive


def test_deadline_storm_frees_every_block(demo):
    """Deadlines that pass while the request is being submitted or generating (the same path as a cancel)."""
    svc, client = demo
    ps = _demo_prompts(12, 3)
    errs: list[BaseException] = []

    def one(i: int) -> None:
        try:
            client.generate_once(ps[i], max_tokens=400, ignore_eos=True, timeout_s=0.02 + 0.03 * i)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errs) == len(ps) and all(getattr(e, "code", None) == grpc.StatusCode.DEADLINE_EXCEEDED for e in errs)
    _assert_freed_within(client.health, "deadline storm")


# ---- oversized and undecodable requests -----------------------------------------------------------

def _raw_calls(ch: grpc.Channel) -> dict:
    """Each Generation method taking raw request bytes (no serializer) and returning raw bytes."""
    return {"Generate": lambda b: list(ch.unary_stream(SERVICE + "Generate")(b, timeout=10)),
            "GenerateOnce": lambda b: ch.unary_unary(SERVICE + "GenerateOnce")(b, timeout=10),
            "Health": lambda b: ch.unary_unary(SERVICE + "Health")(b, timeout=10)}


def _status(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code(), ei.value.details() or ""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _undecodable(version_field: bytes) -> dict[str, bytes]:
    good = build_request([5, 6, 7], max_tokens=4).SerializeToString()
    bad_utf8 = b"\xff\xfe\xc3\x28"
    return {"garbage": b"\xff\xff\xff\xff\xff\x00\x13\x37",
            "truncated": good[:5],  # inside prompt_ids
            "length past the end": version_field + b"\x12" + _varint(1000) + b"abc",
            "invalid UTF-8 prompt_text": version_field + b"\x12" + _varint(len(bad_utf8)) + bad_utf8,
            "over-long varint": version_field + b"\x20" + b"\xff" * 11 + b"\x01"}


def test_undecodable_bytes_are_invalid_argument_on_every_method(demo):
    svc, client = demo
    with grpc.insecure_channel(svc.address) as ch:
        for method, call in _raw_calls(ch).items():
            for what, data in _undecodable(b"\x08\x01").items():
                if method == "Health" and what == "invalid UTF-8 prompt_text":
                    continue  # field 2 of a HealthRequest is unknown, kept as bytes: a valid request
                code, details = _status(lambda: call(data))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, what, code, details)
                assert len(details) < MAX_DETAILS and "not a valid" in details, (method, what, details)
    assert _idle(client.health())


BIG = 1 << 20


@pytest.mark.parametrize("field, code, req", [
    ("method", "INVALID_ARGUMENT", dict(method="x" * BIG)),
    ("method", "INVALID_ARGUMENT", dict(method="\u00e9\u4e2d" * (BIG // 4))),
    ("prompt_ids", "RESOURCE_EXHAUSTED", dict(prompt=[7] * (BIG // 2))),
    ("prompt_ids[3]", "INVALID_ARGUMENT", dict(prompt=[5, 6, 7, (1 << 32) - 1])),
    ("prompt_text", "RESOURCE_EXHAUSTED", dict(prompt="hello world " * (BIG // 4))),
    ("max_tokens", "RESOURCE_EXHAUSTED", dict(max_tokens=(1 << 31) - 1)),
    ("max_tokens", "INVALID_ARGUMENT", dict(max_tokens=-(1 << 31))),
    ("block_size", "INVALID_ARGUMENT", dict(method="dflash", block_size=(1 << 32) - 1)),
    ("top_k", "INVALID_ARGUMENT", dict(top_k=-(1 << 31))),
    ("version", "INVALID_ARGUMENT", dict(version=(1 << 32) - 1)),
])
def test_oversized_fields_get_a_short_status_naming_the_field(demo, field, code, req):
    _, client = demo
    kw = {"prompt": [5, 6, 7], "max_tokens": 4, **req}
    version = kw.pop("version", 1)
    msg = build_request(**kw)
    msg.version = version
    stub = pb_grpc.GenerationStub(client._channel)
    t0 = time.monotonic()
    for call in (lambda: stub.GenerateOnce(msg, timeout=30), lambda: list(stub.Generate(msg, timeout=30))):
        got, details = _status(call)
        assert got == getattr(grpc.StatusCode, code), (got, details[:200])
        assert details.startswith(field) and len(details) < MAX_DETAILS, details[:200]
    assert time.monotonic() - t0 < 10  # refused before any heavy work (a 1 MiB prompt_text is not tokenized)
    assert _idle(client.health())


def test_the_client_sends_what_sampling_params_would_serve():
    """Values float32 cannot carry are sent as SamplingParams reads them: a top_p below its smallest normal as
    TOP_P_MIN (not 0, which reads as unset), a temperature past its range as its largest, ints included."""
    from flashpd.cluster import generation_client as gc
    from flashpd.engine import sampling

    assert gc.TOP_P_MIN == sampling.TOP_P_MIN
    for p in (1e-50, 1e-44, 1e-39):
        sent = build_request([5], temperature=1.0, top_p=p).top_p
        assert sent > 0 and sent == np.float32(sampling.TOP_P_MIN), p
    assert build_request([5], top_p=0.5).top_p == np.float32(0.5)
    for t in (1e40, 10 ** 40, 10 ** 400):
        assert build_request([5], temperature=t).temperature == np.float32(gc._FLOAT32_LARGEST), t
    assert build_request([5], temperature=7).temperature == 7.0
    assert math.isinf(build_request([5], temperature=math.inf).temperature)  # refused by the server, by name


@pytest.mark.parametrize("kw", [dict(top_k=(1 << 31) - 1, temperature=0.7, seed=(1 << 64) - 1),
                                dict(top_k=1, temperature=1.0, seed=0), dict(top_p=1e-30, temperature=1.0),
                                dict(max_tokens=1, temperature=1e-45), dict(prompt="\x00\x01 \u202e\U0001f600 ok")])
def test_odd_but_valid_fields_are_served(demo, kw):
    _, client = demo
    kw = {"prompt": [5, 6, 7], "max_tokens": 4, **kw}
    out = client.generate_once(**kw)
    assert 1 <= len(out.token_ids) <= kw["max_tokens"]
    assert _idle(client.health())


def _fake_host(prefill, release=None, holds=None, held: int = 0) -> PrefillHost:
    """A PrefillHost over a stand-in worker (its prefill, and its lease release and exporter "ex-a" when given) and a
    stand-in runner: the host's locking and queueing alone, no model."""
    runner = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=8)), max_positions=64,
                             allocator=SimpleNamespace(num_free=4), kv_block_size=16)
    if release is None:
        return PrefillHost(SimpleNamespace(prefill=prefill), runner, None)
    exporter = SimpleNamespace(exporter_id="ex-a", admits_release=lambda i, blocks, epochs: holds(i), held=held,
                               expire=lambda: 0)
    return PrefillHost(SimpleNamespace(prefill=prefill, release=release, exporter=exporter), runner, None)


def test_a_prefill_whose_call_ended_while_waiting_never_runs():
    """The prefill worker runs one prefill at a time; one queued behind it whose call ends (the router
    cancelled it) leaves the queue at once instead of running later for nobody."""
    release, ran = threading.Event(), []

    def prefill(prompt, params):
        ran.append(prompt)
        release.wait(10)
        return "result"

    host = _fake_host(prefill)
    busy = threading.Thread(target=host.prefill, args=([1], SamplingParams(), 10.0))
    busy.start()
    wait_until(lambda: host.running == 1, "the first prefill to run", timeout_s=5)
    active = [True]
    outcome: list[BaseException] = []

    def queued() -> None:
        try:
            host.prefill([2], SamplingParams(), 10.0, lambda: active[0])
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    waiter = threading.Thread(target=queued)
    waiter.start()
    wait_until(lambda: host.waiting == 1, "the second prefill to queue", timeout_s=5)
    active[0] = False
    waiter.join(2)
    assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], CallEnded)
    assert host.waiting == 0
    release.set()
    busy.join(5)
    assert ran == [[1]] and host.running == 0


def test_a_lease_release_never_waits_for_a_running_prefill():
    """A Release RPC during a long prefill returns at once (it used to wait for the runner's lock, holding a
    server thread for the whole prefill; enough of them starve Prefill and Health). The blocks are still freed
    only under the lock (the allocator is not thread-safe): by the prefill as it ends, or at once when the
    worker is idle. An unknown lease or another exporter's id is refused at once, and nothing is freed twice."""
    go, freed = threading.Event(), []
    live = {7, 8}

    def prefill(prompt, params):
        go.wait(10)
        return "result"

    def release(lease_id, blocks, epochs):
        freed.append((lease_id, host._lock.locked()))
        live.discard(lease_id)
        return True

    host = _fake_host(prefill, release, holds=lambda i: i in live, held=2)
    busy = threading.Thread(target=host.prefill, args=([1], SamplingParams(), 10.0))
    busy.start()
    wait_until(lambda: host.running == 1, "the prefill to run", timeout_s=5)
    answers: list[bool] = []
    caller = threading.Thread(target=lambda: answers.append(host.release("ex-a", 7, (1,), (0,))))
    caller.start()
    caller.join(1.0)
    assert not caller.is_alive() and answers == [True], "Release waited for the running prefill"
    assert host.release("ex-a", 99, (1,), (0,)) is False and host.release("ex-b", 8, (1,), (0,)) is False
    assert freed == []  # not while the prefill holds the runner
    go.set()
    busy.join(5)
    assert freed == [(7, True)]
    assert host.release("ex-a", 8, (1,), (0,)) is True
    assert freed == [(7, True), (8, True)]  # idle: freed before it returns
    assert host.release("ex-a", 8, (1,), (0,)) is False and len(freed) == 2


# ---- mode "local": router + bridge, prefill and decode worker processes ---------------------------

@pytest.fixture(scope="module")
def local(dflash_pair):  # noqa: F811
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1))
    yield svc
    svc.stop()


def _decode_health(svc) -> dict:
    return svc.pool.slots["decode"][0].client.health(5.0)


def test_local_cancel_storm_frees_the_decode_worker_within_a_second(local):
    ps = prompts()[:24]
    for round_ in range(2):
        _storm(local.address, ps, after_first=8, n_once=4, max_tokens=400, method=("dflash", "native")[round_],
               ignore_eos=True)
        _assert_freed_within(lambda: _decode_health(local), f"storm {round_}")
        wait_until(lambda: local.backend.inflight == 0, "the router's requests to end", timeout_s=FREE_WITHIN_S)
        assert _idle(local.pool.slots["prefill"][0].client.health(5.0))  # nothing left queued or held there
    with GenerationClient(local.address, timeout_s=60) as c:
        assert len(stream_chunks(c, ps[0], max_tokens=8, ignore_eos=True)[0]) == 8


def test_local_tiny_temperature_is_greedy_and_the_workers_live(local):
    p = prompts()[3]
    with GenerationClient(local.address, timeout_s=60) as c:
        for method in ("native", "dflash"):
            ref = c.generate_once(p, max_tokens=12, method=method, ignore_eos=True).token_ids
            for t in (1e-40, 1e-38, 1e-6):
                assert c.generate_once(p, max_tokens=12, method=method, ignore_eos=True, temperature=t,
                                       seed=5).token_ids == ref
        assert len(c.generate_once(p, max_tokens=12, ignore_eos=True, temperature=1e30, seed=5).token_ids) == 12
        assert c.health()["serving"]
    assert local.pool.restarts["decode"] == 0 and local.pool.restarts["prefill"] == 0


def test_local_undecodable_bytes_are_invalid_argument_everywhere(local):
    """The router's Generation service, and the workers' own services (their ports are loopback too; a caller
    with the workers' token: without it, every worker call is UNAUTHENTICATED before its request is read)."""
    long_method = build_request([5, 6, 7], max_tokens=4, method="x" * BIG)
    token = [(TOKEN_HEADER, resolve(local.pool.secret).worker_token)]
    prefill, decode = local.pool.slots["prefill"][0].address, local.pool.slots["decode"][0].address
    targets = [(local.address, SERVICE + "Generate", long_method, None),
               (local.address, SERVICE + "GenerateOnce", long_method, None),
               (prefill, "/flashpd.generation.v1.PrefillWorker/Prefill", long_method, token),
               (decode, "/flashpd.generation.v1.DecodeWorker/Decode", pb.DecodeRequest(version=1, request=long_method),
                token),
               (decode, SERVICE + "Generate", long_method, token)]
    for address, path, long_msg, md in targets:
        with grpc.insecure_channel(address) as ch:
            if path.endswith(("Generate", "Decode")):
                call = lambda b, md, m=ch.unary_stream(path): list(m(b, timeout=10, metadata=md))  # noqa: E731
            else:
                call = lambda b, md, m=ch.unary_unary(path): m(b, timeout=10, metadata=md)  # noqa: E731
            for what, data in [*_undecodable(b"\x08\x01").items(), ("1 MiB method", long_msg.SerializeToString())]:
                code, details = _status(lambda: call(data, md))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, what, code, details[:200])
                assert len(details) < MAX_DETAILS, (path, what, details[:200])
            if md is not None:  # a worker: the same calls without the token, or with another, are refused
                valid = long_msg.SerializeToString()
                for other in (None, [(TOKEN_HEADER, "0" * 64)]):
                    assert _status(lambda: call(valid, other))[0] == grpc.StatusCode.UNAUTHENTICATED, path
                health = ch.unary_unary(path.rsplit("/", 1)[0] + "/Health")
                assert _status(lambda: health(pb.HealthRequest(version=1).SerializeToString(), timeout=10))[0] == \
                    grpc.StatusCode.UNAUTHENTICATED


def test_a_lease_whose_freeing_fails_does_not_keep_the_runner_locked(caplog):
    """A queued release whose freeing raises is logged (the lease then expires at its deadline); the prefill that
    freed it still lets the runner's lock go, and the next prefill runs."""
    go = threading.Event()

    def prefill(prompt, params):
        go.wait(10)
        return "result"

    def release(lease_id, blocks, epochs):
        raise RuntimeError("allocator says no")

    host = _fake_host(prefill, release, holds=lambda i: True, held=1)
    busy = threading.Thread(target=host.prefill, args=([1], SamplingParams(), 10.0))
    busy.start()
    wait_until(lambda: host.running == 1, "the prefill to run", timeout_s=5)
    assert host.release("ex-a", 7, (1,), (0,)) is True
    with caplog.at_level("ERROR", logger="flashpd.cluster.worker_services"):
        go.set()
        busy.join(5)
    assert not busy.is_alive() and not host._lock.locked() and "freeing lease 7 failed" in caplog.text
    assert host.prefill([2], SamplingParams(), 5.0) == "result"
