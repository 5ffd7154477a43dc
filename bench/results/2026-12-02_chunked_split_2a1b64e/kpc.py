"""speed_8b's curve with another chunk size (diagnosis only): python kpc.py KPC speed_8b args..."""
import sys
import flashpd.engine.paged_attention as pa
pa.KEYS_PER_CHUNK = int(sys.argv[1])
sys.argv = ["speed_8b"] + sys.argv[2:]
from flashpd.bench.speed_8b import main
main()
