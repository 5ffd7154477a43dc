"""Diagnostic: DFlash, native at one column, native at the verify's shapes, in speed_8b's order, on prompts
0, 8, 1, 0 again, under one configuration; prints the outputs' hashes."""
import sys, hashlib
import torch
cfg = sys.argv[1]
from flashpd.engine import runner as runner_mod
if cfg == "allsym":
    orig = runner_mod.ModelRunner.compiled
    runner_mod.ModelRunner.compiled = lambda self, fn, symbolic=False: orig(self, fn, True)
if cfg == "plainargmax":
    import flashpd.engine.device_loop as dl, flashpd.engine.draft_runner as dr, flashpd.engine.generate as ge
    for m in (dl, dr, ge):
        m.greedy_tokens = lambda x: x.argmax(-1)
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.scheduler import generate
from flashpd.engine.sampling import SamplingParams
import os
PAIR = os.environ.get("PAIR", "flashpd/assets/demo_pair")
T, D = PAIR + "/target", PAIR + "/drafter"
runner, native, spec = pair_generators(T, D, "cuda")
screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(T), 8, 0)
prompts = screen + confirm
params = [SamplingParams(max_tokens=256, ignore_eos=True)]
wide = NativeGenerator(runner, native.stop_ids, step_width=16)
h = lambda x: hashlib.sha1(str(x).encode()).hexdigest()[:10]
print("prompt 0 == prompt 8:", prompts[0] == prompts[8], flush=True)
for i in (0, 8, 1, 0):
    p = prompts[i]
    d = generate(spec, [p], params, [16])[0].output
    n1 = generate(native, [p], params)[0].output
    nw = generate(wide, [p], params)[0].output
    first = next((k for k, (x, y) in enumerate(zip(d, nw)) if x != y), None)
    print(f"RESULT {cfg} prompt {i} len {len(p)}: equal {d == nw} first_diff {first} dflash {h(d)} one {h(n1)} wide {h(nw)}", flush=True)
