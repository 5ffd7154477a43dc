"""Diag: bf16 exactness (DFlash against native at the verify's shapes, the speedup protocol's 16 prompts, 256 tokens)
with every prompt prefilled in 64-token chunks: the continued form on each chunk after the first."""
import json, sys
from flashpd.bench.speedup import heldout_prompt_sets, pair_generators
from flashpd.engine.generate import NativeGenerator
from flashpd.engine.tokenizer import TextTokenizer
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.scheduler import generate
from flashpd.engine import attention
import flashpd.engine.qwen3 as qwen3
R = sys.argv[1]
tgt, dr = f"{R}/flashpd/assets/demo_pair/target", f"{R}/flashpd/assets/demo_pair/drafter"
screen, confirm = heldout_prompt_sets(TextTokenizer.from_dir(tgt), 8, 0)
runner, native, spec = pair_generators(tgt, dr, "cuda")
runner.reconfigure(prefill_chunk=64, prefill_graph_tokens=1024)
calls = []
orig = qwen3.use_continued
qwen3.use_continued = lambda *a, **k: calls.append(orig(*a, **k)) or calls[-1]
wide = NativeGenerator(runner, native.stop_ids, step_width=16)
params = [SamplingParams(max_tokens=256, ignore_eos=True)]
rows = []
for i, p in enumerate(screen + confirm):
    d = generate(spec, [p], params, [16])[0].output
    w = generate(wide, [p], params)[0].output
    rows.append({"prompt": i, "prompt_len": len(p), "equal": d == w})
    print(i, len(p), d == w, flush=True)
n_cont = sum(calls)
print("exact", sum(r["equal"] for r in rows), "/", len(rows), "continued forwards", n_cont, "of", len(calls))
json.dump({"chunk": 64, "rows": rows, "exact": f"{sum(r['equal'] for r in rows)}/{len(rows)}",
           "continued_forwards": n_cont, "forwards": len(calls)}, open("exact_chunk64.json", "w"), indent=1)
