"""Caches sized past all of the machine's memory are refused by name at start (engine/factory.check_fits), not
left to an allocator's traceback or, for the pinned host tier, to grow until the machine runs out of memory (a
review: 13.9 GB in 49 s of a start that never ended). The shipped demo pair's real files, on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flashpd.demo import PAIR
from flashpd.engine.factory import check_fits, load_engine, memory_bytes


def test_a_kv_cache_past_the_machines_memory_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_tokens: .* GiB, more than the .* GiB cpu memory"):
        load_engine(str(PAIR / "target"), device="cpu", kv_cache_tokens=2 ** 31)
    with pytest.raises(ValueError, match=r"kv_block_size: .* GiB"):  # two blocks of a billion positions
        load_engine(str(PAIR / "target"), device="cpu", kv_block_size=10 ** 9)
    parts = load_engine(str(PAIR / "target"), device="cpu", kv_cache_tokens=4096)  # what fits still loads
    assert parts.runner is not None


def test_check_fits_compares_with_all_of_the_devices_memory():
    total = memory_bytes(torch.device("cpu"))
    assert total > 0
    check_fits("x", total, torch.device("cpu"))
    with pytest.raises(ValueError, match="x: "):
        check_fits("x", total + 1, torch.device("cpu"))


@pytest.mark.parametrize("key", ["host_cache_bytes", "device_cache_bytes"])
def test_serve_refuses_a_local_tier_past_the_machines_memory_in_one_line(tmp_path, key):
    cfg = {"target": str(PAIR / "target"), "device": "cpu", key: 10 ** 30}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "flashpd.cli", "serve", str(tmp_path / "c.json")],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    assert f"flashpd: error: {key}: " in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
