"""bf16 on a GPU, graphs on: DFlash equals native on short prompts of every length 1-40 (they pad to 16, 32, 64),
one by one and as one batch, both methods on the LLM's one runner (as a colocated service runs them)."""
import json, os, sys, time
import torch
from flashpd import LLM, SamplingParams
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.scheduler import generate
A = sys.argv[1]
GPU = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
t0 = time.perf_counter()
d = LLM(target=f"{A}/target", draft=f"{A}/drafter")
print(f"warm in {time.perf_counter() - t0:.1f} s on {GPU}", flush=True)
nat = NativeGenerator(d.runner, step_width=16)
nat1 = NativeGenerator(d.runner)
g = torch.Generator().manual_seed(7)
prompts = [torch.randint(0, d.model.cfg.vocab_size, (k,), generator=g).tolist() for k in range(1, 41)]
rows = []
with torch.inference_mode():
    for batch in (False, True):
        t = time.perf_counter()
        if batch:
            od = generate(d.generator, prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * len(prompts))
            on = generate(nat, prompts, [SamplingParams(max_tokens=48, ignore_eos=True)] * len(prompts))
        else:
            od = [generate(d.generator, [p], [SamplingParams(max_tokens=48, ignore_eos=True)])[0] for p in prompts]
            on = [generate(nat, [p], [SamplingParams(max_tokens=48, ignore_eos=True)])[0] for p in prompts]
            o1 = [generate(nat1, [p], [SamplingParams(max_tokens=48, ignore_eos=True)])[0] for p in prompts]
            print({"one_column_equal": sum(a.output == b.output for a, b in zip(od, o1)),
                   "one_column_first_diff": [next((k for k, (x, y) in enumerate(zip(a.output, b.output)) if x != y), None) for a, b in zip(od, o1)]}, flush=True)
        eq = [a.output == b.output for a, b in zip(od, on)]
        rows.append({"batched": batch, "equal": f"{sum(eq)}/{len(eq)}",
                     "unequal_lengths": [len(p) for p, e in zip(prompts, eq) if not e],
                     "first_diff": [next((k for k, (x, y) in enumerate(zip(a.output, b.output)) if x != y), None) for a, b in zip(od, on)],
                     "tau_mean": sum(s.stats.tau for s in od) / len(od), "s": round(time.perf_counter() - t, 1)})
        print(rows[-1], flush=True)
json.dump({"rows": rows, "gpu": GPU, "git": os.environ.get("FLASHPD_GIT_REV")},
          open(os.path.join(os.environ["OUT"], "short_exact.json"), "w"), indent=1)
