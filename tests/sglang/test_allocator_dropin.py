"""cpkv's SGLangAllocator where SGLang's PagedTokenToKVPoolAllocator stands, proven with SGLang's own classes.

1. SGLang's CPU allocator tests, re-stated: the paged-allocator cases of SGLang's
   ``test/registered/unit/mem_cache/test_allocator_cpu.py`` (sgl-project/sglang, the ``TestPagedAllocatorCPU``,
   ``TestPagedAllocatorDebugModeCPU`` and base-class cases that a paged allocator answers), written here in our
   words and run against SGLang 0.5.23's class and cpkv's alike: the ``make`` fixture patches the class name.
   Differences are the table's rows in docs/sglang.md (each case that meets one says which).
2. A differential: the same random calls (extend, decode, alloc, free, free groups, backup/restore) on SGLang's
   paged allocator and cpkv's at N 1 give the same slots, call for call, and the same free list; at N 2, 4, 8
   cpkv's owner-lane invariant holds on every call, side by side with SGLang's kv-shard allocator
   (``PageInterleavePoolAllocator``) on the same calls. [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-FAIL-FAST]]
"""

import os
import random
from unittest.mock import MagicMock, patch

import numpy as np
import pytest
import torch

from cpkv.contract.errors import InvalidFree, UnsupportedPagePlan
from cpkv.contract.sglang import SGLangAllocator, SGLangKVShardAllocator
from support.sglang_classes import ALLOCATOR, sglang_classes

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sg():
    return sglang_classes(*ALLOCATOR)


@pytest.fixture(params=["sglang", "cpkv"])
def make(request, sg):
    """The class under test, built as SGLang's tests build it: ``(size, page_size, dtype, device, kvcache,
    need_sort)``; ``which`` says which one it is."""
    cls = sg.allocator.PagedTokenToKVPoolAllocator if request.param == "sglang" else SGLangAllocator

    def build(size=64, page_size=4, need_sort=False, kvcache=None):
        return cls(size, page_size, torch.int64, "cpu", MagicMock() if kvcache is None else kvcache, need_sort)

    build.which = request.param
    return build


# -- 1. SGLang's CPU allocator tests, re-stated ----------------------------------------------------
def test_alloc_counts_and_sizes(make):
    a = make(64, 4)
    assert len(a.alloc(8)) == 8 and a.available_size() == 56


def test_alloc_over_capacity_is_none(make):
    """Short now: ``None`` from both. More than the whole pool: SGLang's ``None``, cpkv's refusal
    ``exceeds-capacity`` (it can never fit; docs/sglang.md)."""
    a = make(16, 4)
    a.alloc(8)
    assert a.alloc(12) is None and a.available_size() == 8
    for need_sort in (False, True):
        if make.which == "sglang":
            assert make(16, 4, need_sort=need_sort).alloc(20) is None
        else:
            with pytest.raises(UnsupportedPagePlan, match="exceeds-capacity"):
                make(16, 4, need_sort=need_sort).alloc(32)


def test_alloc_page_aligned_unique_never_slot_zero(make):
    a = make(64, 4)
    out = a.alloc(8)
    assert out[0] % 4 == 0 and out[4] % 4 == 0
    out = make(64, 4).alloc(64)
    assert len(torch.unique(out)) == 64 and 0 not in out.tolist()


def test_free_restores_and_reuses(make):
    a = make(32, 4)
    a.free(a.alloc(8))
    assert a.available_size() == 32
    a = make(16, 4)
    before = a.available_size()
    a.free(torch.tensor([], dtype=torch.int64))
    assert a.available_size() == before
    a.free(a.alloc(16))
    assert a.alloc(16) is not None


def test_need_sort_free_counts_at_once(make):
    a = make(32, 4, need_sort=True)
    a.free(a.alloc(4))
    assert a.available_size() == 32


def test_free_group_batches_until_end(make):
    a = make(32, 4)
    x, y = a.alloc(4), a.alloc(4)
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == 24
    a.free_group_end()
    assert a.available_size() == 32


def test_clear_restores_capacity(make):
    a = make(32, 4)
    a.alloc(32)
    a.clear()
    assert a.available_size() == 32


