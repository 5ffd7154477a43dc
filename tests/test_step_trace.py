"""bench/step_trace.py's split of a profiled DFlash step (the trace itself needs a GPU; the split does not)."""
from __future__ import annotations

import pytest

from flashpd.bench.step_trace import parts, split_steps


def _step(t0: float) -> list[tuple[str, float, float]]:
    names = ["triton_poi_fused_0", "skinny", "_attn_kernel", "head", "_chunk_kernel", "_merge_kernel", "skinny",
             "_chunk_kernel", "_merge_kernel", "triton_poi_fused_0", "Memcpy DtoH (Device -> Pinned)"]
    return [(n, t0 + 10 * i, t0 + 10 * i + 4) for i, n in enumerate(names)]


def test_steps_end_at_the_result_copy_and_the_draft_ends_at_its_argmax():
    kernels = _step(1000.0) + _step(0.0)  # out of order: sorted by start
    steps = split_steps(kernels)
    assert [s[0][1] for s in steps] == [0.0, 1000.0] and [len(s) for s in steps] == [11, 11]
    p = parts(steps[0])
    assert p["draft"]["kernels"] == 6 and p["verify"]["kernels"] == 5  # a tail kernel sharing the first's name
    assert p["draft"]["span_ms"] == pytest.approx(0.054) and p["draft"]["busy_ms"] == pytest.approx(0.024)
    assert p["gap_ms"] == pytest.approx(0.006) and p["step_span_ms"] == pytest.approx(0.104)
    assert p["verify"]["list"][0] == {"name": "skinny", "start_us": 60.0, "us": 4.0}


def test_pieces_without_a_whole_step_are_dropped_and_none_is_refused():
    cut = _step(0.0) + _step(1000.0)[:5]  # the trace ends inside a step: that piece is dropped
    assert [len(s) for s in split_steps(cut)] == [11]
    with pytest.raises(ValueError, match="no whole step"):
        split_steps(_step(0.0)[:5])
    with pytest.raises(ValueError, match="_merge_kernel"):
        parts([("a", 0.0, 1.0), ("b", 2.0, 3.0)])
