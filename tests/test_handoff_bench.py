"""bench/handoff.py on the CPU (torch shared memory standing in for CUDA IPC): a second process imports each lease
bit-exact and the JSON states what ran. Its child had unpacked the importer's mappings in an older shape and failed
on its first import, with no test to say so."""
from __future__ import annotations

import json

from flashpd.bench.handoff import main


def test_handoff_bench_imports_every_lease_exactly_in_another_process(tmp_path):
    out = tmp_path / "handoff.json"
    assert main(["--config", "tiny", "--tokens", "256", "--reps", "3", "--device", "cpu", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["exact"] == "4/4" and len(d["import_ms"]) == 3 and d["bytes_per_handoff"] > 0
    assert d["device"] == "cpu" and "--reps 3" in d["command"]
