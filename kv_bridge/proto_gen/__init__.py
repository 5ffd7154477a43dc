"""Generated from proto/kv_bridge.proto by `python -m flashpd.kv_bridge.gen_proto`; do not edit."""
from . import kv_bridge_pb2, kv_bridge_pb2_grpc

__all__ = ["kv_bridge_pb2", "kv_bridge_pb2_grpc"]
