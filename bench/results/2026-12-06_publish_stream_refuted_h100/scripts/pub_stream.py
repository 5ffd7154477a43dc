"""Back-to-back prefills with the publish after the answer (Qwen3-8B / DFlash-b16 shape, dummy weights, arena
bridge): prompt A is prefilled and answered, then prompt B at once; the time from A's start until A's chunks are
in the bridge (what A's decode call waits for), and both answers. Run under the publisher's copies on their own
stream (the work tree) or on the engine's (the code before, by PYTHONPATH). Then A's chunks read back from the
bridge equal, tensor for tensor, a publish of A with nothing after it (B overwrote A's freed blocks meanwhile)."""
import json, os, statistics, sys, time
import torch
from flashpd.bench.bridge_throughput import start_server
from flashpd.bench.ttft_hit import target_config
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.kv_bridge.client import BridgeClient, RemoteStore
from flashpd.kv_bridge.prefix_cache import PrefixCache
import flashpd.prefill_node.worker as W
from flashpd.prefill_node.worker import PrefillWorker

label = sys.argv[2]
print(label, W.__file__, "side stream" if "_stream" in open(W.__file__).read() else "engine stream", flush=True)
cfg = target_config("qwen3-8b")
target = dummy_target(cfg, "cuda", torch.bfloat16)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
P, REPS = 2723, int(os.environ.get("REPS", 5))
runner = ModelRunner(target, 2 * (P + 64) // 16 + 64, 16, taps=tuple(drafter.cfg.target_layer_ids))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, cfg.vocab_size - 2, (P,), generator=g).tolist() for _ in range(4)]
params = SamplingParams(max_tokens=4, ignore_eos=True)
proc, addr = start_server(8 << 30, arena=True)
out = {"label": label, "runs": []}
try:
    client = BridgeClient(addr, timeout_s=600)
    store = RemoteStore(client, "arena")
    w = PrefillWorker(runner, drafter, PrefixCache(store, "fp-x", 256), publish_after_answer=True)
    for rep in range(REPS + 1):
        a, b = prompts[(2 * rep) % 4], prompts[(2 * rep + 1) % 4]
        fa, fb = f"fp-{label}-{rep}-a", f"fp-{label}-{rep}-b"
        w.cache = w.publisher.cache = PrefixCache(store, fa, 256)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ra = w.prefill(a, params)
        ans_a = (time.perf_counter() - t0) * 1e3
        w.cache = w.publisher.cache = PrefixCache(store, fb, 256)  # (the publisher reads .cache when it runs)
        rb = w.prefill(b, params)
        ans_b = (time.perf_counter() - t0) * 1e3
        w.await_publish(ra.publish_ticket, 600)
        pub_a = (time.perf_counter() - t0) * 1e3
        w.await_publish(rb.publish_ticket, 600)
        pub_b = (time.perf_counter() - t0) * 1e3
        if rep:
            out["runs"].append(dict(answer_a_ms=ans_a, answer_b_ms=ans_b, published_a_ms=pub_a, published_b_ms=pub_b))
            print({k: round(v, 1) for k, v in out["runs"][-1].items()}, flush=True)
    # exactness: A's chunks as published after B against a publish of A alone (before-answer mode)
    ref = PrefillWorker(runner, drafter, PrefixCache(store, f"fp-{label}-ref", 256), publish_after_answer=False)
    last = prompts[(2 * REPS) % 4]  # the last round's A: the newest in the bridge, never evicted
    ref.prefill(last, params)
    pc_a, pc_r = PrefixCache(store, f"fp-{label}-{REPS}-a", 256), PrefixCache(store, f"fp-{label}-ref", 256)
    ka, kr = pc_a._keys(last), pc_r._keys(last)
    ga, gr = client.get(ka), client.get(kr)
    eq = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x.cpu(), y.cpu()))
    same = len(ga) == len(gr) == len(ka) and all(eq(x.target_kv, y.target_kv) and eq(x.draft_kv, y.draft_kv)
                                                  for x, y in zip(ga, gr))
    out["draft_restored"] = bool(ga and ga[0].draft_kv is not None)
    out["chunks_a"] = len(ga)
    out["a_equals_alone"] = bool(same)
    print("chunks", len(ga), "A after B equals A alone:", same, flush=True)
    w.publisher.close()
finally:
    proc.terminate(); proc.wait(30)
for k in ("answer_a_ms", "answer_b_ms", "published_a_ms", "published_b_ms"):
    out[k + "_median"] = statistics.median(r[k] for r in out["runs"])
print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
json.dump(out, open(sys.argv[1], "w"), indent=1)
