"""One page table per group (SGLang's ReqToTokenPool), and the cache's one
admission question and verb."""

import numpy as np
import pytest
import torch

from cpkv import OwnerLaneAllocator
from cpkv.consumers.page_table import PageTable
from cpkv.consumers.prefix_cache import Admission, PrefixCache, PrefixCacheMisuse
from cpkv.engine.scheduler import Scheduler
from cpkv.engine.trace import RequestSpec


def test_rows_are_written_once_from_each_allocation_and_grow_on_demand():
    """``write_allocation`` scatters an allocation's slots into the rows of its
    requests (positions from the allocation); rows and width grow keeping the
    content; a freed row is padding again. [[RFC-0001:C-FLATTENED-ORDER]]"""
    alloc = OwnerLaneAllocator(64 * 4, 4, 2)
    t = PageTable(1, 4)
    rows = torch.tensor([t.take_row(), t.take_row()])  # the second row grows the table
    assert rows.tolist() == [0, 1] and t.req_to_token.shape[0] == 2
    a = alloc.allocate_extend([0, 0], [3, 6], [-1, -1])
    t.write_allocation(rows, a)  # 6 > width 4: grows
    assert t.slots(0, 0, 3).tolist() == a.out_cache_loc[:3].tolist()
    assert t.slots(1, 0, 6).tolist() == a.out_cache_loc[3:].tolist()
    assert (t.slots(0, 3) == -1).all()
    d = alloc.allocate_decode([4, 7], torch.stack([t.req_to_token[0, 2], t.req_to_token[1, 5]]))
    t.write_allocation(rows, d)
    assert t.req_to_token[0, 3] == d.out_cache_loc[0] and t.req_to_token[1, 6] == d.out_cache_loc[1]
    t.free_row(0, 4)  # O(1): the four written positions are reset when the row is taken again
    assert t.take_row() == 0 and (t.slots(0) == -1).all() and (t.slots(1, 0, 7) >= 0).all()
    t.free_row(1)  # by default the whole row
    assert t.take_row() == 1 and (t.slots(1) == -1).all()


def test_page_table_refuses_what_it_cannot_mean():
    """A free row freed again, a row past the table, and bad sizes raise;
    nothing changes. [[RFC-0001:C-FAIL-FAST]]"""
    t = PageTable(2, 4)
    r = t.take_row()
    t.write(r, 0, torch.tensor([5, 6]))
    before = t.req_to_token.clone()
    for bad in (1, 7, -1):
        with pytest.raises(ValueError, match="not taken"):
            t.free_row(bad)
    assert torch.equal(t.req_to_token, before)
    for args in ((0, 4), (2, 0), (2, 4, 0)):
        with pytest.raises(ValueError):
            PageTable(*args)


def test_free_rows_is_free_row_for_many_and_refuses_before_freeing():
    """``free_rows`` frees each row as ``free_row`` does (in order: the last
    freed is taken first); a row not taken, named twice, a ``used`` out of
    range or of another length raises ``ValueError`` and frees nothing.
    [[RFC-0001:C-FAIL-FAST]]"""
    t = PageTable(4, 4)
    rows = [t.take_row() for _ in range(3)]
    for r in rows:
        t.write(r, 0, torch.tensor([r + 1] * 4))
    for bad_rows, used in (([0, 3], None), ([0, 0], None), ([0, 1], [2, 5]), ([0, 1], [2]), ([0, 1], [-1, 2])):
        with pytest.raises(ValueError):
            t.free_rows(bad_rows, used)
        assert t._taken[:3] == [True] * 3 and not t._taken[3]
    t.free_rows([2, 0], [4, 4])
    assert t.take_row() == 0 and (t.slots(0) == -1).all()
    assert t.take_row() == 2 and (t.slots(2) == -1).all() and t.slots(1).tolist() == [2] * 4


def test_the_scheduler_keeps_one_table_and_a_row_per_request():
    """Every forward names its rows in the scheduler's one table, and each
    request's slots are a view of its row there: nothing holds a second copy.
    [[RFC-0001:C-DOWNSTREAM-CONTRACT]]"""
    specs = [RequestSpec(f"r{i}", 0, tuple(range(i, i + 9)), 3) for i in range(3)]
    cache = PrefixCache(OwnerLaneAllocator(64 * 4 * 2, 4, 2))
    sched = Scheduler(specs, cache, chunk=8)
    while not sched.done:
        plan = sched.plan()
        for f in plan.forwards():
            assert f.table is sched.table
            for r, row in zip(f.requests, f.rows.tolist()):
                assert r.row == row and r.slots.data_ptr() == sched.table.slots(row).data_ptr()
                assert (r.slots[: r.computed] >= 0).all() and (r.slots[r.computed :] == -1).all()
        sched.complete(plan, [[7] * len(f.requests) for f in plan.forwards()])
    rows = [sched.table.take_row() for _ in range(sched.table.req_to_token.shape[0])]  # every row given back,
    assert (sched.table.req_to_token[rows] == -1).all()  # and all padding when taken again


def test_admission_is_one_question_and_one_verb():
    """``can_allocate`` answers without changing anything, and its ``need``
    is the pages per lane the request then takes; ``allocate`` takes exactly
    that match (from the admission or the lookup's hit alike); anything else
    is refused, nothing changed. [[RFC-0001:C-PREFIX-CACHE]]"""
    cache = PrefixCache(OwnerLaneAllocator(16 * 2 * 2, 2, 2))
    m = cache.allocate(cache.lookup((1, 2, 3, 4, 5)))
    a = cache.allocate_extend([0], [5], torch.tensor([-1]))
    cache.finish([m], (1, 2, 3, 4, 5), a.out_cache_loc, [5])
    before = (cache.snapshot(), cache.alloc.snapshot())
    adm = cache.can_allocate((1, 2, 3, 9, 9, 9), 8)
    assert isinstance(adm, Admission) and (cache.snapshot(), cache.alloc.snapshot()) == before
    hit = cache.lookup((1, 2, 3, 9, 9, 9))
    assert adm.host_len == 0 and (adm.hit.length, adm.hit.shared) == (hit.length, hit.shared)
    assert adm.fits(np.zeros(2, dtype=np.int64)) and not adm.fits(adm.spare)
    for bad in (m, (1, 2, 3), None):
        with pytest.raises(PrefixCacheMisuse, match="not-a-hit"):
            cache.allocate(bad)
        assert (cache.snapshot(), cache.alloc.snapshot()) == before
    got = cache.allocate(adm)
    assert (got.length, got.shared) == (hit.length, hit.shared) and got.copy_dst.numel() == 1
    rest = cache.allocate_extend([got.length], [8], torch.tensor([got.last_loc]))
    own = np.concatenate([got.copy_dst.numpy(), rest.out_cache_loc.numpy()]) // 2
    assert np.bincount(np.unique(own) % 2, minlength=2).tolist() == adm.need.tolist()
    cache.finish([got], None, torch.cat([got.copy_dst, rest.out_cache_loc]), [6], cache=False)
    again = cache.allocate(hit)  # the hit, looked up before those calls: the same match now
    assert (again.length, again.shared) == (hit.length, hit.shared)
    cache.finish([again], None, again.copy_dst, [1], cache=False)
