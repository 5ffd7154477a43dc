"""`secret_file`: the cluster secret kept across service starts, so the bridge's disk tier keeps its entries (a fresh
secret each start makes them unverifiable, and the disk tier deletes them). The file is made 0600 when missing and
refused when others may access it or it holds no secret; errors name the file, never a value. The service case runs
a real local service (bridge and decode processes) twice over one disk directory."""
from __future__ import annotations

import os
import stat

import pytest

from flashpd.kv_bridge.auth import ClusterSecret

from tests._cluster_helpers import dflash_pair, serve_cfg, wait_until  # noqa: F401


def test_a_missing_file_is_made_owner_only_and_read_back_as_the_same_secret(tmp_path):
    p = tmp_path / "secret"
    a = ClusterSecret.from_file(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert ClusterSecret.from_file(p) == a and ClusterSecret.from_file(str(p)) == a
    assert ClusterSecret.from_file(tmp_path / "other") != a


def test_starts_creating_the_file_at_once_all_read_one_secret_and_leave_no_temporary_file(tmp_path):
    import threading

    p, got = tmp_path / "secret", []
    barrier = threading.Barrier(8)

    def one() -> None:
        barrier.wait()
        got.append(ClusterSecret.from_file(p))

    ts = [threading.Thread(target=one) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(got) == 8 and all(g == got[0] for g in got) and ClusterSecret.from_file(p) == got[0]
    assert [f.name for f in tmp_path.iterdir()] == ["secret"]


@pytest.mark.parametrize("case", ["group-readable", "directory", "short", "not-hex", "no-parent", "symlink",
                                  "other-owner"])
def test_a_file_others_may_read_or_that_holds_no_secret_is_refused_by_name(tmp_path, case):
    p = tmp_path / "secret"
    good = ClusterSecret.generate().export_hex()
    if case == "group-readable":
        p.write_text(good)
        os.chmod(p, 0o640)
        what = "mode 640 lets other users"
    elif case == "directory":
        p.mkdir(mode=0o700)
        what = "not a regular file"
    elif case == "short":
        p.write_text(good[:40])
        os.chmod(p, 0o600)
        what = "20 bytes"
    elif case == "not-hex":
        p.write_text("zz" * 32)
        os.chmod(p, 0o600)
        what = "not a hex string"
    elif case == "symlink":  # a link to a good file: whoever can change the link picks the secret
        real = tmp_path / "real"
        real.write_text(good)
        os.chmod(real, 0o600)
        p.symlink_to(real)
        what = "a symbolic link"
    elif case == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        p.write_text(good)
        os.chmod(p, 0o600)
        os.chown(p, 65534, 65534)
        what = "owned by uid 65534"
    else:
        p = tmp_path / "missing" / "secret"
        what = "cannot create or read it"
    with pytest.raises(ValueError, match=what) as ei:
        ClusterSecret.from_file(p)
    assert str(p) in str(ei.value) and good not in str(ei.value) and good[:40] not in str(ei.value)


def test_secret_file_is_refused_for_a_colocated_service():
    from flashpd.cluster.config import ServeConfig

    with pytest.raises(ValueError, match="secret_file: applies to modes 'local' and 'ray'"):
        ServeConfig(target="t", mode="colocated", secret_file="s")


def test_a_service_started_again_with_its_secret_file_hits_its_disk_tier(tmp_path, dflash_pair):  # noqa: F811
    """One local service (a bridge and a decode worker, which prefills and publishes) writes a prompt's chunks to
    its disk tier and stops; a second start with the same secret_file and directory restores that prompt from disk
    (its memory tier is new and empty) and gives the same tokens."""
    from flashpd.cluster.generation_client import GenerationClient
    from flashpd.cluster.service import start_service
    from flashpd.kv_bridge.client import BridgeClient

    disk, secret = tmp_path / "disk", tmp_path / "secret"
    cfg = serve_cfg(dflash_pair, "local", prefill_workers=0, decode_workers=1, bridge_disk_dir=str(disk),
                    secret_file=str(secret))
    prompt = [(7 * i) % 120 + 3 for i in range(135)]

    def run() -> tuple[list[int], dict]:
        svc = start_service(cfg)
        try:
            with GenerationClient(svc.address, timeout_s=60) as c:
                toks = c.generate_once(prompt, max_tokens=8, method="dflash", ignore_eos=True).token_ids
            with BridgeClient(svc.pool.bridge_address, 10, secret=ClusterSecret.from_file(secret)) as b:
                # the disk writes run behind the puts: wait for them (4 whole 32-token chunks of the prompt)
                wait_until(lambda: b.stats().get("store.disk.entries", 0) >= 4, "the disk tier's writes")
                return toks, b.stats()
        finally:
            svc.stop()

    first, st1 = run()
    assert st1["store.hits_disk"] == 0
    files = sorted(f.name for f in disk.iterdir() if not f.name.startswith("."))
    assert len(files) >= 4
    second, st2 = run()
    assert second == first
    assert st2["store.hits_disk"] >= 4, st2
    assert sorted(f.name for f in disk.iterdir() if not f.name.startswith(".")) == files
