"""The transfer plan and its data moves between CP groups of different sizes and page sizes.

Property tests over every (M, N) in {1, 2, 3, 4, 8}^2, equal and unequal page
sizes, random page chains on both sides (prefixes on the source, a
destination that already holds a prefix, requests sharing source pages):
exact cover, owner-only sends and writes, runs that never leave a page,
identical plans from identical allocator replicas. Then the bytes: one message
per rank pair carrying every family and layer, written by the destination
owners only. [[RFC-0001:C-DISAGG]] [[RFC-0001:C-DOWNSTREAM-CONTRACT]]
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout, UnsupportedPagePlan
from cpkv.consumers.transfer import (message_nbytes, pack_message, plan_transfer, receive_transfer, send_transfer,
                                   slot_pairs, unpack_message)
from cpkv.consumers.kv_pool import Family, SharedKVPool, allocate_buffers
from cpkv.contract.layout import page_of
from cpkv.runtime.p2p import thread_p2p

SIZES = [1, 2, 3, 4, 8]
PAGES = [1, 2, 4, 16]
MAX_LEN = 40


@st.composite
def cases(draw):
    """Two groups and a transfer of 1-3 requests: per request its length, the
    source prefix it was continued from, the destination's own prefix (not
    transferred) and whether it shares whole source pages with request 0."""
    M, N = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    Sp = draw(st.sampled_from(PAGES))
    Sd = draw(st.sampled_from(PAGES)) if draw(st.booleans()) else Sp
    reqs = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, MAX_LEN))
        reqs.append((n, draw(st.integers(0, n)), draw(st.integers(0, n - 1)), i > 0 and draw(st.booleans())))
    return M, N, Sp, Sd, draw(st.integers(0, 30)), draw(st.integers(0, 30)), reqs


def allocate(case):
    """Allocate the case on fresh allocators of both groups: returns the two
    allocators, the per-request source and destination slots of the
    transferred positions, and those positions."""
    M, N, Sp, Sd, warm_p, warm_d, reqs = case
    pa = OwnerLaneAllocator(Sp * M * (4 * MAX_LEN // Sp + 16), Sp, M)
    da = OwnerLaneAllocator(Sd * N * (4 * MAX_LEN // Sd + 16), Sd, N)
    for a, warm in ((pa, warm_p), (da, warm_d)):  # the two groups' lanes differ
        if warm:
            a.allocate_extend([0], [warm], torch.tensor([-1]))

    def chain(alloc, n, prefix, base=None):
        parts, last = [], -1
        if base is not None:
            parts, last = [base[:prefix]], int(base[prefix - 1])
        elif prefix:
            parts.append(alloc.allocate_extend([0], [prefix], torch.tensor([-1])).out_cache_loc)
            last = int(parts[-1][-1])
        if n > prefix:
            parts.append(alloc.allocate_extend([prefix], [n], torch.tensor([last])).out_cache_loc)
        return torch.cat(parts)

    src, dst, pos, first = [], [], [], None
    for n, p, h, share in reqs:
        k = min(n, first.numel()) // Sp * Sp if share else 0  # whole source pages of request 0
        s = chain(pa, n, k, first) if k else chain(pa, n, p)
        first = s if first is None else first
        d = chain(da, n, h)
        src.append(s[h:])
        dst.append(d[h:])
        pos.append(torch.arange(h, n))
    return pa, da, src, dst, pos


@given(cases())
def test_plan_covers_every_destination_slot_once_from_its_owner(case):
    """Exact cover (every destination slot written once, from the source slot
    of the same position), owner-only sends and writes, one message per rank
    pair, runs inside one page on both sides and as few as the two page grids
    allow (pages when the page sizes agree)."""
    pa, da, src, dst, pos = allocate(case)
    M, N, Sp, Sd = case[:4]
    plan = plan_transfer(pa.layout, da.layout, src, dst)
    S_all, D_all = torch.cat(src), torch.cat(dst)
    T = S_all.numel()
    seen = []
    for a in range(M):
        for b in range(N):
            e, s, d = plan.entries(a, b), plan.send_slots(a, b), plan.recv_slots(a, b)
            assert s.numel() == d.numel() == e.numel() == int(plan.pair_slots[a, b])
            assert torch.equal(S_all[e], s) and torch.equal(D_all[e], d)  # the right source for every destination
            assert (pa.layout.owner_of_slots(s) == a).all() and (da.layout.owner_of_slots(d) == b).all()
            seen.append(e)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(T))  # every entry exactly once
    assert plan.pairs() == [(a, b) for a in range(M) for b in range(N) if plan.pair_slots[a, b] > 0]
    assert sum(len(plan.destinations_of(a)) for a in range(M)) == len(plan.pairs())
    end = plan.src_start + plan.length - 1
    assert torch.equal(page_of(plan.src_start, Sp), page_of(end, Sp))
    assert torch.equal(page_of(plan.dst_start, Sd), page_of(plan.dst_start + plan.length - 1, Sd))
    req = torch.repeat_interleave(torch.arange(len(pos)), torch.tensor([p.numel() for p in pos]))
    p_all = torch.cat(pos)
    cells = torch.unique(torch.stack([req, p_all // Sp, p_all // Sd]), dim=1).shape[1]
    assert plan.num_runs == cells  # one run per (request, source page, destination page) piece
    assert plan.unit == ("page" if Sp == Sd else "slot-run")
    pairs = slot_pairs(plan)
    assert torch.equal(pairs["src_slot"], S_all) and torch.equal(pairs["dst_slot"], D_all)
    assert torch.equal(pairs["dst_local"], da.layout.translate_write_slots(D_all))


@given(cases())
def test_every_rank_plans_the_same_bytes(case):
    """Two allocator replicas driven by the same calls (two ranks, of either
    group) plan the same transfer to the byte, with no communication."""
    one, two = allocate(case), allocate(case)
    p1 = plan_transfer(one[0].layout, one[1].layout, one[2], one[3])
    p2 = plan_transfer(two[0].layout, two[1].layout, two[2], two[3])
    assert p1.digest() == p2.digest()
    for name in ("src_start", "dst_start", "length", "src_rank", "dst_rank", "entry", "pair_slots", "pair_offsets"):
        assert torch.equal(getattr(p1, name), getattr(p2, name))


def test_misaligned_offsets_and_empty_transfers_are_planned():
    """Well formed is enough: equal page sizes with different in-page offsets
    move by slot runs, and an empty transfer is an empty plan."""
    L = SharedKVLayout(2, 4, 8)
    plan = plan_transfer(L, L, torch.tensor([9, 10, 11, 12]), torch.tensor([5, 6, 7, 8]))
    assert plan.num_slots == 4 and plan.num_runs == 2
    assert torch.equal(slot_pairs(plan)["dst_slot"], torch.tensor([5, 6, 7, 8]))
    empty = plan_transfer(L, SharedKVLayout(3, 2, 4), [], [])
    assert empty.num_slots == 0 and empty.pairs() == [] and empty.sources_of(2) == []


MISUSE = {
    "mismatched-requests": ([torch.tensor([4])], [torch.tensor([4]), torch.tensor([5])], None),
    "mismatched-lengths": ([torch.tensor([4]), torch.tensor([5, 6])], [torch.tensor([4]), torch.tensor([8])], 1),
    "padding-slot": ([torch.tensor([4, 5]), torch.tensor([6])], [torch.tensor([4, 5]), torch.tensor([-1])], 1),
    "slot-out-of-range": ([torch.tensor([4, 64])], [torch.tensor([4, 5])], 0),
    "reserved-page": ([torch.tensor([4, 5])], [torch.tensor([4, 1])], 0),
    "doubled-destination-slot": ([torch.tensor([4]), torch.tensor([5])], [torch.tensor([6]), torch.tensor([6])], 1),
    "bad-slots": ([torch.tensor([4.0])], [torch.tensor([4])], 0),
}


@pytest.mark.parametrize("rule", list(MISUSE))
def test_a_pairing_that_misses_or_doubles_a_slot_is_refused(rule):
    """Each malformed pairing is refused with its rule and the request it
    concerns; the inputs are left as they were."""
    L = SharedKVLayout(2, 4, 8)
    src, dst, req = MISUSE[rule]
    before = [t.clone() for t in src + dst]
    with pytest.raises(UnsupportedPagePlan, match=rule) as e:
        plan_transfer(L, SharedKVLayout(3, 2, 8), src, dst)
    assert e.value.rule == rule and e.value.request == req
    assert all(torch.equal(x, y) for x, y in zip(before, src + dst))


def test_a_source_slot_may_feed_several_destinations_and_layouts_are_checked():
    L = SharedKVLayout(2, 4, 8)
    plan = plan_transfer(L, L, [torch.tensor([4, 5]), torch.tensor([4, 5])], [torch.tensor([8, 9]), torch.tensor([12, 13])])
    assert plan.num_slots == 4
    with pytest.raises(UnsupportedPagePlan, match="not-a-layout"):
        plan_transfer(L, "layout", torch.tensor([4]), torch.tensor([4]))
    with pytest.raises(ValueError, match="source rank 2"):
        plan.send_slots(2, 0)


# -- the bytes ---------------------------------------------------------------------------------
# an odd-sized byte family first: the next families' parts must still start aligned
FAMILIES = (Family("scale", (3,), (0,), torch.uint8), Family("latent", (5,), (0, 1, 2), torch.float32),
            Family("index_k", (3,), (1,), torch.bfloat16))


class Recorder:
    """A transport that records what it sends."""

    def __init__(self, inner):
        self.inner, self.sent = inner, []

    def post(self, sends, recvs):
        self.sent += [(peer, t.numel()) for peer, t in sends]
        return self.inner.post(sends, recvs)


def _pools(layout, families):
    bufs = allocate_buffers(layout, families)
    return bufs, [SharedKVPool(layout, k, families, bufs) for k in range(layout.cp_size)]


def _random(f, shape):
    if f.dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8)
    return torch.randn(shape).to(f.dtype)


@pytest.mark.parametrize("M,N,Sp,Sd", [(4, 2, 16, 4), (2, 3, 4, 16), (3, 3, 2, 2), (1, 8, 1, 2)])
def test_owners_move_every_family_in_one_message_per_pair(M, N, Sp, Sd):
    """Each source owner sends one message per destination rank (every family,
    every layer, every request) read from its own segment; each destination
    owner writes only its own segment; afterwards every destination slot
    holds, bit for bit, what the source slot of its position held, in every
    family and layer, and nothing else changed."""
    torch.manual_seed(0)
    pa, da, src, dst, _ = allocate((M, N, Sp, Sd, 7, 3, [(37, 20, 5, False), (23, 0, 0, False), (30, 0, 9, True)]))
    plan = plan_transfer(pa.layout, da.layout, src, dst)
    _, p_pools = _pools(pa.layout, FAMILIES)
    d_bufs, d_pools = _pools(da.layout, FAMILIES)
    S_all, D_all = torch.cat(src), torch.cat(dst)
    used = torch.unique(S_all)
    truth = {f.name: _random(f, (len(f.layers), used.numel(), *f.shape)) for f in FAMILIES}
    for a, pool in enumerate(p_pools):  # each source owner writes its own pages
        mine = pa.layout.owned_slot_mask(used, owner_rank=a)
        pool.write_all_layers(used[mine], {n: v[:, mine] for n, v in truth.items()})
    links = [Recorder(t) for t in thread_p2p(M + N)]
    for a, pool in enumerate(p_pools):
        pending, sent = send_transfer(plan, pool, links[a], lambda b: M + b)
        pending.wait()
        assert sorted(sent) == plan.destinations_of(a)
    assert [(a, peer - M) for a in range(M) for peer, _ in links[a].sent] == plan.pairs()  # one message per pair
    for a in range(M):
        for peer, nbytes in links[a].sent:
            assert nbytes == message_nbytes(FAMILIES, int(plan.pair_slots[a, peer - M]))
    spr = da.layout.slots_per_rank
    for b, pool in enumerate(d_pools):
        before = {n: t.clone() for n, t in d_bufs.items()}
        got = receive_transfer(plan, pool, links[M + b], lambda a: a)
        assert sorted(got) == plan.sources_of(b)
        for n, t in d_bufs.items():  # only rank b's own segment changed
            changed = torch.nonzero((t != before[n]).reshape(t.shape[0], t.shape[1], -1).any(-1).any(0)).flatten()
            assert ((changed >= b * spr) & (changed < (b + 1) * spr)).all()
    out = d_pools[0].read_all_layers(D_all)
    where = torch.searchsorted(used, S_all)
    for n, v in truth.items():
        assert torch.equal(out[n].view(torch.uint8), v[:, where].contiguous().view(torch.uint8))
    untouched = torch.ones(da.layout.capacity, dtype=torch.bool)
    untouched[D_all] = False
    rest = d_pools[0].read_all_layers(torch.nonzero(untouched).flatten())
    assert all(int(torch.count_nonzero(x)) == 0 for x in rest.values())


def test_only_the_owner_reads_its_pages_for_sending_and_messages_are_checked():
    L = SharedKVLayout(2, 4, 8)
    _, pools = _pools(L, FAMILIES)
    with pytest.raises(ContractViolation, match="rank 0 asked to read slot 4, which rank 1 owns"):
        pools[0].read_owned_all_layers(torch.tensor([8, 4]))
    plan = plan_transfer(L, SharedKVLayout(1, 4, 8), torch.tensor([4, 5]), torch.tensor([4, 5]))
    with pytest.raises(UnsupportedPagePlan, match="layout-mismatch"):  # a source pool is not the destination
        receive_transfer(plan, pools[0], None, lambda a: a)
    values = pools[1].read_owned_all_layers(torch.tensor([4, 5]))
    msg = pack_message(FAMILIES, values)
    assert msg.numel() == message_nbytes(FAMILIES, 2) and msg.numel() % 16 == 0
    assert all(torch.equal(unpack_message(FAMILIES, msg, 2)[n], v) for n, v in values.items())
    with pytest.raises(ContractViolation, match="cannot hold 3 slots"):
        unpack_message(FAMILIES, msg, 3)


def test_thread_transport_refuses_bad_peers_and_times_out():
    a, b = thread_p2p(2, timeout=0.2)
    with pytest.raises(ValueError, match="cannot exchange a message with 0"):
        a.post([(0, torch.zeros(1))], [])
    with pytest.raises(TimeoutError, match="no message from 0"):
        b.post([], [(0, torch.zeros(1))]).wait()
    a.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        b.post([], [(0, torch.zeros(1))]).wait()
