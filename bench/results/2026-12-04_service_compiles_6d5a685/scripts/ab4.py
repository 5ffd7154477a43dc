"""The paged kernel's launch settings for batched decode (no bit depends on any): pipeline stages, warps of a walking
program, the register cap, the split threshold; in the device loop at the Qwen3-8B shape, context 256, native
batches 32, 64, 128 (128 profiled in round 0: the attention's ms a step). Two rounds in reversed order."""
import json, sys, time, torch
from flashpd.bench.speed_8b import loop_steps, random_prompts
from flashpd.engine import paged_attention as pa
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner, RunnerConfig

out = sys.argv[1]
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 256
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
runner = ModelRunner(target, num_blocks=130 * (ctx + 80) // 16 + 64, kv_block_size=16, config=RunnerConfig())
BASE = {k: getattr(pa, k) for k in ("NUM_STAGES", "NUM_WARPS", "WALK_CAP_ABOVE_PROGRAMS_PER_SM",
                                    "SPLIT_BELOW_PROGRAMS_PER_SM", "WALK_MAX_REGISTERS")}
SETTINGS = {"base": {}, "st2": {"NUM_STAGES": 2}, "st3": {"NUM_STAGES": 3}, "st1": {"NUM_STAGES": 1},
            "w4": {"NUM_WARPS": 4}, "nocap": {"WALK_CAP_ABOVE_PROGRAMS_PER_SM": 0},
            "st2_nocap": {"NUM_STAGES": 2, "WALK_CAP_ABOVE_PROGRAMS_PER_SM": 0},
            "split8": {"SPLIT_BELOW_PROGRAMS_PER_SM": 8}, "split2": {"SPLIT_BELOW_PROGRAMS_PER_SM": 2}}
res = []
names = list(SETTINGS)
for rnd, order in enumerate([names, names[::-1]]):
    for name in order:
        for k, v in BASE.items():
            setattr(pa, k, v)
        for k, v in SETTINGS[name].items():
            setattr(pa, k, v)
        t0 = time.time()
        row = {"round": rnd, "setting": name, "context": ctx}
        for b in (32, 64, 128):
            r = loop_steps(NativeGenerator(runner, ()), random_prompts(b, ctx, cfg.vocab_size, b), 48,
                           profiled=rnd == 0 and b in (32, 128))
            row[f"b{b}_ms"] = r["ms_per_step"]
            if "top_kernels" in r:
                row[f"b{b}_busy"] = r["gpu_busy_ms_per_step"]
                row[f"b{b}_attn"] = sum(x["ms_per_step"] for x in r["top_kernels"]
                                        if "_attn_kernel" in x["name"] or "_combine" in x["name"])
        res.append(row)
        print(f"r{rnd} {name}: " + " ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float))
              + f" {time.time() - t0:.0f}s", flush=True)
        json.dump(res, open(out, "w"), indent=1)
