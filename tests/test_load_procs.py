"""bench/load_procs.py without a server: how streams are split over client processes, and a client process
that fails marks its requests failed while the run still ends (spawned processes, real queues)."""
from __future__ import annotations

import pytest

from flashpd.bench.job_sweep import STREAMS_PER_CLIENT_PROC, client_procs
from flashpd.bench.load_procs import run_in_procs, split


def test_split_and_auto_processes():
    assert split(128, 4) == [32] * 4 and split(10, 3) == [4, 3, 3] and split(2, 8) == [1, 1]
    assert sum(split(129, 4)) == 129
    assert client_procs(0, 1) == 1 and client_procs(0, STREAMS_PER_CLIENT_PROC) == 1
    assert client_procs(0, 128) == 128 // STREAMS_PER_CLIENT_PROC and client_procs(3, 2) == 2


class _Echo:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def echo_clients(target, timeout_s, request_kw):
    """A stand-in request: the prompt back as tokens (module level: a spawned process imports it)."""
    if target == "no-start":
        raise ConnectionError("cannot connect")

    def one(c, prompt, r):
        if target == "raise" and prompt[0] == 3:
            raise RuntimeError("bad stream")
        r.tokens = list(prompt) * request_kw["times"]
        r.ttft_ms, r.latency_ms = 0.1, 0.2
    return _Echo, one


def test_every_prompt_once_in_order():
    prompts = [[i] for i in range(40)]
    res, wall = run_in_procs(echo_clients, "ok", prompts, 6, 3, 30.0, {"times": 2})
    assert wall > 0 and [r.index for r in res] == list(range(40))
    assert all(r.error is None and r.tokens == [r.index] * 2 for r in res)


def test_a_request_whose_client_raises_fails_alone():
    prompts = [[i] for i in range(8)]
    res, _ = run_in_procs(echo_clients, "raise", prompts, 2, 2, 10.0, {"times": 1})
    assert [r.index for r in res if r.error is not None] == [3]
    assert res[3].error == "client error: RuntimeError: bad stream"
    assert all(r.tokens == [r.index] for r in res if r.index != 3)


def test_a_client_process_that_cannot_start_fails_the_run():
    with pytest.raises(RuntimeError, match="failed to start: ConnectionError: cannot connect"):
        run_in_procs(echo_clients, "no-start", [[1], [2]], 2, 2, 10.0, {"times": 1})
