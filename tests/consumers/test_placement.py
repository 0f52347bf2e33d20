"""One placement rule for every index into a buffer (cpkv.consumers.placement): a test patches the helper
and sees every pool, host-tier, transfer, copy and check path call it, with the buffer it indexes (on a GPU a
CPU index into a device buffer raises; a copy between a device and pageable memory synchronises)."""

import sys

import pytest
import torch

from cpkv import SharedKVLayout
from cpkv.consumers import placement
from cpkv.consumers.hicache import HostPool
from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers, kv_families
from cpkv.consumers.kv_view import KVView
from cpkv.consumers.transfer import plan_transfer, receive_transfer, send_transfer
from cpkv.runtime.p2p import thread_p2p

from support.pool_io import read, write

S = 4


@pytest.fixture
def placed(monkeypatch):
    """Every call of ``placement.place``: ``(calling function, where)``; cleared by the test as it goes."""
    calls, real = [], placement.place

    def spy(index, where):
        f = sys._getframe(1)
        while f.f_code.co_name.startswith("<"):  # a comprehension's frame: its function is the caller
            f = f.f_back
        caller = f.f_code.co_name
        calls.append((caller, where))
        out = real(index, where)
        assert out.device == (where.device if isinstance(where, torch.Tensor) else torch.device(where))
        return out

    monkeypatch.setattr(placement, "place", spy)
    return calls


def _pools(segmented: bool):
    lay = SharedKVLayout(2, S, 6)
    fams = kv_families(2, 1, 3)
    if segmented:  # each rank's segment its own allocation, as on GPUs
        segs = {f.name: [torch.zeros(2, lay.slots_per_rank, 1, 3) for _ in range(2)] for f in fams}
        bufs = {n: KVView.of_segments(s) for n, s in segs.items()}
    else:
        bufs = allocate_buffers(lay, fams)
    return lay, fams, [SharedKVPool(lay, r, fams, bufs) for r in range(2)]


def _seen(calls, fn) -> list:
    """The ``where`` of every call ``fn`` made since the last check of ``fn``'s caller; forgets ``fn``'s."""
    got = [w for f, w in calls if f == fn]
    calls[:] = [(f, w) for f, w in calls if f != fn]
    return got


def _is_buffer(where, pool) -> bool:
    ptrs = {s.data_ptr() for v in pool.views.values() for s in v.segments}
    return isinstance(where, torch.Tensor) and where.data_ptr() in ptrs | {pool._written.data_ptr()} or \
        any(isinstance(where, torch.Tensor) and where.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
            for v in pool.views.values() for s in v.segments)


@pytest.mark.parametrize("segmented", [False, True])
def test_every_pool_path_places_its_index_on_the_buffer_it_indexes(placed, segmented):
    lay, fams, (p0, p1) = _pools(segmented)
    own0 = torch.as_tensor(lay.rank_pages(0))[1:3] * S  # first slots of two pages rank 0 owns
    own1 = torch.as_tensor(lay.rank_pages(1))[0:2] * S
    slots0, slots1 = torch.cat([own0, own0 + 1]), torch.cat([own1, own1 + 1])
    vals = torch.randn(slots0.numel(), 1, 3)
    local, rows = p0.write_index(slots0)
    assert _seen(placed, "write_index") and local.device == rows.device == p0.device
    write(p0, 0, slots0, k=vals, v=vals)  # the forward's store into the segment, after write_index
    p1.write_all_layers(slots1, {f.name: torch.randn(2, slots1.numel(), 1, 3) for f in fams})
    assert any(_is_buffer(w, p1) for w in _seen(placed, "write_all_layers"))
    assert p1.copy_slots(slots0, slots1) == slots1.numel()  # reads rank 0's pages through the view
    assert _seen(placed, "gather_rows" if segmented else "read")  # the read through the view
    assert any(_is_buffer(w, p1) for w in _seen(placed, "copy_slots"))
    got = p0.read_all_layers(torch.cat([slots0, slots1]))
    assert any(_is_buffer(w, p0) for w in _seen(placed, "read_all_layers"))
    assert torch.equal(got["k"][:, slots0.numel():], got["k"][:, : slots0.numel()])  # the copy landed
    p0.read_owned_all_layers(slots0)
    assert any(_is_buffer(w, p0) for w in _seen(placed, "read_owned_all_layers"))
    (k,) = read(p0, 0, slots0, "k")
    assert torch.equal(k, vals) and _seen(placed, "read_all_layers")
    assert p0.written_pages(own0 // S) == 2 and _seen(placed, "written_pages")
    p0.release(slots0)
    assert _seen(placed, "release") and p0.written_pages(own0 // S) == 0


def test_the_host_tier_places_its_indexes_on_its_host_buffers(placed):
    lay, fams, (p0, p1) = _pools(False)
    host = HostPool(fams, HostPool.allocate(fams, 4, S))
    dev = torch.cat([torch.as_tensor(lay.rank_pages(r))[1:2] * S + i for r in (0, 1) for i in range(S)])
    p0.write_all_layers(dev[:S], {f.name: torch.randn(2, S, 1, 3) for f in fams})
    p1.write_all_layers(dev[S:], {f.name: torch.randn(2, S, 1, 3) for f in fams})
    placed.clear()
    hslots = torch.arange(S, 3 * S)
    assert host.backup(p0, dev, hslots) == dev.numel()
    assert any(w is b for w in _seen(placed, "backup") for b in host.buffers.values())
    before = p0.read_all_layers(dev)
    p0.release(dev[:S])
    p0.views["k"].segment(0).zero_()
    assert host.load(p0, hslots, dev) == S
    assert any(w is b for w in _seen(placed, "load") for b in host.buffers.values())
    assert torch.equal(p0.read_all_layers(dev)["k"], before["k"])


def test_a_transfer_places_its_slots_on_the_pools(placed):
    lay, fams, src = _pools(False)
    _, _, dst = _pools(True)
    s = torch.cat([torch.as_tensor(lay.rank_pages(r))[1:2] * S + i for r in (0, 1) for i in range(S)])
    src[0].write_all_layers(s[:S], {f.name: torch.randn(2, S, 1, 3) for f in fams})
    src[1].write_all_layers(s[S:], {f.name: torch.randn(2, S, 1, 3) for f in fams})
    d = s.flip(0)  # every position lands on the other owner
    plan = plan_transfer(lay, lay, s, d)
    links = thread_p2p(4)
    placed.clear()
    for a in range(2):
        send_transfer(plan, src[a], links[a], lambda b: 2 + b)[0].wait()
    assert _seen(placed, "send_transfer")
    for b in range(2):
        receive_transfer(plan, dst[b], links[2 + b], lambda a: a)
    assert _seen(placed, "receive_transfer")
    assert torch.equal(dst[0].read_all_layers(d)["v"], src[0].read_all_layers(s)["v"])


def test_the_check_places_its_ids_on_the_models_device(placed, llama):
    from cpkv.models.round_trip import reference_logits

    out = reference_logits(llama.model, torch.tensor([1, 2, 3]))
    (where,) = _seen(placed, "reference_logits")
    assert where.device == next(llama.model.parameters()).device and out.device.type == "cpu"


def test_place_and_the_host_copies():
    x = torch.arange(4)
    assert placement.place(x, torch.zeros(1)) is x and placement.place(x, "cpu") is x
    assert placement.place(x, torch.device("meta")).device.type == "meta"
    assert placement.to_host(x) is x and placement.to_device(x, "cpu") is x
    assert not placement.pinned_like((2, 3), torch.float32, "cpu").is_pinned()
