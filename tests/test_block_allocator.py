"""The block allocator refuses a block it did not hand out (freed twice, the scratch block, another allocator's
id) before it changes anything: two sequences sharing a block would read each other's KV without a word."""
from __future__ import annotations

import pytest

from flashpd.engine.kv_cache import SCRATCH_BLOCK, BlockAllocator, BlockTable


def test_blocks_come_back_in_order_and_the_count_is_whole():
    a = BlockAllocator(9, 4)
    t, u = BlockTable(), BlockTable()
    a.ensure(t, 10)
    a.ensure(u, 4)
    assert t.blocks == [1, 2, 3] and u.blocks == [4] and a.num_free == 4
    t.num_tokens = 10
    a.truncate(t, 5)
    assert t.blocks == [1, 2] and a.num_free == 5
    a.free(t)
    a.free(u)
    assert a.num_free == 8
    a.ensure(t, 32)
    assert sorted(t.blocks) == list(range(1, 9))


def test_a_block_freed_twice_is_refused_and_nothing_changes():
    a = BlockAllocator(9, 4)
    t = BlockTable()
    a.ensure(t, 8)
    twin = BlockTable(list(t.blocks), 8)  # a second table naming the same blocks (a bookkeeping bug)
    a.free(t)
    with pytest.raises(RuntimeError, match="not handed out"):
        a.free(twin)
    assert twin.blocks and a.num_free == 8
    with pytest.raises(RuntimeError, match="not handed out"):
        a.truncate(twin, 0)
    assert a.num_free == 8 and twin.blocks
    u = BlockTable()
    a.ensure(u, 8)  # a block handed out again is that table's, once
    assert len(set(u.blocks)) == 2


@pytest.mark.parametrize("blocks", [[SCRATCH_BLOCK], [9], [-1], [1, 1]])
def test_a_block_never_handed_out_or_named_twice_is_refused(blocks):
    a = BlockAllocator(9, 4)
    held = BlockTable()
    a.ensure(held, 4)  # block 1 is out
    free0 = a.num_free
    with pytest.raises(RuntimeError):
        a.free(BlockTable(list(blocks), 4))
    assert a.num_free == free0 and held.blocks == [1]
