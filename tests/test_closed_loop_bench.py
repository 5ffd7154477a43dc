"""bench/closed_loop.py on the CPU: the engine alone under a closed loop, with and without a session hold (the
demo pair, float32). Every request's tokens arrive, no block leaks, and the JSON states what ran."""
from __future__ import annotations

import json

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
