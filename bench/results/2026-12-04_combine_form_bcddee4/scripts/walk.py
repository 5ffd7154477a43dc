"""The paged kernel at batch 1 (decode, verify, draft): a program per key chunk + combine (the engine's rule)
against one program walking a row's chunks, in the device loop at the Qwen3-8B shape, several contexts.
Same bits either way (the module's docstring); timing only. Alternating, two rounds."""
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
res = []
base = pa.SPLIT_BELOW_PROGRAMS_PER_SM
def top(row):
    return {k["name"][:40]: round(k["ms_per_step"], 4) for k in row.get("top_kernels", [])
            if "attn" in k["name"] or "combine" in k["name"]}
for rnd in range(2):
    for ctx in ctxs:
        for form, v in (("split", base), ("walk", 0)):
            pa.SPLIT_BELOW_PROGRAMS_PER_SM = v
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
            print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
            json.dump(res, open(out, "w"), indent=1)
pa.SPLIT_BELOW_PROGRAMS_PER_SM = base
