"""Prompt 0 of the speedup protocol's sets at one revision: native and DFlash token hashes and tau."""
import sys, hashlib, torch
sys.path.insert(0, sys.argv[3])
from flashpd.bench import speedup as S
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.tokenizer import TextTokenizer
A = sys.argv[1] + '/flashpd/assets/demo_pair/'
dev = sys.argv[4]
scr, conf = S.heldout_prompt_sets(TextTokenizer.from_dir(A + 'target'), 8, 0)
comp = None if len(sys.argv) < 6 else sys.argv[5] == '1'
runner, nat, spec = S.pair_generators(A + 'target', A + 'drafter', dev, compile=comp)
try:
    from flashpd.engine.scheduler import generate
    gen = lambda g, ps, pa, w=None: generate(g, ps, pa, w) if w else generate(g, ps, pa)
except ImportError:
    gen = lambda g, ps, pa, w=None: g.generate(ps, pa, w) if w else g.generate(ps, pa)
h = lambda t: hashlib.sha1(str(list(t)).encode()).hexdigest()[:10]
n = int(sys.argv[2])
for name, p in ((('conf0', conf[0]), ('scr0', scr[0]), ('conf1', conf[1])) if comp is None else (('conf0', conf[0]),)):
    params = [SamplingParams(max_tokens=n, ignore_eos=True)]
    base = gen(nat, [p], params)[0].output
    s = gen(spec, [p], params, [16])[0]
    fd = next((k for k, (x, y) in enumerate(zip(s.output, base)) if x != y), None)
    print(name, len(p), 'native', h(base), 'dflash', h(s.output), 'first_diff', fd, 'tau', round(s.stats.tau, 4),
          'native_head', base[:12], flush=True)
