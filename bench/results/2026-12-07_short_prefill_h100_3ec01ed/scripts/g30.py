"""LLM's warm-up on a GPU, then first requests of short prompts of lengths it did not warm: each one's TTFT."""
import json, os, sys, time
import torch
from flashpd import LLM, SamplingParams
A = sys.argv[1]
t0 = time.perf_counter()
llm = LLM(target=f"{A}/target", draft=f"{A}/drafter")
print(f"loaded+warm {time.perf_counter() - t0:.1f} s (warm {llm.warmup_s:.1f} s) on {torch.cuda.get_device_name()}", flush=True)
g = torch.Generator().manual_seed(3)
rows = []
for n in (5, 9, 12, 20, 27, 31, 45, 12, 70, 2, 17, 33, 64):
    ids = torch.randint(0, llm.model.cfg.vocab_size, (n,), generator=g).tolist()
    t = time.perf_counter()
    o = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    rows.append({"prompt_tokens": n, "ttft_ms": round(o.stats.ttft_ms, 1), "latency_ms": round(o.stats.latency_ms, 1),
                 "wall_ms": round((time.perf_counter() - t) * 1e3, 1), "tau": o.stats.tau})
    print(rows[-1], flush=True)
json.dump({"warmup_s": llm.warmup_s, "rows": rows, "gpu": torch.cuda.get_device_name(),
           "git": os.environ.get("FLASHPD_GIT_REV")}, open(os.path.join(os.environ["OUT"], "warm_ttft.json"), "w"), indent=1)
