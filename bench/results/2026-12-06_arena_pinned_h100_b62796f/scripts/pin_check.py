"""The pinned-arena test's body without pytest (the device may lack the test suite's imports)."""
import time
import torch
from flashpd.kv_bridge import arena
from flashpd.kv_bridge.arena import ArenaMaps
from flashpd.kv_bridge.arena_store import ArenaStore
from flashpd.kv_bridge.chunk import KVChunk

g = torch.Generator().manual_seed(3)
c = KVChunk("3" * 64, "", "fp", list(range(64)), torch.randn(2, 2, 64, 2, 16, generator=g), torch.randn(1, 2, 64, 2, 16, generator=g))
s = ArenaStore(1 << 22)
assert s.put(c)
h = s.get_handle(c.key)
maps = ArenaMaps(arena.CudaPinner())
view = maps.view(h.arena, h.offset, h.length)
t = time.monotonic()
while maps.stats()["pinned"] != 1:
    assert time.monotonic() - t < 10
    time.sleep(0.01)
got = KVChunk.from_bytes(view, s.secret.mac_key, share=True)
print("is_pinned", got.target_kv.is_pinned(), "equal", torch.equal(got.target_kv.to("cuda").cpu(), c.target_kv))
del got, view
maps.close()
t = time.monotonic()
while maps._jobs is not None or maps.stats()["mapped"]:
    assert time.monotonic() - t < 10
    time.sleep(0.01)
print("pin_check ok", maps.stats())
