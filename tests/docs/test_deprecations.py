"""Every call CHANGELOG.md lists as deprecated still works for one release,
with a ``DeprecationWarning`` naming its replacement, and does what the new
form does; cpkv itself never calls one (``pyproject.toml`` turns such a
warning raised from cpkv's own code into an error, which the last test checks).
[[RFC-0001:C-PREFIX-CACHE]]"""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from cpkv import OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers
from cpkv.consumers.prefix_cache import PrefixCache, PrefixCacheMisuse
from cpkv.consumers.row_batches import RowBatches
from cpkv.runtime.runner import CPRunner

CHANGELOG = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
S, N = 2, 2
SEQ = (1, 2, 3, 4, 5)


def _caches():
    """Two caches holding SEQ, one made with the old calls and one with the new; each asserts the warnings."""
    old, new = PrefixCache(OwnerLaneAllocator(16 * N * S, S, N)), PrefixCache(OwnerLaneAllocator(16 * N * S, S, N))
    with pytest.warns(DeprecationWarning, match=r"acquire.*allocate\(lookup"):
        m = old.acquire(SEQ)
    a = old.allocate_extend([0], [5], torch.tensor([-1]))
    with pytest.warns(DeprecationWarning, match=r"insert\(tokens, slots, match\).*finish"):
        old.insert(SEQ, a.out_cache_loc, m)
    m = new.allocate(new.lookup(SEQ))
    b = new.allocate_extend([0], [5], torch.tensor([-1]))
    new.finish([m], SEQ, b.out_cache_loc, [5])
    return old, new


def test_every_deprecated_prefix_cache_call_works_and_warns():
    old, new = _caches()
    assert old.snapshot() == new.snapshot()
    q = SEQ + (6, 7, 8)
    hit_old = old.lookup(q)
    with pytest.warns(DeprecationWarning, match=r"lane_need.*can_allocate"):
        assert old.lane_need(hit_old, 9).tolist() == new.can_allocate(q, 9).need.tolist()
    for name, want in (("evictable_pages", new.sizes().evictable), ("lane_cached_pages", new.sizes().cached)):
        with pytest.warns(DeprecationWarning, match=rf"{name}.*sizes"):
            assert getattr(old, name)().tolist() == want.tolist()
    with pytest.warns(DeprecationWarning, match=r"cached_pages\(\).*sizes"):
        assert old.cached_pages() == int(new.sizes().cached.sum())
    for name in ("layout", "num_pages", "lane_pages"):
        with pytest.warns(DeprecationWarning, match=rf"{name}.*alloc\.{name}"):
            got = getattr(old, name)
        want = getattr(new.alloc, name)
        assert (got == want).all() if isinstance(want, np.ndarray) else got is old.alloc.layout or got == want
    with pytest.warns(DeprecationWarning, match=r"lane_free_pages.*alloc"):
        assert old.lane_free_pages() == new.alloc.lane_free_pages()
    with pytest.warns(DeprecationWarning, match=r"is_allocated.*alloc"):
        assert old.is_allocated([1, 2, 3]).tolist() == new.alloc.is_allocated([1, 2, 3]).tolist()
    # a running request: its pages cached live, its tail cached at the end, then a release
    for c in (old, new):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            m = c.acquire(q)
        a = c.allocate_extend([m.length], [8], torch.tensor([m.last_loc]))
        run = torch.cat([m.copy_dst, a.out_cache_loc])
        if c is old:
            with pytest.warns(DeprecationWarning, match=r"cache_pages\(match, tokens, slots\)"):
                assert old.cache_pages(m, q[m.shared : 6], run[:2]) is True
            with pytest.warns(DeprecationWarning, match=r"insert_tail\(match"):
                old.insert_tail(m, q[6:], run[2:])
        else:
            assert new.cache_pages([m], q[m.shared : 6], run[:2], [2]).tolist() == [True]
            new.finish([m], q[6:], run[2:], [2])
    assert old.snapshot() == new.snapshot()
    for c in (old, new):
        m = c.allocate(c.lookup(q + (9,)))
        a = c.allocate_extend([m.length], [9], torch.tensor([m.last_loc]))
        if c is old:
            with pytest.warns(DeprecationWarning, match=r"release\(match, slots\).*cache=False"):
                old.release(m, torch.cat([m.slots, a.out_cache_loc]))
        else:
            new.finish([m], None, a.out_cache_loc, [1], cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ms = [c.acquire(q + (7,)) for c in (old, new)]
    with pytest.warns(DeprecationWarning, match=r"cache_pages_many"), pytest.raises(PrefixCacheMisuse) as e:
        old.cache_pages_many([ms[0]], (), [], [0])  # an empty run is not whole pages: refused as cache_pages does
    assert e.value.rule == "not-whole-pages"
    with pytest.warns(DeprecationWarning, match=r"insert_tails.*finish"):
        old.insert_tails([ms[0]], [], [], [0])
    new.finish([ms[1]], [], [], [0])
    assert old.snapshot()[0] == new.snapshot()[0] and old.alloc.snapshot() == new.alloc.snapshot()


def test_the_old_runner_form_works_and_warns(llama):
    """``CPRunner(adapter, pool, allocator, max_requests=, max_len=)`` with its
    own rows (allocate, extend, finish) computes what the new form over a
    :class:`RowBatches` computes."""
    layout = SharedKVLayout(1, 4, 16)
    fams = llama.families()
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))
    out = []
    for old in (True, False):
        pool = SharedKVPool(layout, 0, fams, allocate_buffers(layout, fams))
        alloc = OwnerLaneAllocator((layout.num_pages - 1) * 4, 4, 1, layout=layout)
        if old:
            with pytest.warns(DeprecationWarning, match=r"CPRunner\(adapter, pool, allocator"):
                run = CPRunner(llama, pool, alloc, max_requests=2, max_len=32)
            a, idx, lg = run.extend([1], [ids])
            assert run.lens.tolist() == [0, 9] and int(run.last_loc(torch.tensor([1]))[0]) == a.out_cache_loc[-1]
            run.finish(1)
        else:
            rows, run = RowBatches(alloc, 2, 32), CPRunner(llama, pool)
            a = rows.allocate([1], [9])
            idx, lg = run.forward([1], a, ids, table=rows.table)
            pool.release(rows.free(1))
            with pytest.raises(AttributeError, match="forwards only"):
                run.allocate([1], [9])
        out.append((a.out_cache_loc, idx, lg, alloc.lane_free_pages()))
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(*out))


