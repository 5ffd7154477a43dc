"""Where bfloat16 DFlash and native greedy decoding part, under each prefill attention path.

In float32 on the CPU DFlash equals native token for token (tests assert it). In bfloat16 on a GPU a
verify forward of w columns and a one-token forward round differently, so a near-tie can flip; the
speedup protocol reports the match rate. This bench says which side moved when the rate changes: per
prompt, the first differing position between native and DFlash with the fresh-prefill causal kernel
(AttnBatch.fresh) and with the cache-and-mask path, and between the two prefill paths of each method.

    python -m flashpd.bench.exact_probe --prompts 8 --new-tokens 256 --width 8 --out bench/results/exact_probe.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashpd.bench.common import add_compile_args, apply_compile_args, write_json
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.demo import PAIR, first_diff
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.scheduler import generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(PAIR / "target"))
    ap.add_argument("--draft", default=str(PAIR / "drafter"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=8, help="per set; both of the speedup bench's sets are probed")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", default="fresh,mask", help="prefill paths to probe (fresh, mask)")
    ap.add_argument("--no-compile", action="store_true", help="CUDA graphs of the eager layer functions")
    add_compile_args(ap)
    ap.add_argument("--out", default="bench/results/exact_probe.json")
    a = ap.parse_args()
    compile_fields, compile_flags = apply_compile_args(a)
    runner, native, spec = pair_generators(a.target, a.draft, a.device, False if a.no_compile else None)
    dtype = runner.dtype
    screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(a.target), a.prompts, a.seed)
    paths = [x == "fresh" for x in a.paths.split(",")]
    params = [SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)]
    rows = []
    for name, prompts in (("screen", screen), ("confirm", confirm)):
        for i, p in enumerate(prompts):
            out = {}
            for fresh in paths:
                runner.reconfigure(fresh_prefill=fresh)
                out[("native", fresh)] = generate(native, [p], params)[0].output
                out[("dflash", fresh)] = generate(spec, [p], params, [a.width])[0].output
            runner.reconfigure(fresh_prefill=True)
            row = {"set": name, "prompt": i, "prompt_len": len(p)}
            for f, tag in ((True, "fresh"), (False, "mask")):
                if f in paths:
                    row[f"dflash_vs_native_{tag}"] = first_diff(out[("native", f)], out[("dflash", f)])
            if len(paths) == 2:
                row["native_fresh_vs_mask"] = first_diff(out[("native", True)], out[("native", False)])
                row["dflash_fresh_vs_mask"] = first_diff(out[("dflash", True)], out[("dflash", False)])
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    summary = {k: f"{sum(r[k] is None for r in rows)}/{len(rows)} equal" for k in rows[0] if k not in
               ("set", "prompt", "prompt_len")}
    print(summary)
    write_json(Path(a.out), {"bench": "exact_probe", "target": a.target, "draft": a.draft, "device": a.device,
                             "dtype": str(dtype).removeprefix("torch."), "width": a.width, "new_tokens": a.new_tokens,
                             "compile": runner.config.compile, **compile_fields,
                             "rows": rows, "summary": summary,
                             "command": f"python -m flashpd.bench.exact_probe --prompts {a.prompts} --new-tokens "
                                        f"{a.new_tokens} --width {a.width} --seed {a.seed} --paths {a.paths}"
                                        + (" --no-compile" if a.no_compile else "") + compile_flags
                                        + f" --out {a.out}"})


if __name__ == "__main__":
    main()
