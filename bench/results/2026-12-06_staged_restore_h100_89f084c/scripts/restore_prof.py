"""Where a staged arena restore's time goes at the Qwen3-8B / DFlash-b16 shape: the PrefixCache's fetch (lookup,
Get, MAC, staging) and apply (writes into the caches) timed apart, staging on and off, with the arena read and
its parts (Get+MAC, MAC alone, host -> device copies) timed on the same chunks."""
import json, statistics, sys, time
import torch
from flashpd.bench.ttft_hit import make_stores, target_config, run, TimedPrefixCache
from flashpd.bench.dflash_step import drafter_config_for
from flashpd.engine.drafter import dummy_drafter
from flashpd.engine.loader import dummy_target
from flashpd.engine.runner import ModelRunner
from flashpd.engine.sampling import SamplingParams
from flashpd.engine.spec_decode import DFlashGenerator
from flashpd.kv_bridge.keys import MethodFingerprint
from flashpd.kv_bridge.prefix_cache import PrefixCache
from flashpd.kv_bridge.auth import process_secret
from flashpd.engine.scheduler import generate

out_path = sys.argv[1]
cfg = target_config("qwen3-8b")
dt = torch.bfloat16
target = dummy_target(cfg, "cuda", dt)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
P = 2723
gen = DFlashGenerator(ModelRunner(target, 2 * (P + 68) // 16 + 64, 16, taps=tuple(drafter.cfg.target_layer_ids)),
                      drafter, (), 16)
fp = MethodFingerprint("dummy-qwen3-8b", "dummy-drafter-5", tuple(drafter.cfg.target_layer_ids), "bfloat16").digest()
stores, closers = make_stores(["arena"], gen, 256, 2 << 30, True)
store = stores["arena"]
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, cfg.vocab_size - 2, (P,), generator=g).tolist()
params = SamplingParams(max_tokens=4, ignore_eos=True)
res = {}
ms = lambda t: (time.perf_counter() - t) * 1e3
try:
    run(gen, prompt, params, TimedPrefixCache(store, fp, 256))  # publish
    for _ in range(2):
        run(gen, prompt, params, TimedPrefixCache(store, fp, 256))  # warm, maps + pins the arena
    time.sleep(1)
    print("arena", store.client.arena_stats(), flush=True)
    for stage in (1 << 30, 0, 1 << 30, 0):
        rows = []
        for rep in range(5):
            pc = PrefixCache(store, fp, 256, stage_bytes=stage)
            seq = gen.new_sequences([prompt], [params])[0]
            gen.runner.allocator.ensure(seq.table, len(prompt))
            torch.cuda.synchronize()
            t = time.perf_counter(); got = pc.fetch(gen, prompt); f = ms(t)
            t = time.perf_counter(); hit = pc.apply(gen, seq, got); a0 = ms(t); torch.cuda.synchronize(); a = ms(t)
            gen.finish(seq, None)
            rows.append({"fetch_ms": f, "apply_ms": a, "apply_host_ms": a0, "hit": hit})
            del got
        res[f"stage{stage >> 20}_{len(res)}"] = rows
        print(stage >> 20, "fetch", [round(r["fetch_ms"], 1) for r in rows], "apply", [round(r["apply_ms"], 1) for r in rows],
              "apply(host)", [round(r["apply_host_ms"], 1) for r in rows], flush=True)
    # the arena read's parts on the same chunks
    c = store.client
    keys = PrefixCache(store, fp, 256)._keys(prompt[:-1])
    mac = process_secret().mac_key
    parts = []
    for rep in range(5):
        t = time.perf_counter(); got = list(c.iter_get(keys, "arena")); get_ms = ms(t)
        bufs = [torch.cat([x.target_kv.reshape(-1), x.draft_kv.reshape(-1)]).view(torch.uint8).numpy() for x in got[:3]]
        t = time.perf_counter()
        for b in bufs:
            h = mac.hasher(); h.update(b); h.digest()
        mac3 = ms(t)
        torch.cuda.synchronize(); t = time.perf_counter()
        for x in got:
            x.target_kv.to("cuda"); x.draft_kv.to("cuda")
        torch.cuda.synchronize(); h2d = ms(t)
        t = time.perf_counter()
        ys = [(x.target_kv.to("cuda", non_blocking=True), x.draft_kv.to("cuda", non_blocking=True)) for x in got]
        issue = ms(t); torch.cuda.synchronize(); h2d_async = ms(t)
        # per chunk: when each is yielded by the Get
        t = time.perf_counter(); stamps = []
        for x in c.iter_get(keys, "arena"):
            stamps.append(ms(t))
        parts.append({"get_mac_ms": get_ms, "mac_3_copies_ms": mac3, "h2d_sync_ms": h2d, "h2d_async_issue_ms": issue,
                      "h2d_async_ms": h2d_async, "yield_ms": [round(s, 2) for s in stamps]})
        print(parts[-1], flush=True)
        del got, ys, bufs
    res["parts"] = parts
    res["bytes"] = sum(x.nbytes() for x in c.iter_get(keys, "arena"))
finally:
    for cl in closers:
        cl()
json.dump(res, open(out_path, "w"), indent=1)
