"""What a store's recency index costs a read, by the order a client names a chain's keys.

    python -m flashpd.bench.lru_reads --out bench/results/lru_reads_cpu.json

A `MemoryStore` holds chains of tiny valid chunks (each naming the one before it as its parent, as a prompt's
chunks do); a read is `get_bytes(key)`, which freshens the key's chain under the store's lock. Orders, each over
`--reads` keys: root-first (a prompt read in order), deepest-first every other key (what one Get may name), and two
chains deepest-first in turn. A client could once make every deepest-first read walk the chain to its root
(O(N^2) a Get); the figure to watch is ms a read against the chain's length.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from flashpd.bench.common import write_json
from flashpd.kv_bridge.auth import ClusterSecret
from flashpd.kv_bridge.chunk import KVChunk
from flashpd.kv_bridge.store import MemoryStore


def _store(chains: list[str], n: int) -> MemoryStore:
    store = MemoryStore(1 << 30, ClusterSecret.generate())
    kv = torch.zeros(1, 2, 1, 1, 1, dtype=torch.bfloat16)  # the smallest valid payload
    for c in chains:
        for i in range(n):
            store.put(KVChunk(f"{c}{i}", f"{c}{i - 1}" if i else "", "bench", [i], kv, None))
    return store


def _timed(store: MemoryStore, keys: list[str]) -> float:
    t0 = time.perf_counter()
    for k in keys:
        store.get_bytes(k)
    return (time.perf_counter() - t0) / len(keys) * 1e3


def run(n: int, reads: int) -> dict:
    reads = min(reads, n // 2)
    out = {"chain_chunks": n, "reads": reads}
    out["root_first_ms"] = _timed(_store(["a"], n), [f"a{i}" for i in range(reads)])
    out["deepest_first_ms"] = _timed(_store(["a"], n), [f"a{n - 1 - 2 * j}" for j in range(reads)])
    out["two_chains_in_turn_ms"] = _timed(_store(["a", "b"], n),
                                          [f"{c}{n - 1 - 2 * j}" for j in range(reads // 2) for c in "ab"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chains", default="4000,16000,64000", help="chain lengths (chunks), comma-separated")
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = []
    for n in (int(x) for x in a.chains.split(",")):
        rows.append(run(n, a.reads))
        print(rows[-1], flush=True)
    write_json(a.out, {"bench": "lru_reads", "command": "python -m flashpd.bench.lru_reads " +
                       shlex.join(argv if argv is not None else sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
