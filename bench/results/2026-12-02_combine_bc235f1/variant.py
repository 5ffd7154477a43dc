"""speed_8b with paged-kernel constants set (diagnosis only): python variant.py UNROLL=0 NUM_STAGES=3 -- args..."""
import sys
import flashpd.engine.paged_attention as pa
i = sys.argv.index("--")
for kv in sys.argv[1:i]:
    k, v = kv.split("=")
    setattr(pa, k, type(getattr(pa, k))(int(v)))
    print("set", k, getattr(pa, k), flush=True)
sys.argv = ["speed_8b"] + sys.argv[i + 1:]
from flashpd.bench.speed_8b import main
main()
