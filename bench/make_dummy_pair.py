"""Write a dummy-weight target + DFlash drafter checkpoint pair at a real shape (e.g. Qwen3-8B), so the
service (`flashpd serve`, the load sweep) can be measured at that shape with no real weights.

    python -m flashpd.bench.make_dummy_pair --config qwen3-8b --out DIR [--tokenizer FILE]

Tokens from dummy weights are meaningless and a dummy drafter accepts almost nothing: this measures
the serving path's cost at the shape, not a model. --tokenizer copies a tokenizer.json in, so that
text prompts can be encoded (ids stay below the vocabulary).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from flashpd.bench.dflash_step import drafter_config_for
from flashpd.bench.ttft_hit import target_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.export import save_drafter, save_target, write_model_file
from flashpd.engine.loader import dummy_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", help="a tokenizer.json to copy beside the target")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    cfg = target_config(a.config)
    target = dummy_target(cfg, a.device, torch.bfloat16)
    save_target(target, out / "target", dtype=torch.bfloat16)
    save_drafter(dummy_drafter(drafter_config_for(cfg, a.draft_layers), target), out / "drafter", dtype=torch.bfloat16)
    if a.tokenizer:
        src = a.tokenizer
        write_model_file(out / "target" / "tokenizer.json", lambda tmp: shutil.copyfile(src, tmp))
    print(f"wrote {out}/target and {out}/drafter ({a.config}, dummy weights)")


if __name__ == "__main__":
    main()
