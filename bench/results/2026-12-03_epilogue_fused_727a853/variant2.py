"""Diagnosis wrapper: set engine module constants (module.ATTR=int ...), then run bench/speed_8b with the rest."""
import importlib, sys
i = sys.argv.index("--")
for a in sys.argv[1:i]:
    name, val = a.split("=")
    mod, attr = name.rsplit(".", 1)
    m = importlib.import_module("flashpd.engine." + mod)
    assert hasattr(m, attr), a
    setattr(m, attr, int(val))
    print("set", name, "=", int(val), flush=True)
sys.argv = ["speed_8b"] + sys.argv[i + 1:]
from flashpd.bench import speed_8b
speed_8b.main()
