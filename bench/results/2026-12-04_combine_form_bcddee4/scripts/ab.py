"""The combine kernel's old form (16 rows, every column, 1 state an iteration for a decode and 4 for more, 64 MB
workspace cap) against the engine's (combine_form), in the device loop at the Qwen3-8B shape, batch 1: native,
native at the verify's shapes, DFlash; contexts as given. Alternating, two rounds."""
import json, sys, time, torch
from flashpd.bench.speed_8b import loop_steps, random_prompts
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine import paged_attention as pa
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.spec_decode import DFlashGenerator

out = sys.argv[1]
ctxs = [int(x) for x in sys.argv[2].split(",")]
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
runner = ModelRunner(target, num_blocks=(max(ctxs) + 60 * 16 + 64) * 2 // 16 + 64, kv_block_size=16,
                     taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig())
NEW = (pa.COMBINE_ROWS, pa.COMBINE_DIMS, dict(pa.COMBINE_FORMS), pa.WORKSPACE_MAX_BYTES)
OLD = (16, 128, {(True, True): (1, 4), (True, False): (1, 4), (False, True): (4, 4), (False, False): (4, 4)}, 64 << 20)
def setf(f):
    pa.COMBINE_ROWS, pa.COMBINE_DIMS, pa.COMBINE_FORMS, pa.WORKSPACE_MAX_BYTES = f[0], f[1], dict(f[2]), f[3]
def top(row):
    return {k["name"][:40]: round(k["ms_per_step"], 4) for k in row.get("top_kernels", [])
            if "attn" in k["name"] or "combine" in k["name"]}
res = []
for rnd in range(2):
    for ctx in ctxs:
        for form, f in (("old", OLD), ("new", NEW)) if rnd == 0 else (("new", NEW), ("old", OLD)):
            setf(f)
            p = random_prompts(1, ctx, cfg.vocab_size, 0)
            t0 = time.time()
            nat = loop_steps(NativeGenerator(runner, ()), p, 48, profiled=True)
            ver = loop_steps(NativeGenerator(runner, (), step_width=16), p, 48, profiled=True)
            dfl = loop_steps(DFlashGenerator(runner, drafter, ()), p, 48, width=16, profiled=True)
            row = {"round": rnd, "context": ctx, "form": form, "native_ms": nat["ms_per_step"],
                   "native_busy": nat["gpu_busy_ms_per_step"], "native_kernels": nat["kernels_per_step"],
                   "verify_shapes_ms": ver["ms_per_step"], "dflash_ms": dfl["ms_per_step"],
                   "dflash_busy": dfl["gpu_busy_ms_per_step"],
                   "native_attn": top(nat), "verify_attn": top(ver), "dflash_attn": top(dfl)}
            res.append(row)
            print(f"r{rnd} ctx {ctx} {form}: native {row['native_ms']:.3f} verify-shapes {row['verify_shapes_ms']:.3f} "
                  f"dflash {row['dflash_ms']:.3f} (x{row['dflash_ms'] / row['native_ms']:.3f}) {row['native_attn']} "
                  f"{row['dflash_attn']} {time.time() - t0:.0f}s", flush=True)
            json.dump(res, open(out, "w"), indent=1)
setf(NEW)
