"""Diagnostic: does a compiled argmax (inductor, static / symbolic / dynamo's default) pick eager's index (the
first maximum) on bf16 rows full of ties, and does greedy_tokens?"""
import torch, torch._dynamo
from flashpd.engine.sampling import greedy_tokens
V = 151936
shapes = [(1, V), (1, 16, V), (4, V), (32, V), (128, V), (2, 16, V), (1, 15, V)]
for name, fn in (("argmax", lambda x: x.argmax(-1)), ("greedy_tokens", greedy_tokens)):
    for dyn in (False, True, None):
        torch._dynamo.reset()
        f = torch.compile(fn, dynamic=dyn)
        row = []
        for shape in shapes:  # one compiled function through every shape in turn (dynamo's default recompiles)
            bad = 0
            for trial in range(10):
                x = (torch.randn(shape, device="cuda") * 3).round().to(torch.bfloat16)  # many ties at the top
                bad += int((f(x) != x.argmax(-1)).sum())
            row.append(f"{shape}:{bad}")
        print(f"RESULT {name} dynamic={dyn}: " + " ".join(row), flush=True)
