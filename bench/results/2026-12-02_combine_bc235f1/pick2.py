"""The tile spec with the least sum over batches 1, 32, 128 (the mode the engine takes, 64-key chunks) among those
whose modes agree bitwise -> 'UNROLL=.. NUM_STAGES=.. ...'."""
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
tot = {}
for r in rows:
    if r["split"] is not None and r["split"] == r["auto_split"] and r["keys_per_chunk"] == 64 and r["batch"] in (1, 32, 128):
        ok = all(x["bitwise_same_across_modes"] for x in rows if x["tiles"] == r["tiles"] and x["keys_per_chunk"] == 64 and x["split"] is not None)
        if ok:
            tot.setdefault(r["tiles"], []).append(r["us_per_call"])
print({k: (round(sum(v), 2), len(v)) for k, v in tot.items()}, file=sys.stderr)
ok = {k: sum(v) for k, v in tot.items() if len(v) == 3}
spec = min(ok, key=ok.get)
names = {"m": "BLOCK_M", "n": "BLOCK_N", "w": "NUM_WARPS", "s": "NUM_STAGES", "u": "UNROLL"}
print(" ".join(f"{names[p[0]]}={p[1:]}" for p in spec.split("-")))
