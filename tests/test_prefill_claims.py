"""cluster/prefill_claims.py's book: a claim's lease is taken once; a Release before its lease leaves a tombstone
that frees the lease as it is made; entries go after keep_s or past max_entries, oldest first (a router that never
releases cannot grow a prefill worker's memory); claims in metadata are checked."""
from __future__ import annotations

import pytest

from flashpd.cluster import prefill_claims
from flashpd.cluster.prefill_claims import CLAIM_HEADER, ClaimBook, Claimed, claim_from

LEASE = Claimed("exp", 9, (1, 2), (0, 0))


def test_register_take_and_tombstones():
    book = ClaimBook(keep_s=60)
    assert book.register(1, LEASE) and book.take(1) == LEASE
    assert book.take(1) is None  # taken: a second Release finds nothing (and leaves a tombstone)
    assert book.take(2) is None and not book.register(2, LEASE)  # released before it was made: freed as made
    assert book.register(2, LEASE)  # (the tombstone is spent)
    assert book.stats == {"released_by_claim": 1, "released_on_arrival": 1, "tombstones": 2}


def test_a_lease_released_by_its_id_leaves_the_book():
    """The usual end of a lease (the decode worker's Release by id) drops its claim's entry: before, every answered
    Prefill's blocks and epochs stayed keep_s."""
    book = ClaimBook(keep_s=60)
    book.register(1, LEASE)
    book.register(2, Claimed("exp", 10, (3,), (1,)))
    book.forget(9)
    assert len(book) == 1 and book.take(1) is None and book.take(2).lease_id == 10
    book.forget(12345)  # unknown: nothing happens


def test_entries_go_after_keep_s_or_past_max_entries(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(prefill_claims.time, "monotonic", lambda: now[0])
    book = ClaimBook(keep_s=10, max_entries=3)
    for c in range(1, 6):
        book.register(c, LEASE)
    assert len(book) == 4  # pruned to max_entries before each insert: the oldest went
    book.register(6, LEASE)
    assert book.take(1) is None and book.take(6) == LEASE
    now[0] += 11
    assert book.take(5) is None and len(book) == 1  # every older entry expired; the new tombstone stays


def test_claims_in_metadata():
    assert claim_from(()) is None and claim_from([("x-other", "1")]) is None
    assert claim_from([(CLAIM_HEADER, str(2 ** 64 - 1))]) == 2 ** 64 - 1
    for bad in (["0"], ["-1"], [str(2 ** 64)], ["1x"], [""], ["1", "2"]):
        with pytest.raises(ValueError, match=CLAIM_HEADER):
            claim_from([(CLAIM_HEADER, v) for v in bad])
