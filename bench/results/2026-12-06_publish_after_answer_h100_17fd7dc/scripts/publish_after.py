"""A prefill worker's answer with the publish before it and after it (PrefillWorker publish_after_answer), at the
Qwen3-8B / DFlash-b16 shape with dummy weights: the answer's time (what a client's first token waits for) and the
time until the prompt's chunks are in the bridge (what the decode call waits for), through an arena bridge and an
inline (gRPC bytes) one. One worker a block of runs; each run a new fingerprint, so the prompt is prefilled and
published whole every time; modes alternate, the first round of each block a warm-up."""
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
from flashpd.prefill_node.worker import PrefillWorker

DEV = os.environ.get("DEV", "cuda")
cfg = target_config(os.environ.get("CONFIG", "qwen3-8b"))
target = dummy_target(cfg, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
drafter = dummy_drafter(drafter_config_for(cfg, 5), target)
P, REPS = int(os.environ.get("P", 2723)), int(sys.argv[2]) if len(sys.argv) > 2 else 4
runner = ModelRunner(target, (P + 64) // 16 + 64, 16, taps=tuple(drafter.cfg.target_layer_ids))
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, cfg.vocab_size - 2, (P,), generator=g).tolist() for _ in range(3)]
params = SamplingParams(max_tokens=4, ignore_eos=True)
res, procs = {}, []
try:
    for transport in ("arena", "inline"):
        proc, addr = start_server(3 << 30, arena=transport == "arena")
        procs.append(proc)
        client = BridgeClient(addr, timeout_s=600)
        store = RemoteStore(client, transport)
        run_id = 0
        for after in (True, False, True, False):
            rows = []
            w = PrefillWorker(runner, drafter, PrefixCache(store, "fp-unused", 256), publish_after_answer=after)
            for rep in range(REPS):
                for p in prompts:
                    run_id += 1
                    w.cache = PrefixCache(store, f"fp-{transport}-{run_id}", 256)  # nothing of it in the bridge
                    if after:
                        w.publisher.cache = w.cache
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    r = w.prefill(p, params)
                    answer = (time.perf_counter() - t0) * 1e3
                    if after:
                        w.await_publish(r.publish_ticket, 600)
                    published = (time.perf_counter() - t0) * 1e3
                    if rep:  # the first round of each block warms up
                        rows.append({"answer_ms": answer, "published_ms": published, "chunks": r.published_chunks})
            if after:
                w.publisher.close()
            key = f"{transport}_{'after' if after else 'before'}_{len(res)}"
            res[key] = {"answer_ms_median": statistics.median(x["answer_ms"] for x in rows),
                        "published_ms_median": statistics.median(x["published_ms"] for x in rows),
                        "answer_ms": [round(x["answer_ms"], 1) for x in rows],
                        "published_ms": [round(x["published_ms"], 1) for x in rows],
                        "chunks": rows[0]["chunks"]}
            print(key, {k: v for k, v in res[key].items() if k.endswith("median") or k == "chunks"},
                  "answers", res[key]["answer_ms"], flush=True)
        client.close()
finally:
    for proc in procs:
        proc.terminate(); proc.wait(30)
json.dump(res, open(sys.argv[1], "w"), indent=1)
