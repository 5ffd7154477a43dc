"""The bridge's ledger of untaken SHM Get segments (kv_bridge/shm.SegmentLedger): a reservation's cost does not grow
with the segments out, and a segment its reader took never counts against it. Real files in a tmp directory stand
for /dev/shm's."""
from __future__ import annotations

import pathlib

import pytest

from flashpd.kv_bridge import shm


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    return tmp_path


def _hand_out(ledger: shm.SegmentLedger, d: pathlib.Path, name: str, n: int, peer: str, call: str) -> None:
    ticket = ledger.reserve(n, 0.0, lambda: True, peer=peer, call=call)
    assert ticket is not None, name
    (d / name).write_bytes(b"x")
    ledger.bind(ticket, name)


def test_a_reservation_costs_the_same_with_thousands_of_segments_out(shm_dir, monkeypatch):
    """A client that stores small chunks and reads them by SHM without taking them: every reservation looked at
    (stat) and summed every untaken segment, its own Get O(n^2) (17 s of CPU for 3,000). Now the sums are kept as
    segments come and go, and the files are looked at at most every PRUNE_EVERY_S (here: never again)."""
    looked = []
    real = pathlib.Path.exists

    def exists(self):
        looked.append(self.name)
        return real(self)

    monkeypatch.setattr(pathlib.Path, "exists", exists)
    monkeypatch.setattr(shm, "PRUNE_EVERY_S", 3600.0, raising=False)
    ledger = shm.SegmentLedger(1 << 30, 1 << 30)
    n = 3000
    for i in range(n):
        _hand_out(ledger, shm_dir, f"s{i}", 100, "attacker", "get-1")
    assert len(looked) <= 1  # the first reservation's prune saw nothing: O(n^2) = 4.5 million before
    assert ledger.outstanding() == n * 100


def test_segments_taken_since_the_last_look_never_count_against_their_reader(shm_dir, monkeypatch):
    """Looking at the files only now and then must not refuse a reader whose last Get's segments it has taken
    (they are gone) but the ledger has not yet seen go: before a no, the files are looked at again."""
    monkeypatch.setattr(shm, "PRUNE_EVERY_S", 3600.0, raising=False)
    ledger = shm.SegmentLedger(1000, 400)
    for i in range(4):
        _hand_out(ledger, shm_dir, f"a{i}", 100, "reader", "get-1")
    ledger.finish("get-1")  # its 400 bytes are its share, all of a finished call's
    with pytest.raises(shm.NoRoom):
        ledger.reserve(100, 0.0, lambda: True, peer="reader", call="get-2")  # not taken: refused at once
    for i in range(4):
        (shm_dir / f"a{i}").unlink()  # the reader takes them
    assert ledger.reserve(100, 0.0, lambda: True, peer="reader", call="get-2") is not None
    assert ledger.outstanding() == 100


def test_a_zero_byte_segment_outliving_its_peers_sum_is_no_key_error(shm_dir):
    """The running sums drop a peer at 0 bytes; a zero-byte segment of that peer still out must then leave
    without a KeyError (outstanding() raised one once its 5-byte sibling was taken)."""
    ledger = shm.SegmentLedger(1000, 400)
    _hand_out(ledger, shm_dir, "five", 5, "p", "get-1")
    _hand_out(ledger, shm_dir, "zero", 0, "p", "get-1")
    ledger.finish("get-1")
    for name in ("five", "zero"):
        (shm_dir / name).unlink()
    assert ledger.outstanding() == 0
