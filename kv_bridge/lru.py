"""The recency index every store tier keeps: an LRU-ordered mapping whose freshen(key) makes the key, then each
held chunk before it in its prompt, the most recently used (store.freshen says why).

An OrderedDict could only do that by moving the whole chain to the end on every touch, which made a prompt of N
chunks cost O(N^2) to put or read in order, under the store's lock (a client could build chains of thousands of
tiny chunks). Here the order is a linked list, and the index remembers which key's chain is already the MRU tail
in order: touching the next chunk of that prompt (a put or read in prompt order, the common case) inserts it just
before its parent in O(1). Any other touch walks the chain once."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

V = TypeVar("V")
_MISSING = object()


class _Node:
    __slots__ = ("key", "value", "prev", "next")

    def __init__(self, key: str, value: object) -> None:
        self.key, self.value = key, value
        self.prev: _Node | None = None
        self.next: _Node | None = None


class ChainLRU(Generic[V]):
    """The subset of OrderedDict the stores use (least recently used first), plus freshen(key, parent_of)."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._root = _Node("", None)  # sentinel: root.next is the LRU entry, root.prev the MRU one
        self._root.prev = self._root.next = self._root
        self._head: str | None = None  # the key whose held chain is the MRU tail, in order (freshen)
        self._tail_keys: set[str] = set()  # that chain's keys

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
        """A new key becomes the most recent (OrderedDict's rule); an existing one keeps its place."""
        n = self._nodes.get(key)
        if n is not None:
            n.value = value
            return
        n = self._nodes[key] = _Node(key, value)
        self._link_before(n, self._root)
        self._forget_tail()

    def insert(self, key: str, value: V, parent_of: Callable[[str], str]) -> None:
        """A new key, freshened (as a put does): O(1) when its parent's chain is the MRU tail."""
        if key in self._nodes:
            raise KeyError(f"{key} is already held")
        n = self._nodes[key] = _Node(key, value)
        self._link_before(n, self._root)  # the tail stays known: freshen moves the key before its parent
        self.freshen(key, parent_of)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def pop(self, key: str, default: object = _MISSING) -> V | object:
        n = self._nodes.pop(key, None)
        if n is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._unlink(n)
        if key in self._tail_keys:
            self._forget_tail()
        return n.value

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
        a prompt's first), become the most recently used, the first chunk last. A parent loop stops the walk."""
        if key not in self._nodes or key == self._head:
            return
        parent = parent_of(key)
        if parent and parent == self._head:  # the parent's chain is the MRU tail, in order: key goes before it
            n = self._nodes[key]
            self._unlink(n)
            self._link_before(n, self._nodes[parent])
            self._head = key
            self._tail_keys.add(key)
            return
        walk: list[str] = []
        seen: set[str] = set()
        k = key
        while k and k in self._nodes and k not in seen:
            seen.add(k)
            walk.append(k)
            k = parent_of(k)
        for k in walk:
            n = self._nodes[k]
            self._unlink(n)
            self._link_before(n, self._root)
        self._head, self._tail_keys = key, seen

    def forget_chain(self) -> None:
        """A held key's parent changed (a store learned it late): the next freshen walks its chain again."""
        self._forget_tail()

    # -- the list -----------------------------------------------------------------------------------
    def _forget_tail(self) -> None:
        self._head = None
        if self._tail_keys:
            self._tail_keys = set()

    @staticmethod
    def _unlink(n: _Node) -> None:
        n.prev.next, n.next.prev = n.next, n.prev

    @staticmethod
    def _link_before(n: _Node, at: _Node) -> None:
        n.prev, n.next = at.prev, at
        at.prev.next = n
        at.prev = n
