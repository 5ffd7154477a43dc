"""Pick the chunk size from paged_split.json: the least sum over batches 1, 32, 128 of the mode the engine takes."""
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
tot = {}
for r in rows:
    if r["tiles"] == "m16-n32-w4-s2" and r["split"] is not None and r["split"] == r["auto_split"] and r["batch"] in (1, 32, 128):
        tot.setdefault(r["keys_per_chunk"], []).append(r["us_per_call"])
print({k: (sum(v), len(v)) for k, v in tot.items()}, file=sys.stderr)
ok = {k: sum(v) for k, v in tot.items() if len(v) == 3}
print(min(ok, key=ok.get) if ok else 64)
