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


def _chain_in_order(index: OrderedDict, key: str, parent: dict[str, str]) -> list[str]:
    out, k = [], key
    while k and k in index and k not in out:
        out.append(k)
        k = parent.get(k, "")
    return out


@pytest.mark.parametrize("seed", range(12))
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
        elif op < 0.65 and held:  # a hit
            key = rng.choice(held[-8:] if rng.random() < 0.5 else held)
            _walk_freshen(ref, key, parent)
            freshen(lru, key, parent_of)
        elif op < 0.8 and held:  # a read of a chain deepest-first, every first, second or third key (cuts runs)
            chain = list(_chain_in_order(ref, rng.choice(held), parent))
            for key in chain[::rng.choice([1, 2, 3])]:
                _walk_freshen(ref, key, parent)
                freshen(lru, key, parent_of)
        elif held:  # a drop (corrupt entry, remove())
            key = rng.choice(held)
            assert lru.pop(key) == ref.pop(key)
        assert list(lru) == list(ref), step
        assert lru.first() == next(iter(ref), None)
    assert [(k, lru[k]) for k in lru] == list(ref.items())


def _counted_parents():
    """(parent map, [lookups], parent_of counting its calls): costs counted in lookups, not timed."""
    parent: dict[str, str] = {}
    calls = [0]

    def parent_of(k: str) -> str:
        calls[0] += 1
        return parent.get(k, "")

    return parent, calls, parent_of


def test_in_order_put_and_read_cost_o1_a_chunk():
    """Counted in parent lookups, not timed: a 4,000-chunk prompt put in order, read in order, put again as
    duplicates, and a second prompt sharing its first half."""
    parent, calls, parent_of = _counted_parents()
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


