"""bench/engine_hop.py on the CPU (the demo pair, float32): both backends serve every request, with the same tokens,
and the JSON states what ran and how long each step of the path took."""
from __future__ import annotations

import json

from flashpd.bench.engine_hop import main


def test_engine_hop_bench_times_both_forms_with_the_same_tokens(tmp_path):
    out = tmp_path / "hop.json"
    main(["--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "2048", "--requests", "3",
          "--prompt-tokens", "12", "--max-tokens", "6", "--rounds", "1", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["bench"] == "engine_hop" and "--requests 3" in d["command"]
    assert d["same_tokens"] == "6/6"  # 3 prompts x 2 methods x 1 round, identical in both forms
    forms = {(r["method"], r["form"]) for r in d["rows"]}
    assert forms == {(m, f) for m in ("native", "dflash") for f in ("in_process", "engine_process")}
    for r in d["rows"]:
        assert r["requests"] == 3 and 0 < r["taken_ms_p50"] <= r["first_token_ms_p50"] <= r["done_ms_p50"]
    assert set(d["summary"]) == {f"{m} {f}" for m in ("native", "dflash") for f in ("in_process", "engine_process")}
