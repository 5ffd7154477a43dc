"""A worker's load as its health reply and the HTTP /health report it (one typed object, not a dict)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Load:
    """Requests running and waiting, and the KV cache's free and total blocks and block size. `serving`: set by
    a backend whose readiness is more than being alive (the router: some decode worker is healthy); None means
    "as the backend's `alive`"."""

    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_block_size: int
    serving: bool | None = None

    def as_dict(self) -> dict:
        """The fields as a dict, `serving` only where it was set (the /health JSON and worker stats)."""
        d = asdict(self)
        if self.serving is None:
            del d["serving"]
        return d
