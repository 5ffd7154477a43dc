"""speed_8b with skinny_gemm.FUSED_MAX_ROWS set first (16: main's engine before the row tiles; 128: with them).
Usage: python ab_mid.py FUSED_MAX_ROWS speed_8b-args..."""
import sys

import flashpd.engine.skinny_gemm as sg

sg.FUSED_MAX_ROWS = int(sys.argv[1])
sys.argv = ["speed_8b"] + sys.argv[2:]
from flashpd.bench import speed_8b  # noqa: E402

speed_8b.main()
