"""Diagnostic: DFlash vs native at the verify's shapes on the long prompts, under one configuration."""
import sys, time, hashlib
import torch
cfg = sys.argv[1]
if cfg == "static":
    torch._dynamo.config.automatic_dynamic_shapes = False
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.scheduler import generate
from flashpd.engine.sampling import SamplingParams
T, D = "flashpd/assets/demo_pair/target", "flashpd/assets/demo_pair/drafter"
runner, native, spec = pair_generators(T, D, "cuda")
if cfg == "nochunk":
    runner.reconfigure(prefill_chunk=None)
screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(T), 8, 0)
prompts = screen + confirm
params = [SamplingParams(max_tokens=256, ignore_eos=True)]
wide = NativeGenerator(runner, native.stop_ids, step_width=16)
h = lambda x: hashlib.sha1(str(x).encode()).hexdigest()[:10]
for i in (0, 8, 1, 0):
    p = prompts[i]
    if cfg == "widefirst":
        nw = generate(wide, [p], params)[0].output
        d = generate(spec, [p], params, [16])[0].output
    else:
        d = generate(spec, [p], params, [16])[0].output
        nw = generate(wide, [p], params)[0].output
    first = next((k for k, (x, y) in enumerate(zip(d, nw)) if x != y), None)
    print(f"RESULT {cfg} prompt {i} len {len(p)}: equal {d == nw} first_diff {first} dflash {h(d)} wide {h(nw)}", flush=True)
