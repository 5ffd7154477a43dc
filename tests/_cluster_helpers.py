"""Shared pieces of the service tests (test_cluster_*.py): configs over the trained fixture pair,
the prompts, a colocated reference run through a real server, and bounded waits. Not a test module."""
from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from flashpd.cluster.config import ServeConfig
from flashpd.cluster.generation_client import GenerationClient
from flashpd.cluster.service import start_service

try:
    from tests._dflash_helpers import dflash_pair  # noqa: F401  (session fixture, re-exported)
except ImportError:  # plain `pytest`: tests/ itself is on sys.path
    from _dflash_helpers import dflash_pair  # type: ignore[no-redef]  # noqa: F401

WAIT_S = 60.0  # bound on every wait in these tests
N_PROMPTS = 32


def serve_cfg(pair, mode: str, **kw) -> ServeConfig:
    """CPU float32 service over the fixture pair; 32-token bridge chunks so prompts of 40-200 tokens hit."""
    base = dict(target=str(pair.target_dir), draft=str(pair.draft_dir), mode=mode, device="cpu", dtype="float32",
                kv_cache_tokens=8192, chunk_tokens=32, torch_threads=1, health_interval_s=0.5,
                health_timeout_s=3.0, health_failures=3, start_timeout_s=180.0, bridge_timeout_s=5.0)
    base.update(kw)
    return ServeConfig(**base)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(606)
    return [torch.randint(0, 126, (int(n),), generator=g).tolist() for n in torch.randint(20, 200, (N_PROMPTS,),
                                                                                        generator=g)]


def request_kw(i: int) -> dict:
    """Request i of the shared set: mostly DFlash (acceptance matters), every third native."""
    return dict(max_tokens=16 + i % 9, method="native" if i % 3 == 0 else "dflash", ignore_eos=True)


def stream_chunks(client: GenerationClient, prompt: list[int], **kw) -> tuple[list[int], object]:
    """All tokens of a streamed request and its final chunk (nothing may follow it)."""
    toks, last = [], None
    for c in client.generate(prompt, **kw):
        assert last is None, "chunk after the final one"
        toks.extend(c.token_ids)
        if c.finished:
            last = c
    assert last is not None, "stream ended without a finished chunk"
    return toks, last


def stream(client: GenerationClient, prompt: list[int], **kw) -> tuple[list[int], dict]:
    toks, last = stream_chunks(client, prompt, **kw)
    return toks, last.stats


def run_concurrently(address: str, idx: list[int], ps: list[list[int]], timeout_s: float = 120.0
                     ) -> dict[int, tuple[list[int], list[int]]]:
    """Stream requests idx at once, one client thread each; (tokens, acceptance lengths) per request."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(idx), timeout=WAIT_S)

    def one(i: int, client: GenerationClient) -> None:
        try:
            start.wait()
            toks, stats = stream(client, ps[i], **request_kw(i))
            out[i] = (toks, stats["acceptance_lengths"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with GenerationClient(address, timeout_s=timeout_s) as client:
        threads = [threading.Thread(target=one, args=(i, client), daemon=True) for i in idx]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster. Ray gives its raylet a fixed 30 s to register; on a 2-core machine whose other test
    worker is starting a service's processes it once took longer (a CI failure): then what that start left is
    killed and it is tried once more."""
    import psutil  # noqa: PLC0415

    ray = pytest.importorskip("ray")
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False,
                     object_store_memory=128 << 20)
            break
        except Exception as e:
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            for c in psutil.Process().children(recursive=True):
                if c.pid not in before:
                    c.kill()
            ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def colocated_reference(dflash_pair):  # noqa: F811
    """(a) colocated: every shared request through a real colocated server."""
    svc = start_service(serve_cfg(dflash_pair, "colocated"))
    try:
        ps = prompts()
        ref = run_concurrently(svc.address, list(range(N_PROMPTS)), ps)
    finally:
        svc.stop()
    assert any(len(set(acc)) > 1 for _, acc in ref.values()), "the pair should accept non-trivially"
    return ps, ref


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = WAIT_S, every_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


class Streamer:
    """A long request streamed on a thread; tells how many tokens arrived and how it ended."""

    def __init__(self, address: str, prompt: list[int], **kw) -> None:
        self.tokens: list[int] = []
        self.stats: dict | None = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(address, prompt, kw), daemon=True)
        self._t.start()

    def _run(self, address, prompt, kw) -> None:
        try:
            with GenerationClient(address, timeout_s=120) as c:
                for ch in c.generate(prompt, **kw):
                    self.tokens.extend(ch.token_ids)
                    if ch.finished:
                        self.stats = ch.stats
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def join(self) -> None:
        self._t.join(150)
        assert not self._t.is_alive(), "a client hung"


def busy_decode_slot(pool, exclude=()):
    """The one decode slot with a request in flight (other than `exclude`)."""
    busy = [s for s in pool.slots["decode"] if s.inflight > 0 and s not in exclude]
    assert len(busy) == 1, [(s.index, s.inflight) for s in pool.slots["decode"]]
    return busy[0]
