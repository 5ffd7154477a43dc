"""Record a greedy DFlash acceptance schedule of a trained pair, for bench/dflash_step.py's replay.

    python -m flashpd.bench.record_schedule --fixture-pair --out bench/results/schedule_fixture_pair.json
    python -m flashpd.bench.record_schedule --target T --draft D --eval-json DIR/eval.json --out ...

--fixture-pair builds the tests' tiny trained pair (tests/dflash_fixtures.py, seed 0; run from the
repository root) and decodes its held-out prompts; --eval-json copies the per-prompt schedules a
training run already recorded (flashpd make-demo-pair / train-drafter write eval.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from flashpd.engine.drafter import load_drafter
from flashpd.engine.loader import load_target
from flashpd.training.train_drafter import evaluate_tau


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture-pair", action="store_true")
    ap.add_argument("--eval-json")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.fixture_pair:
        sys.path.insert(0, str(Path.cwd()))
        from tests.dflash_fixtures import build_pair  # noqa: PLC0415 (test-only helper, run from the repo root)
        pair = build_pair(Path(tempfile.mkdtemp()))
        target = load_target(pair.target_dir)
        rows = evaluate_tau(target, load_drafter(pair.draft_dir, target), pair.prompts, a.new_tokens, draft_width=16)
        source = "tests/dflash_fixtures.py build_pair(seed=0): tiny target + drafter trained on its greedy output (CPU fp32)"
    elif a.eval_json:
        rows = json.loads(Path(a.eval_json).read_text())["heldout"]
        source = f"recorded by a training run: {a.eval_json}"
    else:
        raise SystemExit("give --fixture-pair or --eval-json")
    out = {"source": source, "heldout": rows, "tau_mean": sum(r["tau"] for r in rows) / len(rows),
           "command": " ".join(["python -m flashpd.bench.record_schedule", *sys.argv[1:]])}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"tau {out['tau_mean']:.2f} per prompt {[round(r['tau'], 2) for r in rows]}; wrote {a.out}")


if __name__ == "__main__":
    main()