def test_page_table_rows_still_copies_whole_rows_with_a_warning():
    from cpkv.consumers.page_table import PageTable

    t = PageTable(3, 8)
    t.write(1, 0, torch.arange(4))
    with pytest.warns(DeprecationWarning, match=r"PageTable.rows.*req_to_token\[:, :L\]\[rows\]"):
        got = t.rows(torch.tensor([1]))
    assert got.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]]


def test_changelog_lists_every_deprecated_form():
    for name in ("acquire", "insert(tokens, slots, match)", "insert_tail", "insert_tails", "release(match, slots)",
                 "cache_pages(match, tokens, slots)", "cache_pages_many", "lane_need", "evictable_pages",
                 "lane_cached_pages", "cached_pages()", "lane_free_pages()", "is_allocated()",
                 "hook(tokens, slots)", "CPRunner(adapter, pool, allocator, comm", "PageTable.rows(rows)"):
        assert name in CHANGELOG, name


def test_cpkv_never_calls_a_deprecated_form_itself():
    """The filter in pyproject.toml: a deprecated call made from cpkv's own
    code is an error; the same call from a test only warns."""
    cache = PrefixCache(OwnerLaneAllocator(16 * N * S, S, N))
    with pytest.warns(DeprecationWarning):
        cache.cached_pages()  # from here: a warning
    filters = [f for f in warnings.filters if f[0] == "error" and f[2] is DeprecationWarning]
    assert any(f[1] is not None and f[1].match("PrefixCache.x is deprecated and goes in cpkv 0.3: use y")
               and f[3] is not None and f[3].match("cpkv.engine.scheduler") and not f[3].match("test_deprecations")
               for f in filters), "the pyproject filter is not in force"