def test_base_surface(make):
    """What the base class gives every allocator: the kvcache back, a debug string, merge as a no-op when
    nothing is staged, and the free list as a tensor."""
    kv = MagicMock()
    a = make(32, 4, kvcache=kv)
    assert a.get_kvcache() is kv
    assert isinstance(a.debug_print(), str)
    before = a.free_pages.tolist()
    a.merge_and_sort_free()
    assert a.free_pages.tolist() == before == list(range(1, 9))
    assert a.available_size() == (len(a.free_pages) + len(a.get_all_free_pages()) - len(a.free_pages)) * 4


def test_backup_restore(make):
    """SGLang's former ``backup_state`` / ``restore_state`` (SGLang 0.5.23's paged allocator dropped them;
    cpkv keeps them: docs/sglang.md)."""
    if make.which == "sglang":
        pytest.skip("SGLang 0.5.23's PagedTokenToKVPoolAllocator has no backup_state (docs/sglang.md)")
    a = make(32, 4)
    state = a.backup_state()
    a.alloc(16)
    a.restore_state(state)
    assert a.available_size() == 32


def test_cpu_copy(make):
    """SGLang delegates ``get_cpu_copy`` to its KV cache; cpkv's allocator answers where the row lies (its
    pool copies per rank): docs/sglang.md."""
    kv = MagicMock()
    kv.get_cpu_copy.return_value = "data"
    a = make(16, 4, kvcache=kv)
    row = a.alloc(8)
    if make.which == "sglang":
        assert a.get_cpu_copy(row) == "data"
        a.load_cpu_copy("data", row)
        kv.load_cpu_copy.assert_called_once()
    else:
        copy = a.get_cpu_copy(row)
        assert (copy.length, copy.lane_base) == (8, 0)
        a.load_cpu_copy(copy, row)  # the same lane base: accepted
        kv.get_cpu_copy.assert_not_called()


@patch.dict(os.environ, {"SGLANG_DEBUG_MEMORY_POOL": "1"})
def test_debug_mode_refusals(make):
    """SGLang refuses these in its debug mode only (an assert); cpkv always, with a rule, nothing changed."""
    a = make(64, 4)
    if make.which == "sglang":
        with pytest.raises(AssertionError):
            a.alloc(3)
    else:
        before = a.allocator.snapshot()
        with pytest.raises(UnsupportedPagePlan, match="unaligned-need"):
            a.alloc(3)
        assert a.allocator.snapshot() == before
    out = a.alloc(4)
    assert out is not None
    a.free(out)
    if make.which == "sglang":
        with pytest.raises(AssertionError):  # after the pages went back twice: SGLang's list is corrupt
            a.free(out)
    else:
        before = a.allocator.snapshot()
        with pytest.raises(InvalidFree, match="double-free"):
            a.free(out)
        assert a.allocator.snapshot() == before


# -- 2. the differential ------------------------------------------------------------------------------
class _SGLangBackup:
    """SGLang 0.5.23's paged allocator has no ``backup_state``; its former one copied the free lists. The
    test keeps that copy itself (``free_pages`` and the staged frees) to replay the same calls."""

    @staticmethod
    def take(a):
        return a.free_pages.clone(), list(a.staged_pages), a.num_staged_pages

    @staticmethod
    def put(a, state):
        a.free_pages, a.staged_pages, a.num_staged_pages = state[0].clone(), list(state[1]), state[2]


def _ops(seed: int, n: int):
    rnd = random.Random(seed)
    return [rnd.choices(["extend", "decode", "alloc", "free", "group", "backup"], [5, 4, 1, 3, 1, 1])[0]
            for _ in range(n)], rnd


