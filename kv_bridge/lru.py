"""The recency index every store tier keeps: an LRU-ordered mapping whose freshen(key) makes the key, then each
held chunk before it in its prompt, the most recently used (store.freshen says why).

An OrderedDict could only do that by moving the whole chain to the end on every touch, which made a prompt of N
chunks cost O(N^2) to put or read in order, under the store's lock (a client could build chains of thousands of
tiny chunks). Here the order is a linked list, and the index remembers runs: a run is a held chain (a key, its
parent, ... up to the chain's first held chunk) that lies in the list as one contiguous stretch, in that order.
Any number of runs are remembered, one per prompt touched in order, so touching a run's first key moves the
whole stretch to the MRU end in O(1), and touching the next chunk of a run's prompt (a put or read in prompt
order) inserts it just before its parent in O(1): prompts put or read side by side, chunk by chunk (two clients'
streams, duplicate puts of two long chains in turn) stay O(1) a chunk when they share no held prefix. (Two that
share one, put side by side, walk that prefix a chunk: one run cannot hold it for both.) A touch inside a run (a
chain read deepest-first, or two read so in turn) moves the stretch from it to the run's root, which is its chain,
in one splice; the run is then cut there (`_Run.cut`). A walk is left for chains no run holds whole: a chunk put or
read after its chain changed, a parent loop, a chunk put on a cut run's head (once: the walk makes a new run)."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

V = TypeVar("V")
_MISSING = object()


class _Node:
    __slots__ = ("key", "value", "prev", "next", "run", "depth")

    def __init__(self, key: str, value: object) -> None:
        self.key, self.value = key, value
        self.prev: _Node | None = None
        self.next: _Node | None = None
        self.run: _Run | None = None  # the run this node lies in, if it still does (ChainLRU._run_of)
        self.depth = 0  # within its run: the root's + 1 a chunk toward the head


class _Run:
    """A contiguous stretch head .. root of the list, each node's next its parent's node: the held chain of head.
    head is None once the run is dead (a node left it in the middle, or the chains changed). `cut`: a touch
    inside it moved head .. root away from the nodes that lay before head, which still name this run but deeper
    than head: no longer members (ChainLRU._run_of), and the run grows no more at its head."""
    __slots__ = ("head", "root", "epoch", "cut")

    def __init__(self, head: _Node, root: _Node, epoch: int) -> None:
        self.head: _Node | None = head
        self.root = root
        self.epoch = epoch
        self.cut = False


class ChainLRU(Generic[V]):
    """The subset of OrderedDict the stores use (least recently used first), plus freshen(key, parent_of)."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._root = _Node("", None)  # sentinel: root.next is the LRU entry, root.prev the MRU one
        self._root.prev = self._root.next = self._root
        self._epoch = 0  # bumped by forget_chain: every run of an older epoch is dead

    # -- the mapping ------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __bool__(self) -> bool:
        return bool(self._nodes)

    def __iter__(self) -> Iterator[str]:
        n = self._root.next
        while n is not self._root:
            nxt = n.next
            yield n.key
            n = nxt

    def __getitem__(self, key: str) -> V:
        return self._nodes[key].value

    def get(self, key: str, default: object = None) -> V | object:
        n = self._nodes.get(key)
        return default if n is None else n.value

    def __setitem__(self, key: str, value: V) -> None:
        """A new key becomes the most recent (OrderedDict's rule); an existing one keeps its place. A new key goes
        after every run's stretch, so it splits none (a run it completes fails _closed and is walked again)."""
        n = self._nodes.get(key)
        if n is not None:
            n.value = value
            return
        n = self._nodes[key] = _Node(key, value)
        self._link_before(n, self._root)

    def insert(self, key: str, value: V, parent_of: Callable[[str], str]) -> None:
        """A new key, freshened (as a put does): O(1) when its parent starts a run."""
        if key in self._nodes:
            raise KeyError(f"{key} is already held")
        self[key] = value
        self.freshen(key, parent_of)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def pop(self, key: str, default: object = _MISSING) -> V | object:
        n = self._nodes.pop(key, None)
        if n is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._leave_run(n)
        self._unlink(n)
        value = n.value
        # a node lies in reference cycles (its neighbours, its run's head or root): unlinked but still pointing
        # into them, an evicted node and its value (a chunk's bytes, a device chunk's tensors) waited for a full
        # garbage collection, which a serving process rarely runs (a bridge grew far past its byte budget)
        n.prev = n.next = n.run = n.value = None
        return value

    def popitem(self, last: bool = True) -> tuple[str, V]:
        if not self._nodes:
            raise KeyError("popitem(): the index is empty")
        key = (self._root.prev if last else self._root.next).key
        return key, self.pop(key)

    def first(self) -> str | None:
        """The least recently used key (None when empty)."""
        return self._root.next.key if self._nodes else None

    # -- recency along prompts ------------------------------------------------------------------------
    def freshen(self, key: str, parent_of: Callable[[str], str]) -> None:
        """key, then each held chunk before it in its prompt (parent_of(k): the key of the chunk before k, "" for
        a prompt's first), become the most recently used, the first chunk last. A parent loop stops the walk.
        O(1) when key starts a run, or its parent does; else one walk of the chain."""
        n = self._nodes.get(key)
        if n is None:
            return
        run = self._run_of(n)
        if run is not None and run.head is n and self._closed(run, parent_of):
            self._to_end(run)
            return
        if run is not None and self._ends(run, parent_of):
            # n lies inside the run, and n .. root is its whole held chain, in order: that stretch moves to the MRU
            # end in one splice (reads of a long chain deepest-first walked it once a key: O(N^2))
            if run.root.next is not self._root:
                self._splice_to_end(n, run.root)
                run.head, run.cut = n, True
            return
        parent = parent_of(key)
        pn = self._nodes.get(parent) if parent else None
        prun = self._run_of(pn) if pn is not None else None
        if prun is not None and prun is not run and prun.head is pn and not prun.cut and \
                self._closed(prun, parent_of):
            if run is not None:  # n leaves a run it does not start (or one that no longer holds its chain)
                run.head = None
            self._unlink(n)
            self._to_end(prun)
            self._link_before(n, pn)
            prun.head, n.run, n.depth = n, prun, pn.depth + 1
            return
        self._walk(key, parent_of)

    def forget_chain(self) -> None:
        """A held key's parent changed (a store learned it late): every run is dropped, the next freshen of
        each chain walks it again."""
        self._epoch += 1

    # -- runs ---------------------------------------------------------------------------------------
    def _live(self, run: _Run | None) -> _Run | None:
        return run if run is not None and run.head is not None and run.epoch == self._epoch else None

    def _run_of(self, n: _Node) -> _Run | None:
        """The live run n lies in, if any (a cut run's nodes deeper than its head no longer do)."""
        run = self._live(n.run)
        if run is not None and run.cut and n.depth > run.head.depth:
            return None
        return run

    def _closed(self, run: _Run, parent_of: Callable[[str], str]) -> bool:
        """Whether the run still ends where its head's chain does: its root's parent is not held (a prompt's
        first chunk, or one evicted), or lies in the run itself (a parent loop, where the walk stops too). A key
        inserted since may be that parent: then the chain is longer than the run and is walked again."""
        parent = parent_of(run.root.key)
        pn = self._nodes.get(parent) if parent else None
        return pn is None or self._run_of(pn) is run

    def _ends(self, run: _Run, parent_of: Callable[[str], str]) -> bool:
        """Whether the run's root is where every member's chain ends: its parent is not held (in a parent loop the
        chain of a member goes on past the root, into the run again)."""
        parent = parent_of(run.root.key)
        return not parent or parent not in self._nodes

    def _walk(self, key: str, parent_of: Callable[[str], str]) -> None:
        """Move key's held chain to the MRU end one node at a time; it becomes a run. Runs it cut are dropped."""
        walk: list[_Node] = []
        seen: set[str] = set()
        k = key
        while k and k not in seen and (n := self._nodes.get(k)) is not None:
            seen.add(k)
            walk.append(n)
            k = parent_of(k)
        if not walk:  # key "" names no chunk
            return
        for old in [self._run_of(n) for n in walk]:  # (membership reads depths: before they change)
            if old is not None:
                old.head = None
        run = _Run(walk[0], walk[-1], self._epoch)
        for depth, n in enumerate(reversed(walk)):
            self._unlink(n)
            n.run, n.depth = run, depth
        for n in walk:
            self._link_before(n, self._root)

    def _to_end(self, run: _Run) -> None:
        """Splice the run's stretch to the MRU end: O(1). No other run lies inside it, so none is cut."""
        self._splice_to_end(run.head, run.root)

    def _splice_to_end(self, first: _Node, last: _Node) -> None:
        """Move the stretch first .. last of the list to the MRU end: O(1)."""
        if last.next is self._root:
            return
        first.prev.next, last.next.prev = last.next, first.prev
        first.prev, last.next = self._root.prev, self._root
        self._root.prev.next = first
        self._root.prev = last

    def _leave_run(self, n: _Node) -> None:
        """n leaves the index: its run keeps the rest when n is an end of it (an eviction takes a run's head, the
        least recent of it), else the run is dropped."""
        run = self._run_of(n)
        if run is None:
            return
        if run.head is n and run.root is not n:
            run.head = n.next  # n's parent: the chain of what is left
        elif run.root is n and run.head is not n:
            run.root = n.prev  # the chain now stops there (n is not held)
        else:
            run.head = run.root = None  # dead: it keeps no node alive either

    # -- the list -----------------------------------------------------------------------------------
    @staticmethod
    def _unlink(n: _Node) -> None:
        n.prev.next, n.next.prev = n.next, n.prev

    @staticmethod
    def _link_before(n: _Node, at: _Node) -> None:
        n.prev, n.next = at.prev, at
        at.prev.next = n
        at.prev = n
