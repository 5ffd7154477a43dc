"""The speedup bench every headline figure comes from, run small on the CPU (float32) with the shipped demo pair:
its JSON must follow experiments.md (disjoint screen and confirmation sets with a 2,000+ token prompt each, the
screen's best width confirmed, per-prompt medians, geomean over paired speedups, exactness per timed run)."""
from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from flashpd.demo import PAIR


def test_speedup_bench_follows_the_protocol_on_the_demo_pair(tmp_path):
    out = tmp_path / "speedup.json"
    r = subprocess.run([sys.executable, "-m", "flashpd.bench.speedup", "--target", str(PAIR / "target"),
                        "--draft", str(PAIR / "drafter"), "--device", "cpu", "--prompts", "2", "--new-tokens", "6,10",
                        "--widths", "4,16", "--reps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["bench"] == "speedup" and run["device"] == "cpu" and run["dtype"] == "float32" and "partial" not in run
    assert [s["width"] for s in run["screen"]] == [4, 16] and all(s["reps"] == 1 for s in run["screen"])
    assert run["chosen_width"] == max(run["screen"], key=lambda s: s["geomean_speedup"])["width"]
    assert [c["new_tokens"] for c in run["confirm"]] == [6, 10]
    screen_prompts = {p["prompt_len"] for p in run["screen"][0]["prompts"]}
    for c in run["confirm"]:
        assert c["width"] == run["chosen_width"] and c["reps"] == 2 and len(c["prompts"]) == 2
        assert max(p["prompt_len"] for p in c["prompts"]) >= 2000
        for p in c["prompts"]:
            assert len(p["native_ms"]) == len(p["dflash_ms"]) == 2
            assert p["native_median_ms"] == statistics.median(p["native_ms"])
            assert math.isclose(p["speedup"], p["native_median_ms"] / p["dflash_median_ms"])
            assert p["exact"] == "2/2" and p["first_diff"] == [None, None] and p["tau"] >= 1.0
            # acceptance rate per draft position (a short request drafts fewer positions than the width)
            acc = p["position_acceptance"]
            assert 1 <= len(acc) <= c["width"] - 1 and all(0.0 <= x <= 1.0 for x in acc)
        sp = [p["speedup"] for p in c["prompts"]]
        assert math.isclose(c["geomean_speedup"], math.exp(statistics.mean(math.log(x) for x in sp)))
        assert (c["min_speedup"], c["max_speedup"]) == (min(sp), max(sp)) and c["exact"] == "4/4"
    assert max(screen_prompts) >= 2000
    assert "--prompts 2" in run["command"] and "--widths 4,16" in run["command"]
    if importlib.util.find_spec("matplotlib") is not None:  # charts drawn from the JSON (the bench extra)
        assert len(run["charts"]) == 3 and all((out.parent / f).exists() for f in run["charts"])
    else:
        assert "charts" not in run and "matplotlib not installed: no charts" in r.stdout


def test_screen_and_confirmation_prompts_come_from_disjoint_files():
    """Even-indexed held-out files screen, odd ones confirm: no 32-token window of a confirmation prompt
    occurs in the screen set's text, and each set has one prompt of 2,000+ tokens."""
    from flashpd.bench.speedup import heldout_prompt_sets
    from flashpd.training.text_data import read_texts, split_files, stdlib_files
    from flashpd.engine.tokenizer import TextTokenizer
    tok = TextTokenizer.from_dir(PAIR / "target")
    screen, confirm = heldout_prompt_sets(tok, 4, seed=0)
    assert len(screen) == len(confirm) == 4
    assert max(map(len, screen)) >= 2000 and max(map(len, confirm)) >= 2000
    _, held = split_files(stdlib_files())
    screen_stream = [t for text in read_texts(held)[0::2] for t in tok.encode(text)]
    windows = {tuple(screen_stream[i:i + 32]) for i in range(len(screen_stream) - 32)}
    assert all(tuple(p[i:i + 32]) in windows for p in screen for i in range(0, len(p) - 32, 97))
    assert not any(tuple(p[i:i + 32]) in windows for p in confirm for i in range(0, len(p) - 32, 97))
