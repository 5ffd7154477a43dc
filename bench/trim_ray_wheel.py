"""Shrink a Ray wheel to what flashpd's Ray launcher runs (core, actors, runtime env, util, job CLI), so
it travels to the GPU machine beside the repository and the gRPC wheels within one 64 MiB carry.

    python bench/trim_ray_wheel.py .whl/ray-2.60.0-cp312-*.whl          (rewrites it in place)

Dropped: the libraries flashpd never imports (RLlib, Data, Serve, Train, Tune, LLM) and the dashboard's
web client (the Ray job API itself stays). Checked with the same Ray version on the CPU machine: a
local cluster starts and an actor answers with those folders removed.
"""
from __future__ import annotations

import os
import sys
import zipfile

DROP = ("ray/rllib/", "ray/data/", "ray/serve/", "ray/train/", "ray/tune/", "ray/llm/", "ray/dashboard/client/",
        "ray/jars/")


def trim(path: str) -> tuple[int, int]:
    before = os.path.getsize(path)
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if not item.filename.startswith(DROP) and not item.filename.endswith(".js.map"):
                zout.writestr(item, zin.read(item.filename))
    os.replace(tmp, path)
    return before, os.path.getsize(path)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        b, a = trim(p)
        print(f"{p}: {b / 1e6:.1f} MB -> {a / 1e6:.1f} MB")
