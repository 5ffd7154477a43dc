"""The workers' channels as a trust boundary: their own bearer token (a sniffed worker call opens no bridge, nor a
bridge call any worker), and TLS on every worker channel when the service has TLS material (the router's calls and a
decode worker's Release to its prefill worker), on a real local service over the fixture pair (CPU, float32)."""
from __future__ import annotations

import grpc
import pytest

from flashpd.cluster import worker_main
from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.service import start_service
from flashpd.cluster.worker_client import WorkerClient
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.tls import BridgeTls
from tests._cluster_helpers import serve_cfg, wait_until
from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture)
from tests.test_bridge_security import _self_signed

TIMEOUT_S = 30.0


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def test_the_workers_token_is_its_own_subkey():
    s = ClusterSecret.generate()
    assert len({s.token, s.worker_token, ClusterSecret.generate().worker_token}) == 3
    assert s.worker_token == ClusterSecret.from_hex(s.export_hex()).worker_token  # every process derives the same
    assert s.worker_token not in repr(s)


def test_a_worker_admits_the_workers_token_only(dflash_pair):  # noqa: F811
    secret = ClusterSecret.generate()
    w = worker_main.build_worker("decode", serve_cfg(dflash_pair, "local", worker_metrics=False), 0, secret)
    try:
        for token in (secret.token, ClusterSecret.generate().worker_token, None):  # the bridge's, a stranger's, none
            c = WorkerClient("decode", w.address, token)
            assert _code(lambda: c.health(TIMEOUT_S)) == grpc.StatusCode.UNAUTHENTICATED
            c.close()
        ok = WorkerClient("decode", w.address, secret.worker_token)
        assert ok.health(TIMEOUT_S)["serving"]
        ok.close()
    finally:
        w.stop()


def test_with_tls_every_worker_channel_is_tls(dflash_pair, tmp_path):  # noqa: F811
    """The device path's whole round: the router's Prefill and Decode calls and the decode worker's Release of the
    prefill worker's lease go over TLS (the lease is freed, so the Release got through); a plaintext client of a
    worker gets nothing, not even with the token."""
    cert, key = _self_signed(tmp_path)
    svc = start_service(serve_cfg(dflash_pair, "local", prefill_workers=1, decode_workers=1, kv_transport="device",
                                  handoff_lease_s=120.0, tls_cert=cert, tls_key=key, tls_ca=cert))
    try:
        with GenerationClient(svc.address) as client:
            plain = list(client.generate(list(range(3, 90)), max_tokens=12, method="dflash", ignore_eos=True))
        assert sum(len(c.token_ids) for c in plain) == 12
        pre, dec = svc.pool.slots["prefill"][0], svc.pool.slots["decode"][0]

        def all_free() -> bool:
            h = pre.client.health(5)
            return h["kv_blocks_free"] == h["kv_blocks_total"]

        wait_until(all_free, "the prefill lease to be released over TLS", timeout_s=10)  # not at its 120 s deadline
        for slot in (pre, dec):
            clear = WorkerClient(slot.role, slot.address, svc.pool.secret.worker_token)
            assert _code(lambda: clear.health(5)) == grpc.StatusCode.UNAVAILABLE
            clear.close()
            tls = WorkerClient(slot.role, slot.address, svc.pool.secret.worker_token, BridgeTls(ca=cert))
            assert tls.health(5)["serving"]
            tls.close()
    finally:
        svc.stop()
