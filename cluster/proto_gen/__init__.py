"""Generated from proto/generation.proto by `python -m flashpd.kv_bridge.gen_proto`; do not edit."""
from . import generation_pb2, generation_pb2_grpc

__all__ = ["generation_pb2", "generation_pb2_grpc"]
