"""The paged kernel at a verify's shape (1 row, 16 tokens) with the engine's table and a 4x wider one (diagnosis)."""
import json, sys, torch
from flashpd.bench.attn_micro import graph_time
from flashpd.engine import paged_attention as pa
rows = []
for t, ctx in ((16, 298), (1, 283)):
    for keys in (512, 2048):
        page = 16
        used = -(-ctx // page)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(8, 1, t * 4, 128, generator=g, device="cuda").to(torch.bfloat16)
        k = torch.randn(used + 1, page, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
        v = torch.randn_like(k)
        bt = torch.zeros(1, keys // page, dtype=torch.int64, device="cuda")
        bt[0, :used] = 1 + torch.arange(used, device="cuda")
        pos = torch.arange(ctx - t, ctx, device="cuda").view(1, t)
        fn = lambda: pa.paged_attention(q, k, v, bt, pos, 128 ** -0.5)
        us = graph_time(fn, reps=20, inner=36)
        rows.append({"t": t, "context": ctx, "table_keys": keys, "us_per_call": us})
        print(rows[-1], flush=True)
same = {}
print("check bf16", pa.check_against_reference("cuda", torch.bfloat16), flush=True)
json.dump({"rows": rows, "git": sys.argv[1]}, open(sys.argv[2], "w"), indent=1)