@pytest.mark.parametrize("seed", range(6))
def test_differential_n1_same_slots_call_for_call(sg, seed):
    """The same random calls on SGLang's paged allocator and cpkv's at N 1: the same slots for every request
    (as lists, so as sets), the same ``None`` when short, the same free list and ``available_size`` after
    every call."""
    S = 4
    ref = sg.allocator.PagedTokenToKVPoolAllocator(256, S, torch.int64, "cpu", MagicMock(), False)
    me = SGLangAllocator(256, S, torch.int64, "cpu", MagicMock(), False)
    ops, rnd = _ops(seed, 70)
    live: dict[int, list[int]] = {}  # request id -> its slots
    saved = None
    next_id = 0

    def both(call):
        a, b = call(ref), call(me)
        if a is None or b is None:
            assert a is None and b is None
        else:
            assert a.tolist() == b.tolist()
        return a

    for op in ops:
        if op == "extend":
            ids = [None] * rnd.randint(1, 3)
            cont = rnd.sample(list(live), min(len(live), rnd.randint(0, 2)))
            reqs = [(i, len(live[i])) for i in cont] + [(None, 0) for _ in ids]
            new = [rnd.randint(1, 11) for _ in reqs]
            pre = torch.tensor([p for _, p in reqs])
            seq = pre + torch.tensor(new)
            last = torch.tensor([live[i][-1] if i is not None else -1 for i, _ in reqs])
            out = both(lambda a: a.alloc_extend(pre, pre, seq, seq, last, sum(new)))
            if out is not None:
                at = 0
                for (i, _), k in zip(reqs, new):
                    if i is None:
                        i, next_id = next_id, next_id + 1
                        live[i] = []
                    live[i] += out[at : at + k].tolist()
                    at += k
        elif op == "decode" and live:
            ids = rnd.sample(list(live), rnd.randint(1, len(live)))
            seq = torch.tensor([len(live[i]) + 1 for i in ids])
            last = torch.tensor([live[i][-1] for i in ids])
            out = both(lambda a: a.alloc_decode(seq, seq, last))
            if out is not None:
                for i, s in zip(ids, out.tolist()):
                    live[i].append(s)
        elif op == "alloc":
            need = S * rnd.randint(0, 3)
            out = both(lambda a: a.alloc(need))
            if out is not None and len(out):
                live[next_id], next_id = out.tolist(), next_id + 1
        elif op == "free" and live:
            i = rnd.choice(list(live))
            both(lambda a: a.free(torch.tensor(live[i])))
            del live[i]
        elif op == "group" and live:
            ids = rnd.sample(list(live), min(len(live), 2))
            both(lambda a: a.free_group_begin())
            for i in ids:
                both(lambda a: a.free(torch.tensor(live[i])))
                del live[i]
            assert ref.available_size() == me.available_size()
            both(lambda a: a.free_group_end())
        elif op == "backup":
            if saved is None:
                saved = (_SGLangBackup.take(ref), me.backup_state(), {k: list(v) for k, v in live.items()})
            else:
                _SGLangBackup.put(ref, saved[0])
                me.restore_state(saved[1])
                live, saved = saved[2], None
        assert ref.available_size() == me.available_size()
        assert ref.free_pages.tolist() == me.free_pages.tolist()


