"""Another numbering of a group's ranks (cpkv.runtime.reorder), on thread ranks: collectives and messages land
where the new numbering says. Under torchrun the same wrappers run on processes (tests/runtime/test_torchrun.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.runtime.comm import LocalComm, run_threads
from cpkv.runtime.p2p import thread_p2p
from cpkv.runtime.reorder import ReorderedComm, ReorderedP2P


@given(st.integers(1, 5).flatmap(lambda n: st.permutations(range(n))))
def test_reordered_ranks_gather_and_message_in_the_new_order(order):
    """[[RFC-0001:C-DISAGG]]: world rank i < M is prefill rank i, whatever rank the launcher gave it."""
    n = len(order)
    p2ps = thread_p2p(n, timeout=30)

    def body(comm):
        w = ReorderedComm(comm, order)
        rows = w.all_gather(torch.full((w.rank + 1, 3), w.rank))
        rows_sized = w.all_gather(torch.full((w.rank + 1, 3), w.rank), sizes=[i + 1 for i in range(n)])
        objs = w.all_gather_object((w.rank, comm.rank))
        w.barrier()
        t = ReorderedP2P(p2ps[comm.rank], order)
        nxt, prv = (w.rank + 1) % n, (w.rank - 1) % n
        buf = torch.empty(2)
        if n > 1:
            t.post([(nxt, torch.tensor([w.rank, 7.0]))], [(prv, buf)]).wait()
        return w.rank, rows, rows_sized, objs, buf.tolist() if n > 1 else None

    out = run_threads(n, body, timeout=60)
    for inner, (new, rows, rows_sized, objs, got) in enumerate(out):
        assert order[new] == inner
        for gathered in (rows, rows_sized):
            assert [r.tolist() for r in gathered] == [[[i] * 3] * (i + 1) for i in range(n)]
        assert objs == [(i, order[i]) for i in range(n)]
        if n > 1:
            assert got == [(new - 1) % n, 7.0]


def test_reordering_refuses_what_is_not_a_permutation():
    with pytest.raises(ValueError, match="order must be a permutation of the group's 1 ranks"):
        ReorderedComm(LocalComm(), [1])
    with pytest.raises(ValueError, match="order must list distinct ranks"):
        ReorderedP2P(thread_p2p(2)[0], [1, 1])
    with pytest.raises(ValueError, match="order must list distinct ranks"):
        ReorderedP2P(thread_p2p(2)[0], [-1, 0])
    w = ReorderedComm(LocalComm(), [0])
    with pytest.raises(ValueError, match="all_gather sizes"):
        w.all_gather(torch.zeros(2, 1), sizes=[3])
    t = ReorderedP2P(thread_p2p(2)[0], [1, 0])
    with pytest.raises(ValueError, match="peer 2 is outside the reordered group of 2 ranks"):
        t.post([(2, torch.zeros(1))], [])
