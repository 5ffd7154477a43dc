"""Which graph keys does a generate request meet that LLM's warm-up did not (GPU padded paths on the CPU)?"""
from flashpd.engine import cuda_graph, device_loop
from flashpd.engine.runner_config import RunnerConfig
from flashpd.engine import factory
import flashpd.llm as llm_mod
from flashpd.engine.sampling import SamplingParams

seen = []
orig, orig_graphed = device_loop.InPlaceGraph.__call__, cuda_graph.GraphedFn.__call__
def record(self, key, bufs, reset):
    seen.append(("loop", tuple(key)))
    return orig(self, key, bufs, reset)
def record_graphed(self, inputs, **kw):
    seen.append(("graph", getattr(self, "name", id(self)), tuple(tuple(x.shape) for x in inputs),
                 tuple(sorted((k, str(getattr(v, "__qualname__", v))) for k, v in kw.items()))))
    return orig_graphed(self, inputs, **kw)
device_loop.InPlaceGraph.__call__ = record
cuda_graph.GraphedFn.__call__ = record_graphed
real = factory.load_engine
def patched(*a, **kw):
    kw["runner_config"] = RunnerConfig(cuda_graphs=True, compile=False)
    return real(*a, **kw)
llm_mod.load_engine = patched
A = "flashpd/assets/demo_pair"  # run from the repository root
llm = llm_mod.LLM(target=f"{A}/target", draft=f"{A}/drafter", device="cpu", dtype="float32", warmup=True)
warm = set(seen); del seen[:]
P = "import os\n\n\ndef read_file(path):\n"
out = llm.generate(P, SamplingParams(max_tokens=32))[0]
print("prompt tokens", len(llm.encode(P)), "out", len(out.token_ids))
new = set(seen) - warm
print("warm keys", len(warm), "request keys", len(set(seen)), "new", len(new))
for k in sorted(map(str, new)):
    print("NEW", k[:300])
