"""ChainLRU: the stores' recency index keeps the order of the plain walk (an OrderedDict whose freshen moves the
key, then each held chunk before it, to the end) under random operations, and costs O(1) a chunk when a prompt
is put or read in order (a client could make the walk O(N^2) a prompt, under the store's lock)."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from flashpd.kv_bridge.lru import ChainLRU
from flashpd.kv_bridge.store import freshen, may_evict, protected


def _walk_freshen(index: OrderedDict, key: str, parent: dict[str, str]) -> None:
    """The reference: what store.freshen did over an OrderedDict."""
    k, seen = key, set()
    while k and k in index and k not in seen:
        seen.add(k)
        index.move_to_end(k)
        k = parent.get(k, "")


def _chain(index: OrderedDict, key: str, parent: dict[str, str]) -> set[str]:
    out, k = set(), key
    while k and k in index and k not in out:
        out.add(k)
        k = parent.get(k, "")
    return out


@pytest.mark.parametrize("seed", range(6))
def test_same_order_and_eviction_rule_as_the_walk(seed):
    rng = random.Random(seed)
    ref: OrderedDict[str, int] = OrderedDict()
    lru: ChainLRU[int] = ChainLRU()
    parent: dict[str, str] = {}
    names = [f"k{i}" for i in range(60)]

    def parent_of(k: str) -> str:
        return parent.get(k, "")

    for step in range(3000):
        op = rng.random()
        held = list(ref)
        if op < 0.45:  # a put: a new key whose parent is held, a prompt's first, or an orphan
            free = [n for n in names if n not in ref]
            if not free:
                continue
            key = rng.choice(free)
            r = rng.random()
            parent[key] = (held[-1] if r < 0.5 else rng.choice(held)) if held and r < 0.8 else \
                ("" if r < 0.9 else "gone")
            if rng.random() < 0.1 and held:  # a held key's parent learned late (the disk tier), here a loop
                parent[rng.choice(held)] = key
                lru.forget_chain()
            _walk_freshen(ref, parent[key], parent)
            freshen(lru, parent[key], parent_of)
            keep = protected(lru, parent[key])
            old_keep = None if parent[key] and parent[key] not in ref else _chain(ref, parent[key], parent)
            while len(ref) > 40:  # evict to room, as a put does
                allowed = may_evict(lru, keep)
                assert allowed == (old_keep is not None and next(iter(ref)) not in old_keep), step
                if not allowed:
                    break
                assert lru.popitem(last=False) == ref.popitem(last=False)
            else:
                ref[key] = step
                _walk_freshen(ref, key, parent)
                lru.insert(key, step, parent_of)
        elif op < 0.8 and held:  # a hit
            key = rng.choice(held[-8:] if rng.random() < 0.5 else held)
            _walk_freshen(ref, key, parent)
            freshen(lru, key, parent_of)
        elif held:  # a drop (corrupt entry, remove())
            key = rng.choice(held)
            assert lru.pop(key) == ref.pop(key)
        assert list(lru) == list(ref), step
        assert lru.first() == next(iter(ref), None)
    assert [(k, lru[k]) for k in lru] == list(ref.items())


def test_in_order_put_and_read_cost_o1_a_chunk():
    """Counted in parent lookups, not timed: a 4,000-chunk prompt put in order, read in order, put again as
    duplicates, and a second prompt sharing its first half."""
    parent: dict[str, str] = {}
    calls = [0]

    def parent_of(k: str) -> str:
        calls[0] += 1
        return parent.get(k, "")

    lru: ChainLRU[int] = ChainLRU()
    n = 4000
    for i in range(n):
        parent[f"a{i}"] = f"a{i - 1}" if i else ""
        freshen(lru, parent[f"a{i}"], parent_of)
        lru.insert(f"a{i}", i, parent_of)
    for i in range(n):
        freshen(lru, f"a{i}", parent_of)  # a read in prompt order
    for i in range(n):
        freshen(lru, f"a{i}", parent_of)
    assert calls[0] <= 4 * 3 * n + 2 * n, calls[0]  # the walk made about n * n / 2 of them
    assert list(lru)[-3:] == ["a2", "a1", "a0"]  # the first chunk is the most recent
    assert lru.first() == f"a{n - 1}"  # the tail goes first
