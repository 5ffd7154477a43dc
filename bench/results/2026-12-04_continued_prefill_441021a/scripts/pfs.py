"""Diag: prefill time by prompt length at the 8B shape, in 1,024-token chunks (the default) and as one forward."""
import json, torch
from flashpd.engine.config import builtin_config_path, load_config
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.generate import NativeGenerator
from flashpd.bench.profile_step import measure_prefill
cfg = load_config(builtin_config_path("qwen3-8b"))
target = dummy_target(cfg, "cuda", torch.bfloat16)
runner = ModelRunner(target, num_blocks=8192 // 16 * 3 + 64, kv_block_size=16)
gen = NativeGenerator(runner, ())
print("defaults", runner.config, flush=True)
g = torch.Generator().manual_seed(0)
rows = []
for n in (1024, 2048, 4096, 8192):
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
    row = {"tokens": n}
    for name, chunk, gt in (("chunks_1024", 1024, 1024), ("one_forward", None, 1024)):
        runner.reconfigure(prefill_chunk=chunk, prefill_graph_tokens=gt)
        row[name + "_ms"] = measure_prefill(gen, prompt, 3, cuda=True)
    rows.append(row)
    print(row, flush=True)
json.dump({"config": "qwen3-8b", "dtype": "bfloat16", "weights": "dummy", "rows": rows}, open("prefill_scaling.json", "w"), indent=1)
