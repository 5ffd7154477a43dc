"""Generate kv_bridge/proto_gen/ from proto/kv_bridge.proto: `python -m flashpd.kv_bridge.gen_proto`.

One command, so the committed modules can be checked for drift (tests/test_kv_bridge_grpc.py
regenerates into a temp dir and compares). protoc writes `import kv_bridge_pb2` in the gRPC
module; it is rewritten package-relative so the modules import as flashpd.kv_bridge.proto_gen.
Needs grpcio-tools (a test extra), pinned so the output, which names its versions, is stable.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
OUT_DIR = Path(__file__).resolve().parent / "proto_gen"
PROTO = "kv_bridge.proto"
GENERATED = ("__init__.py", "kv_bridge_pb2.py", "kv_bridge_pb2.pyi", "kv_bridge_pb2_grpc.py")

_INIT = '''"""Generated from proto/kv_bridge.proto by `python -m flashpd.kv_bridge.gen_proto`; do not edit."""
from . import kv_bridge_pb2, kv_bridge_pb2_grpc

__all__ = ["kv_bridge_pb2", "kv_bridge_pb2_grpc"]
'''


def generate(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (python, pyi and grpc outputs) into out_dir and make the gRPC import relative."""
    from grpc_tools import protoc  # imported here: a test/dev dependency, not a runtime one

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={out_dir}",
                      f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto_dir / PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_mod = out_dir / "kv_bridge_pb2_grpc.py"
    text, n = re.subn(r"^import kv_bridge_pb2 as ", "from . import kv_bridge_pb2 as ", grpc_mod.read_text(),
                      flags=re.M)
    if n != 1:
        raise RuntimeError("could not find the kv_bridge_pb2 import to make package-relative")
    grpc_mod.write_text(text)
    (out_dir / "__init__.py").write_text(_INIT)
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output package directory")
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
