"""bench/project_8b.py on small synthetic inputs: the formula per prompt, both step-JSON formats, the
headline's choice (a 64-token confirmation at the step costs' width), and the quoted reference figures."""
from __future__ import annotations

import json
import math

import pytest

from flashpd.bench import project_8b


def _speedup() -> dict:
    def sec(width, new_tokens, taus, reps=3):
        return {"width": width, "new_tokens": new_tokens, "reps": reps, "geomean_speedup": 1.5,
                "prompts": [{"prompt": i, "tau": t} for i, t in enumerate(taus)]}
    return {"target": "t", "draft": "d", "git": "abc", "batch": 1,
            "screen": [sec(4, 64, [9.0], 1), sec(16, 64, [2.0, 8.0], 1)],
            "confirm": [sec(16, 256, [4.0, 4.0]), sec(16, 64, [1.0, 4.0])]}


def test_projection_of_synthetic_inputs(tmp_path):
    sp, kern, flat = tmp_path / "sp.json", tmp_path / "kern.json", tmp_path / "flat.json"
    sp.write_text(json.dumps(_speedup()))
    kern.write_text(json.dumps({"config": "qwen3-8b", "context": 512, "kernels": {
        "target_step": {"median_ms": 6.0}, "verify16": {"median_ms": 6.0}, "draft16": {"median_ms": 2.0}}}))
    flat.write_text(json.dumps({"native_step_ms_b1": 5.0, "dflash_step_ms_b1": 10.0}))
    out = tmp_path / "p.json"
    assert project_8b.main(["--speedup", str(sp), "--steps", str(kern), "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "projection" and "not a measurement" in d["label"].lower() and d["git"]
    assert d["native_over_dflash_step"] == pytest.approx(0.75) and d["step_costs"]["format"] == "dflash_step"
    assert [(r["section"], r["new_tokens"]) for r in d["projections"]] == [("confirm", 256), ("confirm", 64),
                                                                            ("screen", 64)]
    h = d["headline"]
    assert (h["section"], h["new_tokens"]) == ("confirm", 64)
    assert h["projected_geomean_speedup"] == pytest.approx(0.75 * math.sqrt(1.0 * 4.0))  # tau x ratio, geomean
    assert d["beside"]["seed"]["geomean_speedup"] == 2.154 and "2.154" in d["beside"]["seed"]["quote"]
    gsm = d["beside"]["published"]["figures"][0]
    assert gsm["dataset"] == "GSM8K" and gsm["projected_here_at_this_tau"] == pytest.approx(6.55 * 0.75)
    assert d["inputs"] == {"speedup": str(sp), "steps": str(kern)} and d["formula"] and d["assumptions"]
    p = project_8b.project(_speedup(), json.loads(flat.read_text()), width=16)
    assert p["step_costs"]["format"] == "speed_8b" and p["native_over_dflash_step"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no section at width 8"):
        project_8b.project(_speedup(), json.loads(flat.read_text()), width=8)
    with pytest.raises(ValueError, match="step JSON"):
        project_8b.project(_speedup(), {"kernels": {}}, width=16)
