"""bench/closed_loop.py on the CPU: the engine alone under a closed loop, with and without a session hold (the
demo pair, float32). Every request's tokens arrive, no block leaks, and the JSON states what ran."""
from __future__ import annotations

import json

import pytest

from flashpd.bench.closed_loop import main


def test_closed_loop_bench_runs_both_holds(tmp_path):
    out = tmp_path / "cl.json"
    main(["--concurrency", "4", "--methods", "dflash", "--hold-fractions", "0,1", "--requests", "8",
          "--max-tokens", "8", "--prompt-pool", "8", "--prompt-tokens", "16", "--rounds", "1", "--device", "cpu",
          "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["bench"] == "closed_loop" and d["warmup"] is None and "--hold-fractions 0,1" in d["command"]
    rows = {r["hold_fraction"]: r["rounds"][0] for r in d["results"]}
    for r in rows.values():
        assert r["tokens"] == 8 * 8 and r["requests"] == 8 and r["tau"] >= 1
    assert rows[0.0]["end_wait_steps"]["max"] == 0 and rows[1.0]["end_wait_steps"]["max"] <= 4
    assert rows[1.0]["sessions_ended"] <= rows[0.0]["sessions_ended"]


def test_closed_loop_bench_samples_when_asked(tmp_path, monkeypatch):
    """--temperature / --top-p / --top-k reach every request the scheduler admits (and the JSON's settings); a bad
    value is refused before any model loads."""
    from flashpd.decode_node.scheduler import Scheduler

    seen, seeds = [], []
    orig = Scheduler.add

    def add(self, prompt, params, method="native", *a, **kw):
        seen.append((params.temperature, params.top_p, params.top_k, method))
        seeds.append(params.seed)
        return orig(self, prompt, params, method, *a, **kw)

    monkeypatch.setattr(Scheduler, "add", add)
    out = tmp_path / "cl.json"
    main(["--concurrency", "2", "--methods", "native,dflash", "--requests", "4", "--max-tokens", "3",
          "--prompt-pool", "4", "--prompt-tokens", "16", "--rounds", "1", "--device", "cpu", "--temperature", "0.7",
          "--top-p", "0.9", "--top-k", "20", "--out", str(out)])
    d = json.loads(out.read_text())
    assert (d["settings"]["temperature"], d["settings"]["top_p"], d["settings"]["top_k"]) == (0.7, 0.9, 20)
    for r in d["results"]:
        row = r["rounds"][0]
        assert row["tokens"] == 4 * 3 and row["graphs_captured"] == 0  # the CPU captures no graph
    assert sorted(set(seen)) == [(0.7, 0.9, 20, "dflash"), (0.7, 0.9, 20, "native")] and len(seen) == 8, seen
    assert None not in seeds and len(set(seeds[:4])) == 4  # a seed a prompt: the rounds sample alike
    with pytest.raises(SystemExit, match="top_p"):
        main(["--top-p", "1.5", "--target", str(tmp_path / "absent"), "--out", str(tmp_path / "x.json")])