def test_a_chain_read_deepest_first_costs_o1_a_chunk():
    """A Get naming a long chain's keys deepest-first (every other one) walked the chain once a key under the
    store's lock: 26.6 ms a key at 64,000 chunks. After the first walk each key lies inside a run, and its
    stretch to the root is its chain, already in place or moved in one splice. Same order as the walk."""
    parent, calls, parent_of = _counted_parents()
    lru: ChainLRU[int] = ChainLRU()
    ref: OrderedDict[str, int] = OrderedDict()
    n = 4000
    for i in range(n):
        parent[f"a{i}"] = f"a{i - 1}" if i else ""
        lru[f"a{i}"] = ref[f"a{i}"] = i  # held, in no run: the first read walks
    lru["z"] = ref["z"] = -1
    calls[0] = 0
    for i in range(n - 1, -1, -2):
        freshen(lru, f"a{i}", parent_of)
        _walk_freshen(ref, f"a{i}", parent)
    assert calls[0] <= 2 * n + 4 * (n // 2), calls[0]  # one walk, then O(1) a key (the walk: about n * n / 4)
    assert list(lru) == list(ref)
    # two chains read deepest-first in turn: each key lies inside an older run, whose stretch from it to the root
    # moves in one splice (the walk: 4.8 ms a key at 16,000 chunks a chain)
    for i in range(n):
        parent[f"b{i}"] = f"b{i - 1}" if i else ""
        lru[f"b{i}"] = ref[f"b{i}"] = i
    calls[0] = 0
    for i in range(n - 1, n // 2, -2):
        for c in "ab":
            freshen(lru, f"{c}{i}", parent_of)
            _walk_freshen(ref, f"{c}{i}", parent)
    assert calls[0] <= 2 * n + 8 * n, calls[0]  # b's one walk, then O(1) a key
    assert list(lru) == list(ref)
    # and a prompt put on the cut chain's head in order: one walk, then O(1) a chunk again
    calls[0] = 0
    for i in range(n // 2 + 2, n // 2 + 200):
        key = f"a{i}x"
        parent[key] = f"a{i - 1}x" if i > n // 2 + 2 else f"a{n // 2 + 1}"
        freshen(lru, parent[key], parent_of)
        _walk_freshen(ref, parent[key], parent)
        lru.insert(key, i, parent_of)
        ref[key] = i
        _walk_freshen(ref, key, parent)
    assert calls[0] <= 2 * n + 4 * 400, calls[0]
    assert list(lru) == list(ref)


class _Sim:
    """A store's use of its index, as MemoryStore.put_bytes and _take do it (a duplicate put freshens its key; a
    new one freshens its parent, evicts what protected/may_evict allow, then is inserted), over ChainLRU or over
    the reference walk on an OrderedDict (ref=True). Records what each put evicted."""

    def __init__(self, budget: int, ref: bool) -> None:
        self.budget, self.ref = budget, ref
        self.index: OrderedDict[str, int] | ChainLRU[int] = OrderedDict() if ref else ChainLRU()
        self.parent: dict[str, str] = {}
        self.evicted: list[str] = []
        self.calls = 0

    def parent_of(self, k: str) -> str:
        self.calls += 1
        return self.parent.get(k, "")

    def _freshen(self, key: str) -> None:
        if self.ref:
            _walk_freshen(self.index, key, self.parent)
        else:
            freshen(self.index, key, self.parent_of)

    def put(self, key: str, parent: str) -> str:
        if key in self.index:  # a duplicate: first put wins, its prompt becomes the most recent
            self._freshen(key)
            return "present"
        self.parent[key] = parent
        self._freshen(parent)
        if self.ref:
            keep = None if parent and parent not in self.index else _chain(self.index, parent, self.parent)
        else:
            keep = protected(self.index, parent)
        while len(self.index) >= self.budget:
            if self.ref:
                allowed = keep is not None and next(iter(self.index)) not in keep
            else:
                allowed = may_evict(self.index, keep)
            if not allowed:
                self.parent.pop(key)
                return "refused"
            victim, _ = self.index.popitem(last=False)
            self.parent.pop(victim, None)
            self.evicted.append(victim)
        if self.ref:
            self.index[key] = 0
            _walk_freshen(self.index, key, self.parent)
        else:
            self.index.insert(key, 0, self.parent_of)
        return "stored"

    def hit(self, key: str) -> None:
        if key in self.index:
            self._freshen(key)


def _chains(n_chains: int, depth: int) -> list[list[tuple[str, str]]]:
    """(key, parent) of each chunk of n_chains prompts of `depth` chunks."""
    return [[(f"{c}{i}", f"{c}{i - 1}" if i else "") for i in range(depth)] for c in "abcdefgh"[:n_chains]]


def _interleaved(chains: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    return [chunk for step in zip(*chains) for chunk in step]


@pytest.mark.parametrize("budget", [10_000, 150, 61])
def test_alternating_duplicate_puts_keep_the_walks_order_and_eviction(budget):
    """Two long prompts put side by side, then put again as duplicates in turn (chunk by chunk, whole prompt by
    whole prompt, last chunk by last chunk, a third prompt's new chunks among them): the order, every put's
    outcome and every eviction are the walk's."""
    ref, lru = _Sim(budget, ref=True), _Sim(budget, ref=False)
    a, b, c = _chains(3, 80)
    rounds = [_interleaved([a, b]), _interleaved([a, b]), a + b, b + a, [a[-1], b[-1]] * 20,
              _interleaved([a, b, c]), [a[40], b[40], a[79], b[79]] * 5, _interleaved([b, a])]
    for r, ops in enumerate(rounds):
        for key, parent in ops:
            assert lru.put(key, parent) == ref.put(key, parent), (r, key)
            assert list(lru.index) == list(ref.index), (r, key)
            assert lru.evicted == ref.evicted, (r, key)
    if budget < 100:
        assert lru.evicted  # the small budgets did evict, along the prompts' tails


def test_alternating_duplicate_puts_cost_o1_a_chunk():
    """Counted in parent lookups (one a node the walk visits), not timed: two 3,000-chunk prompts put side by
    side, then put again as duplicates in turn, chunk by chunk and last chunk by last chunk. The single
    remembered chain made each such put walk its prompt: about n * n lookups a round."""
    n = 3000
    sim = _Sim(1 << 30, ref=False)
    a, b = _chains(2, n)
    for key, parent in _interleaved([a, b]):
        sim.put(key, parent)
    stored = sim.calls
    for _ in range(3):
        for key, parent in _interleaved([a, b]):
            assert sim.put(key, parent) == "present"
    for _ in range(n):
        sim.put(a[-1][0], a[-2][0])
        sim.put(b[-1][0], b[-2][0])
    touches = 2 * n + 3 * 2 * n + 2 * n
    assert stored <= 4 * 2 * n, stored
    assert sim.calls - stored <= 3 * touches, sim.calls - stored
    assert list(sim.index)[-2:] == ["b1", "b0"] and sim.index.first() == "a2999"


@pytest.mark.parametrize("seed", range(4))
def test_interleaved_prompts_keep_the_walks_order(seed):
    """Random puts that extend one of several prompts (as clients' streams do side by side), duplicates, hits,
    drops and late-learned parents: the order and the eviction rule stay the walk's."""
    rng = random.Random(seed)
    ref, lru = _Sim(45, ref=True), _Sim(45, ref=False)
    tips = [""] * 4
    serial = 0
    for step in range(2500):
        op = rng.random()
        if op < 0.5:  # the next chunk of a prompt (a new prompt now and then)
            j = rng.randrange(len(tips))
            if rng.random() < 0.05:
                tips[j] = ""
            key, serial = f"k{serial}", serial + 1
            got = ref.put(key, tips[j])
            assert lru.put(key, tips[j]) == got, step
            if got == "stored":
                tips[j] = key
        elif op < 0.8 and ref.index:  # a duplicate put or a hit
            key = rng.choice(list(ref.index)[-10:] if rng.random() < 0.5 else list(ref.index))
            assert lru.put(key, ref.parent.get(key, "")) == ref.put(key, ref.parent.get(key, "")) == "present"
        elif op < 0.95 and ref.index:  # a drop (corrupt entry, remove())
            key = rng.choice(list(ref.index))
            for sim in (ref, lru):
                sim.index.pop(key)
                sim.parent.pop(key, None)
        elif ref.index:  # a held key's parent learned late (the disk tier), here a loop now and then
            key, new = rng.choice(list(ref.index)), rng.choice(list(ref.index))
            ref.parent[key] = lru.parent[key] = new
            lru.index.forget_chain()
        assert list(lru.index) == list(ref.index), step
        assert lru.evicted == ref.evicted, step


class _Payload:
    """A value that can be watched with a weak reference (a chunk's bytes or tensors, in a store)."""


@pytest.mark.parametrize("seed", range(3))
def test_an_evicted_or_dropped_value_is_freed_without_a_garbage_collection(seed):
    """Nodes lie in reference cycles (neighbours, runs): an evicted one that kept pointing into them held its value
    until a full collection, which a serving process rarely runs (a bridge's memory tier grew far past its
    budget). With the collector off, each value must die once the index and the caller let it go."""
    import gc
    import weakref

    rng = random.Random(seed)
    lru: ChainLRU[_Payload] = ChainLRU()
    parent: dict[str, str] = {}
    gone: list[weakref.ref] = []
    gc.collect()
    gc.disable()
    try:
        for i in range(600):
            key = f"k{i}"
            held = list(lru)
            parent[key] = rng.choice(held[-5:]) if held and rng.random() < 0.8 else ""
            lru.insert(key, _Payload(), lambda k: parent.get(k, ""))
            if held and rng.random() < 0.3:  # a hit inside a chain (cuts a run)
                freshen(lru, rng.choice(held), lambda k: parent.get(k, ""))
            while len(lru) > 20:  # a budget: evict the least recent
                gone.append(weakref.ref(lru.popitem(last=False)[1]))
            if held and rng.random() < 0.1:  # a drop (a corrupt entry)
                victim = rng.choice(list(lru))
                gone.append(weakref.ref(lru.pop(victim)))
        alive = sum(r() is not None for r in gone)
    finally:
        gc.enable()
    assert len(gone) > 500
    assert alive == 0, f"{alive} of {len(gone)} evicted values still alive without a collection"
