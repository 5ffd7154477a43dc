"""Batch-1 device-loop step timeline at the Qwen3-8B shape: kernel start/end from the profiler's trace, and each
kernel's advance of the finished frontier (how much of the wall each adds), grouped by its role in a layer."""
import json, statistics, sys, tempfile, time, collections
import torch
from torch.profiler import ProfilerActivity, profile
from flashpd.bench.speed_8b import random_prompts, ready, run_steps
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig

out_path = sys.argv[1]
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
runner = ModelRunner(target, num_blocks=4096, kv_block_size=16, taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig())
native = NativeGenerator(runner, ())
seqs = ready(native, random_prompts(1, 256, cfg.vocab_size, 1), 200)
loop = native.loop(); sess = loop.begin(seqs)
run_steps(loop, sess, 5)
torch.cuda.synchronize(); t0 = time.perf_counter(); run_steps(loop, sess, 40); torch.cuda.synchronize()
print("ms/step", (time.perf_counter() - t0) * 1e3 / 40, flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run_steps(loop, sess, 12)
f = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(f)
ev = [e for e in json.load(open(f))["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
ev.sort(key=lambda e: e["ts"])
rows = [{"name": e["name"][:60], "ts": e["ts"], "end": e["ts"] + e["dur"], "grid": e.get("args", {}).get("grid")} for e in ev]
# steps: split at the DtoH memcpy
cuts = [i for i, r in enumerate(rows) if "Memcpy" in r["name"]]
steps = [rows[cuts[i] + 1: cuts[i + 1] + 1] for i in range(len(cuts) - 1)]
print("steps", len(steps), "kernels/step", [len(s) for s in steps][:6])
def role(s):
    names = []
    sk = 0
    layer_pat = ["qkv", "attn", "combine", "o_proj", "gate_up", "down"]
    for r in s:
        n = r["name"]
        names.append(n)
    return names
agg = collections.defaultdict(list)
walls = []
for s in steps[2:-1]:
    frontier = s[0]["ts"]
    start = s[0]["ts"]
    # label the per-layer pattern by position among skinny/attn/combine
    li = 0; seq = []
    for r in s:
        n = r["name"]
        if "_skinny_kernel" in n:
            g = r["grid"][0] if r["grid"] else 0
            lab = {384: "qkv", 256: "o_or_down", 768: "gate_up"}.get(g, f"skinny{g}")
        elif "_attn_kernel" in n: lab = "attn"
        elif "_combine_kernel" in n: lab = "combine"
        else: lab = n[:50]
        adv = max(0.0, r["end"] - max(frontier, r["ts"])) if r["ts"] > frontier else max(0.0, r["end"] - frontier)
        gap = max(0.0, r["ts"] - frontier)
        frontier = max(frontier, r["end"])
        agg[lab].append((adv, gap, r["end"] - r["ts"]))
    walls.append(frontier - start)
print("step span us (kernels only)", statistics.median(walls))
tab = []
for lab, v in agg.items():
    n = len(v) / len(walls)
    tab.append((lab, n, sum(a for a, _, _ in v) / len(walls), sum(g for _, g, _ in v) / len(walls), statistics.median(d for _, _, d in v)))
tab.sort(key=lambda t: -t[2])
for t in tab:
    print(f"{t[0]:52s} calls {t[1]:5.1f} advance {t[2]:8.1f} us  idle-before {t[3]:7.1f} us  median dur {t[4]:6.1f}")
one = steps[3]
base = one[0]["ts"]
json.dump({"ms_per_step": None, "one_step": [{"name": r["name"], "t": round(r["ts"] - base, 2), "end": round(r["end"] - base, 2), "grid": r["grid"]} for r in one],
           "table": tab}, open(out_path, "w"), indent=0)
loop.end(sess)
