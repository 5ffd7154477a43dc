"""Diagnosis wrapper: module.ATTR=int (or a,b,c: a tuple of ints) settings and blas=<lib>, then bench/speed_8b with the rest."""
import importlib, sys
import torch
i = sys.argv.index("--")
for a in sys.argv[1:i]:
    name, val = a.split("=")
    if name == "blas":
        torch.backends.cuda.preferred_blas_library(val)
        print("blas", torch.backends.cuda.preferred_blas_library(), flush=True)
        continue
    mod, attr = name.rsplit(".", 1)
    m = importlib.import_module("flashpd.engine." + mod)
    assert hasattr(m, attr), a
    v = tuple(int(x) for x in val.split(",")) if "," in val else int(val)
    setattr(m, attr, v)
    print("set", name, "=", v, flush=True)
sys.argv = ["speed_8b"] + sys.argv[i + 1:]
from flashpd.bench import speed_8b
speed_8b.main()
