"""Generate kv_bridge/proto_gen/ from proto/kv_bridge.proto: `python -m flashpd.kv_bridge.gen_proto`.

The same command also generates cluster/proto_gen/ from proto/generation.proto (the generation API);
tests/test_generation_api.py checks that package for drift the same way.

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


GEN_OUT_DIR = Path(__file__).resolve().parent.parent / "cluster" / "proto_gen"
GEN_PROTO = "generation.proto"
GEN_GENERATED = ("__init__.py", "generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")

_GEN_INIT = '''"""Generated from proto/generation.proto by `python -m flashpd.kv_bridge.gen_proto`; do not edit."""
from . import generation_pb2, generation_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc"]
'''


def _protoc(proto: str, stem: str, init: str, generated: tuple[str, ...], out_dir: Path,
            proto_dir: Path) -> list[Path]:
    """Run protoc (python, pyi and grpc outputs) into out_dir and make the gRPC import relative."""
    from grpc_tools import protoc  # imported here: a test/dev dependency, not a runtime one

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={out_dir}",
                      f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", str(proto_dir / proto)])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_mod = out_dir / f"{stem}_pb2_grpc.py"
    text, n = re.subn(rf"^import {stem}_pb2 as ", f"from . import {stem}_pb2 as ", grpc_mod.read_text(),
                      flags=re.M)
    if n != 1:
        raise RuntimeError(f"could not find the {stem}_pb2 import to make package-relative")
    grpc_mod.write_text(text)
    (out_dir / "__init__.py").write_text(init)
    return [out_dir / name for name in generated]


def generate(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """The KV bridge's modules (proto/kv_bridge.proto) into out_dir."""
    return _protoc(PROTO, "kv_bridge", _INIT, GENERATED, out_dir, proto_dir)


def generate_generation(out_dir: Path = GEN_OUT_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """The generation API's modules (proto/generation.proto) into out_dir."""
    return _protoc(GEN_PROTO, "generation", _GEN_INIT, GEN_GENERATED, out_dir, proto_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output package directory (KV bridge)")
    ap.add_argument("--generation-out", type=Path, default=GEN_OUT_DIR,
                    help="output package directory (generation API)")
    args = ap.parse_args(argv)
    for p in generate(args.out) + generate_generation(args.generation_out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
