"""The last chunk program merging (arrival counters) against the combine kernel (MERGE_LAST off), in the device
loop at the Qwen3-8B shape, batch 1 (native, native at the verify's shapes, DFlash) and 4 (native), contexts as
given. Alternating, two rounds."""
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
runner = ModelRunner(target, num_blocks=(max(ctxs) + 60 * 16 + 64) * 6 // 16 + 64, kv_block_size=16,
                     taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig())
def top(row):
    return {k["name"][:40]: round(k["ms_per_step"], 4) for k in row.get("top_kernels", [])
            if "attn" in k["name"] or "combine" in k["name"]}
res = []
for rnd in range(2):
    for ctx in ctxs:
        for form in (("combine", "merge_last") if rnd == 0 else ("merge_last", "combine")):
            pa.MERGE_LAST = form == "merge_last"
            p = random_prompts(1, ctx, cfg.vocab_size, 0)
            t0 = time.time()
            nat = loop_steps(NativeGenerator(runner, ()), p, 48, profiled=True)
            ver = loop_steps(NativeGenerator(runner, (), step_width=16), p, 48, profiled=True)
            dfl = loop_steps(DFlashGenerator(runner, drafter, ()), p, 48, width=16, profiled=True)
            b4 = loop_steps(NativeGenerator(runner, ()), random_prompts(4, ctx, cfg.vocab_size, 4), 48)
            row = {"round": rnd, "context": ctx, "form": form, "native_ms": nat["ms_per_step"],
                   "native_busy": nat["gpu_busy_ms_per_step"], "native_kernels": nat["kernels_per_step"],
                   "verify_shapes_ms": ver["ms_per_step"], "dflash_ms": dfl["ms_per_step"],
                   "dflash_busy": dfl["gpu_busy_ms_per_step"], "dflash_kernels": dfl["kernels_per_step"],
                   "native_b4_ms": b4["ms_per_step"],
                   "native_attn": top(nat), "verify_attn": top(ver), "dflash_attn": top(dfl)}
            res.append(row)
            print(f"r{rnd} ctx {ctx} {form}: native {row['native_ms']:.3f} ({row['native_kernels']:.0f} kernels) "
                  f"verify-shapes {row['verify_shapes_ms']:.3f} dflash {row['dflash_ms']:.3f} "
                  f"(x{row['dflash_ms'] / row['native_ms']:.3f}) b4 {row['native_b4_ms']:.3f} {row['native_attn']} "
                  f"{row['dflash_attn']} {time.time() - t0:.0f}s", flush=True)
            json.dump(res, open(out, "w"), indent=1)
pa.MERGE_LAST = True