def _owner_lane_ok(slots: list[int], S: int, N: int) -> bool:
    """Slot t of a request lies on a page owned by (b + t // S) % N for one b; its pages spread over the lanes
    within one page of each other."""
    if not slots:
        return True
    pages = np.asarray(slots) // S
    lanes = pages % N
    t = np.arange(len(slots))
    base = (lanes[0] - 0) % N
    counts = np.bincount(lanes[::S], minlength=N)
    return bool(((base + t // S) % N == lanes).all()) and counts.max() - counts.min() <= 1


@pytest.mark.parametrize("N", [2, 4, 8])
def test_differential_lanes_beside_kv_shard(sg, N):
    """At N 2, 4, 8 the same extends (fresh and page-aligned continuations: SGLang's kv-shard allocator takes
    no other, and no decode) and frees on SGLang's kv-shard allocator and cpkv's: both keep every request on
    its owner lanes after every call, and both refuse with ``None`` only when a lane is short."""
    S, pages_per_rank = 4, 24
    ref = sg.page_interleave.PageInterleavePoolAllocator(pages_per_rank * S, S, N, torch.int64, "cpu", MagicMock(),
                                                        False)
    me = SGLangAllocator(pages_per_rank * N * S, S, torch.int64, "cpu", MagicMock(), False, cp_size=N)
    rnd = random.Random(N)
    live = {"sglang": {}, "cpkv": {}}
    for step in range(60):
        if rnd.random() < 0.65 or not live["cpkv"]:
            cont = rnd.choice([None] + sorted(k for k in live["cpkv"] if len(live["cpkv"][k]) % S == 0))
            new = rnd.randint(1, 3 * S)
            for name, a in (("sglang", ref), ("cpkv", me)):
                slots = live[name].get(cont, [])
                pre = torch.tensor([len(slots)])
                seq = pre + new
                last = torch.tensor([slots[-1] if slots else -1])
                kw = {"rotation_bases": [None if cont is None else live[name + "_base"][cont]]} if a is ref else {}
                out = a.alloc_extend(pre, pre, seq, seq, last, new, **kw)
                if out is None:
                    continue
                key = step if cont is None else cont
                live[name][key] = slots + out.tolist()
                if a is ref:
                    live.setdefault("sglang_base", {})[key] = kw["rotation_bases"][0]
        else:
            key = rnd.choice(sorted(live["cpkv"]))
            for name, a in (("sglang", ref), ("cpkv", me)):
                if key in live[name]:
                    a.free(torch.tensor(live[name].pop(key)))
        for name in ("sglang", "cpkv"):
            assert all(_owner_lane_ok(s, S, N) for s in live[name].values()), name
    assert me.available_size() == N * S * min(me.class_free_page_counts())
    assert ref.available_size() == N * S * min(ref.class_free_page_counts())


@pytest.mark.parametrize("N", [2, 4, 8])
def test_kv_shard_call_for_call(sg, N):
    """cpkv's ``SGLangKVShardAllocator`` and SGLang's ``PageInterleavePoolAllocator`` on the same random calls
    (fresh extends with ``None`` or given rotation bases, page-aligned continuations with their chain's base and
    ``last_loc``, frees, free groups): the same slots, the same bases written back, the same class lists,
    ``available_size`` and ``least_full_class`` after every call. SGLang's ``page_interleave_shard_size`` reads N
    of cpkv's, and its kv-shard ``isinstance`` checks take it. [[RFC-0001:C-OWNER-LANE]]"""
    S, per_rank = 4, 12
    ref = sg.page_interleave.PageInterleavePoolAllocator(per_rank * S, S, N, torch.int64, "cpu", MagicMock(), False)
    me = SGLangKVShardAllocator(per_rank * S, S, N, torch.int64, "cpu", MagicMock(), False)
    assert sg.page_interleave.page_interleave_shard_size(me) == N
    assert isinstance(me, sg.page_interleave.PageInterleavePoolAllocator)
    assert isinstance(me, sg.allocator.PagedTokenToKVPoolAllocator)
    assert sg.page_interleave.page_interleave_shard_size(SGLangAllocator(64, 4, cp_size=N)) == 1
    rnd = random.Random(N)
    live: dict[int, tuple[list[int], int]] = {}  # request -> (its slots, its base)

    def both(call):
        a, b = call(ref), call(me)
        assert (a is None) == (b is None) and (a is None or a.tolist() == b.tolist())
        return a

    for step in range(120):
        op = rnd.random()
        if op < 0.6 or not live:
            aligned = sorted(k for k, (v, _) in live.items() if len(v) % S == 0)  # SGLang's kv-shard takes no other
            conts = rnd.sample(aligned, min(len(aligned), 1))
            reqs = [(k, live[k][0], live[k][1]) for k in conts] + [(None, [], rnd.choice([None, rnd.randrange(9)]))
                                                                   for _ in range(rnd.randint(0, 2) if conts else
                                                                                  rnd.randint(1, 3))]
            new = [rnd.randint(1, 3 * S) for _ in reqs]
            pre = torch.tensor([len(v) for _, v, _ in reqs])
            seq = pre + torch.tensor(new)
            last = torch.tensor([v[-1] if v else -1 for _, v, _ in reqs])
            lists = {id(ref): [b for *_, b in reqs], id(me): [b for *_, b in reqs]}
            out = both(lambda a: a.alloc_extend(pre, pre, seq, seq, last, sum(new), rotation_bases=lists[id(a)]))
            if out is not None:  # (on None SGLang has written its resolved bases back, cpkv leaves the list as it was)
                assert lists[id(ref)] == lists[id(me)]
                at = 0
                for (k, v, _), n, b in zip(reqs, new, lists[id(me)]):
                    live[step * 10 + len(live) if k is None else k] = (v + out[at : at + n].tolist(), b)
                    at += n
        elif op < 0.85:
            k = rnd.choice(sorted(live))
            both(lambda a: a.free(torch.tensor(live[k][0])))
            del live[k]
        else:
            ks = rnd.sample(sorted(live), min(len(live), 2))
            both(lambda a: a.free_group_begin())
            for k in ks:
                both(lambda a: a.free(torch.tensor(live[k][0])))
                del live[k]
            both(lambda a: a.free_group_end())
        assert [p.tolist() for p in ref.class_free_pages] == [p.tolist() for p in me.class_free_pages]
        assert (ref.available_size(), ref.least_full_class()) == (me.available_size(), me.least_full_class())
    assert all(_owner_lane_ok(v, S, N) for v, _ in live.values())


def test_misuse_refused_state_unchanged(sg):
    """What SGLang's allocator refuses (in debug mode) or silently corrupts, cpkv refuses, nothing changed."""
    a = SGLangAllocator(64, 4, torch.int64, "cpu", None, False)
    out = a.alloc_extend(torch.tensor([0]), torch.tensor([0]), torch.tensor([6]), torch.tensor([6]),
                         torch.tensor([-1]), 6)
    cases = [
        (UnsupportedPagePlan, lambda: a.alloc_extend(torch.tensor([6]), torch.tensor([6]), torch.tensor([9]),
                                                     torch.tensor([9]), torch.tensor([int(out[3])]), 3)),  # last_loc
        (UnsupportedPagePlan, lambda: a.alloc_decode(torch.tensor([9]), torch.tensor([9]), torch.tensor([int(out[5])]))),
        (UnsupportedPagePlan, lambda: a.alloc(5)),
        (InvalidFree, lambda: a.free(torch.tensor([1000]))),
        (InvalidFree, lambda: a.free(torch.tensor([40]))),  # a free page
        (RuntimeError, lambda: a.free_group_end()),
        (TypeError, lambda: a.restore_state("not a state")),
    ]
    for cls, call in cases:
        before = a.allocator.snapshot()
        with pytest.raises(cls):
            call()
        assert a.allocator.snapshot() == before
    with pytest.raises(AttributeError):
        a.free_pages = torch.tensor([1])  # read-only: SGLang's tests assign it, cpkv's state moves by calls


def test_cp_size_from_group_keyword_and_refusals(sg):
    """The CP size from a keyword, from SGLang's ``GroupCoordinator`` (what ``get_attn_cp_group()`` returns; one
    built here without a process group, only its ``world_size`` and ``rank_in_group`` set, which is all the
    allocator reads) or from a torch.distributed group (a one-rank gloo group here); disagreement and an
    out-of-range rank are refused."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    a = SGLangAllocator(64, 4, cp_size=2, cp_rank=1)
    assert (a.cp_size, a.cp_rank) == (2, 1)
    with pytest.raises(ValueError, match="cp_rank 2 not in"):
        SGLangAllocator(64, 4, cp_size=2, cp_rank=2)
    coordinator = GroupCoordinator.__new__(GroupCoordinator)
    coordinator.world_size, coordinator.rank_in_group = 4, 3
    c = SGLangAllocator(64, 4, cp_group=coordinator)
    assert (c.cp_size, c.cp_rank) == (4, 3) and c.class_free_page_counts() == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="disagree with cp_group"):
        SGLangAllocator(64, 4, cp_size=2, cp_group=coordinator)
    coordinator.rank_in_group = 4
    with pytest.raises(ValueError, match="not in"):
        SGLangAllocator(64, 4, cp_group=coordinator)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        g = dist.new_group([0])
        b = SGLangAllocator(64, 4, cp_group=g)
        assert (b.cp_size, b.cp_rank) == (1, 0)
        with pytest.raises(ValueError):
            SGLangAllocator(64, 4, cp_size=2, cp_group=g)
    finally:
        dist.destroy_process_group()


def test_free_ignores_padding_refuses_other_negatives():
    """``free`` takes a padded row (the layout's padding value, -1) as the row without it; any other negative
    slot is off the pool and refused, nothing freed."""
    a = SGLangAllocator(32, 4)
    row = a.alloc(8)
    a.free(torch.cat([row[:4], torch.tensor([-1, -1])]))
    assert a.available_size() == 28 and a.free_pages.tolist()[0] == int(row[0]) // 4
    before = a.allocator.snapshot()
    with pytest.raises(InvalidFree, match="free-out-of-range"):
        a.free(torch.cat([row[4:], torch.tensor([-2])]))
    assert a.allocator.snapshot() == before
