"""Diag: DFlash on the demo pair with the context stream on and off: outputs AND acceptance lengths must be equal
(exactness alone cannot see a race in the draft: the verify corrects any draft)."""
import sys, json, torch
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.engine import device_loop
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
R = sys.argv[1]
tgt, dr = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(tgt), 8, 0)
prompts = screen + confirm
params = SamplingParams(max_tokens=256, ignore_eos=True)
res = {}
for name, flag in (("on", True), ("off", False), ("on2", True)):
    device_loop.CONTEXT_STREAM = flag
    runner, native, spec = pair_generators(tgt, dr, "cuda")
    one = [generate(spec, [p], [params], [16])[0] for p in prompts]
    batch = generate(spec, prompts, [params] * len(prompts), [16] * len(prompts))
    res[name] = {"one": [(o.output, list(o.stats.acceptance_lengths)) for o in one],
                 "batch": [(o.output, list(o.stats.acceptance_lengths)) for o in batch]}
    tau = sum(sum(a) for _, a in res[name]["one"]) / sum(len(a) for _, a in res[name]["one"])
    tau_b = sum(sum(a) for _, a in res[name]["batch"]) / sum(len(a) for _, a in res[name]["batch"])
    print(name, "tau one", round(tau, 4), "tau batch16", round(tau_b, 4), "stream made:",
          getattr(getattr(spec, "_loop", None), "_context_stream", "?"), flush=True)
    del runner, native, spec
    torch.cuda.empty_cache()
for k in ("one", "batch"):
    print(k, "on==off", res["on"][k] == res["off"][k], "on==on2", res["on"][k] == res["on2"][k],
          "per prompt on==off", sum(a == b for a, b in zip(res["on"][k], res["off"][k])), "/", len(prompts))
json.dump({"equal_one": res["on"]["one"] == res["off"]["one"], "equal_batch": res["on"]["batch"] == res["off"]["batch"],
           "equal_repeat": res["on"] == res["on2"]}, open("race.json", "w"))
