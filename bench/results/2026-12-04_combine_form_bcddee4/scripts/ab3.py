"""PDL release for latency kernels followed by latency kernels (qkv_rope -> attention, split attention -> combine):
PDL_RELEASE_TO_LATENCY 0 (never, the engine's until now) / 1 (after the wait) / 2 (before), in the device loop at
the Qwen3-8B shape, context 256: batch 1 native, native at the verify's shapes, DFlash; batches 32 and 128 native.
Rotated order, three rounds."""
import json, sys, time, torch
from flashpd.bench.speed_8b import loop_steps, random_prompts
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine import triton_env
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig
from flashpd.engine.spec_decode import DFlashGenerator

out = sys.argv[1]
ctx = 256
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
runner = ModelRunner(target, num_blocks=130 * (ctx + 60) // 16 + 2 * (ctx + 60 * 16) // 16 + 64, kv_block_size=16,
                     taps=tuple(drafter.cfg.target_layer_ids), config=RunnerConfig())
res = []
orders = [(0, 1, 2), (1, 2, 0), (2, 0, 1)]
for rnd, order in enumerate(orders):
    for form in order:
        triton_env.PDL_RELEASE_TO_LATENCY = form
        p = random_prompts(1, ctx, cfg.vocab_size, 0)
        t0 = time.time()
        nat = loop_steps(NativeGenerator(runner, ()), p, 48, profiled=rnd == 0)
        ver = loop_steps(NativeGenerator(runner, (), step_width=16), p, 48)
        dfl = loop_steps(DFlashGenerator(runner, drafter, ()), p, 48, width=16)
        b32 = loop_steps(NativeGenerator(runner, ()), random_prompts(32, ctx, cfg.vocab_size, 32), 48)
        b128 = loop_steps(NativeGenerator(runner, ()), random_prompts(128, ctx, cfg.vocab_size, 128), 48)
        row = {"round": rnd, "release_to_latency": form, "native_ms": nat["ms_per_step"],
               "native_busy": nat.get("gpu_busy_ms_per_step"), "verify_shapes_ms": ver["ms_per_step"],
               "dflash_ms": dfl["ms_per_step"], "b32_ms": b32["ms_per_step"], "b128_ms": b128["ms_per_step"]}
        res.append(row)
        print(f"r{rnd} release {form}: native {row['native_ms']:.3f} (busy {row['native_busy']}) verify-shapes "
              f"{row['verify_shapes_ms']:.3f} dflash {row['dflash_ms']:.3f} b32 {row['b32_ms']:.3f} "
              f"b128 {row['b128_ms']:.3f} {time.time() - t0:.0f}s", flush=True)
        json.dump(res, open(out, "w"), indent=1)
triton_env.PDL_RELEASE_TO_LATENCY = 0
