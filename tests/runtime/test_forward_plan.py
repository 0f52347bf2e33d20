"""The forward plan: each batch planned once per rank, then per layer only
store, fence and attend, with no host synchronisation; the triton data plane
equals transformers on every split. Ranks are threads of one process.
[[RFC-0001:C-DIRECT-WRITE]] [[RFC-0001:C-READ-PATH]] [[RFC-0001:C-PLANNER-SPLIT]]"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv import ContractViolation, OwnerLaneAllocator, SharedKVLayout
from cpkv.consumers.kv_pool import SharedKVPool, allocate_buffers
from cpkv.kernels import triton_backend
from cpkv.kernels.backend import pack_left
from cpkv.models import DsaAdapter, LlamaAdapter, TinyDsa, TinyLlama
from cpkv.runtime.batch import ForwardBatch
from cpkv.runtime.comm import LocalComm
from cpkv.runtime.forward_plan import ForwardPlan
from cpkv.runtime.parts import build_parts
from cpkv.runtime.runner import CPRunner
from cpkv.runtime.syncs import SyncCounter
from support.forward_runs import reference, run_small

LLAMA, DSA = TinyLlama(layers=2), TinyDsa(layers=2)
SPLITS = [("page", "owner"), ("interleave", "lse"), ("zigzag", "lse")]


@pytest.fixture(scope="module")
def llama():
    return LlamaAdapter(LLAMA.build())


@pytest.fixture(scope="module")
def dsa():
    return DsaAdapter(DSA.build())


def count_syncs(adapter, monkeypatch):
    """Wrap ``adapter.layer`` so that each call counts the host synchronisations
    in it; returns the list of per-call counts (every rank, every layer)."""
    counts, layer = [], adapter.layer

    def counted(i, h, cache):
        with SyncCounter() as c:
            out = layer(i, h, cache)
        counts.append(c.total)
        return out

    monkeypatch.setattr(adapter, "layer", counted)
    return counts


def host_reads(model: str, decode: str) -> int:
    """Host reads a layer may make: none, but a DSA layer's top-k under the
    log-sum-exp decode split, which reads whether a fallback round (N > 2)
    and a tie round are needed (:func:`cpkv.runtime.lse.global_topk`)."""
    return 2 if (model, decode) == ("dsa", "lse") else 0


@pytest.mark.parametrize("model", ["llama", "dsa"])
@pytest.mark.parametrize("prefill,decode", SPLITS)
def test_no_host_sync_per_layer(request, monkeypatch, model, prefill, decode):
    adapter, cfg = (request.getfixturevalue(model), LLAMA if model == "llama" else DSA)
    counts = count_syncs(adapter, monkeypatch)
    run_small(adapter, cfg.vocab, 2, prefill, decode)
    assert len(counts) == 2 * 2 * adapter.num_layers  # ranks x forwards x layers
    assert max(counts) <= host_reads(model, decode)
    assert sum(c > 0 for c in counts) <= 2 * adapter.num_layers  # the decode forward's layers only


class _Widest(torch.Tensor):
    """A page table that notes the most elements any copy made from it holds
    (a view of it stays a table; a copy comes back a plain tensor)."""

    most = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if not isinstance(out, torch.Tensor):
            return out
        src = next(x for x in args if isinstance(x, torch.Tensor))
        if out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
            return out.as_subclass(cls)  # a view: still the table
        cls.most = max(cls.most, out.numel())
        return out


def test_the_forward_reads_the_rows_it_computes_up_to_their_length(llama):
    """The runner does the forward only: rows and lengths come from the page
    table it is given, and the plan copies ``table[rows, :L]`` of it, never a
    whole row of a table far wider than the batch (a 128K-wide table of 256
    rows would be 256 MiB); the logits are those of the batch's own rows."""
    own = build_parts(llama, SharedKVLayout(1, 4, 16), max_requests=4, max_len=50_000)
    pool, batches = own.pool, own.rows
    ids = torch.randint(0, 256, (9 + 5,), generator=torch.Generator().manual_seed(1))
    a = batches.allocate([3, 1], [9, 5])  # two of the four rows, in another order
    run = own.runner
    idx, want = run.forward([3, 1], a, ids, table=batches.table)
    pool.release(batches.free(3))
    pool.release(batches.free(1))
    a = batches.allocate([3, 1], [9, 5])
    batches.table.req_to_token = batches.table.req_to_token.as_subclass(_Widest)
    _Widest.most = 0
    idx2, got = run.forward([3, 1], a, ids, table=batches.table)
    assert 0 < _Widest.most <= 2 * 9, f"the plan copied {_Widest.most} entries of the page table"
    assert torch.equal(idx, idx2) and torch.equal(got, want)
    with pytest.raises(TypeError, match="page table"):
        run.forward([3, 1], a, ids)


@pytest.mark.parametrize("model", ["llama", "dsa"])
@pytest.mark.parametrize("prefill,decode", SPLITS)
def test_triton_plane_matches_transformers(request, monkeypatch, model, prefill, decode):
    adapter, cfg = (request.getfixturevalue(model), LLAMA if model == "llama" else DSA)
    called, run = set(), triton_backend.run
    monkeypatch.setattr(triton_backend, "run", lambda launch: called.add(launch.name) or run(launch))
    counts = count_syncs(adapter, monkeypatch)  # the kernels' layers: no host sync, no host-to-device copy
    (pre, dec), runners = run_small(adapter, cfg.vocab, 2, prefill, decode, kernels="triton")
    assert all(r.kernels == "triton" for r in runners)
    want = {"store"} | ({"merge"} if decode == "lse" else set())
    want |= {"decode", "extend"} if model == "llama" else {"index", "sparse_mla"}
    assert want <= called  # the kernels ran, not the torch path
    assert len(counts) == 2 * 2 * adapter.num_layers and max(counts) <= host_reads(model, decode)
    ref_pre, ref_dec = reference(adapter, cfg.vocab)
    assert (pre - ref_pre).abs().max() < 1e-4
    assert (dec - ref_dec).abs().max() < 1e-4


@pytest.mark.parametrize("model,split,kv_dtype", [("llama", ("page", "owner"), "fp8"),
                                                  ("dsa", ("zigzag", "lse"), "fp8"),
                                                  ("dsa", ("page", "owner"), "bfloat16")])
def test_triton_plane_reads_and_writes_formatted_caches(request, monkeypatch, model, split, kv_dtype):
    """FP8 and bfloat16-byte caches run on the Triton kernels (decoded and
    encoded in the kernel, no fallback): the same logits as the torch backend
    on the same formatted caches, no host sync per layer (no finiteness read)."""
    adapter, cfg = (request.getfixturevalue(model), LLAMA if model == "llama" else DSA)
    called, run = set(), triton_backend.run
    monkeypatch.setattr(triton_backend, "run", lambda launch: called.add(launch.name) or run(launch))
    counts = count_syncs(adapter, monkeypatch)
    (pre, dec), runners = run_small(adapter, cfg.vocab, 2, *split, kernels="triton", kv_dtype=kv_dtype)
    assert "store" in called and all(r.kernels == "triton" for r in runners)
    assert max(counts) <= host_reads(model, split[1])
    (ref_pre, ref_dec), _ = run_small(adapter, cfg.vocab, 2, *split, kv_dtype=kv_dtype)
    assert (pre - ref_pre).abs().max() < 1e-4 and (dec - ref_dec).abs().max() < 1e-4


def test_a_non_finite_value_in_a_formatted_cache_raises_once_per_batch(llama, monkeypatch):
    """The finiteness of values cached in a byte format is read at the batch's
    end (one read), not in each layer: a NaN raises ValueError there."""
    fams = llama.kv_families("fp8")
    own = build_parts(llama, SharedKVLayout(1, 4, 16), families=fams, max_requests=1, max_len=32)
    pool = own.pool
    alloc = own.rows.allocate([0], [5])
    fb = ForwardBatch(pool, LocalComm(), alloc, own.rows.table.req_to_token, "page", rows=torch.tensor([0]))
    x = torch.randn(5, *fams[0].shape)
    x[2, 0, 1] = float("nan")
    with SyncCounter() as c:
        fb.store(0, k=x, v=torch.randn(5, *fams[1].shape))
    assert c.total == 0
    with pytest.raises(ValueError, match="NaN or infinite value in a formatted family"):
        fb.finish()


def test_one_object_holds_the_forward_plan(llama):
    """The batch's plan is built once and held by the plan alone: no attribute
    of the forward batch is one of the plan's tensors or its backend, and what
    the model asks of the cache (positions, token count) reads the plan."""
    own = build_parts(llama, SharedKVLayout(1, 4, 16), max_requests=1, max_len=32)
    alloc = own.rows.allocate([0], [5])
    fb = ForwardBatch(own.pool, LocalComm(), alloc, own.rows.table.req_to_token, "page", rows=torch.tensor([0]))
    p = fb.plan
    fields = [*vars(p).values(), p.write.slots, p.write.local, p.write.rows]
    held = {id(v) for v in fields if isinstance(v, torch.Tensor) or hasattr(v, "__dict__")}  # no ints, no None
    assert not [k for k, v in vars(fb).items() if k != "plan" and id(v) in held]
    assert fb.positions is p.positions and fb.num_tokens == p.num_tokens == 5 and fb.kernels == p.backend.name


def test_the_torch_mask_is_planned_for_the_torch_backend_only():
    """A prefill planned for the Triton backend builds no causal mask or query
    grouping (the torch path's, 16 GiB at a 128K-token prefill); the torch
    backend's plan has them."""
    from cpkv.kernels import get

    pool, a, table = _pool_and_alloc()
    torch_plan = ForwardPlan.build(pool, 0, a, table, "page").attn
    triton_plan = ForwardPlan.build(pool, 0, a, table, "page", backend=get("triton")).attn
    assert torch_plan.groups is not None and torch_plan.groups.mask.dtype == torch.bool
    assert not hasattr(triton_plan, "groups")
    assert not any(isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.dim() == 3
                   for v in vars(triton_plan).values())


def test_a_format_the_kernels_cannot_read_runs_the_torch_backend_named():
    """Triton asked for, a family whose FP8 scales would not be 4-byte aligned:
    the batch runs on the torch backend, and ForwardBatch.fallback says why
    (the run's report carries it as kernels_fallback)."""
    from cpkv.consumers.kv_format import gqa_fp8
    from cpkv.consumers.kv_pool import kv_families
    from cpkv.runtime.batch import choose_backend

    layout = SharedKVLayout(2, 4, 16)
    fams = kv_families(1, 1, 6, format=gqa_fp8(1, 6))  # a body of 6 bytes
    pool = SharedKVPool(layout, 0, fams, allocate_buffers(layout, fams))
    backend, why = choose_backend("triton", pool)
    assert backend.name == "torch" and why.startswith("family k:") and "multiples of 4" in why
    ok = SharedKVPool(layout, 0, kv_families(1, 1, 8, format=gqa_fp8(1, 8)),
                      allocate_buffers(layout, kv_families(1, 1, 8, format=gqa_fp8(1, 8))))
    assert choose_backend("triton", ok)[0].name == "triton" and choose_backend("triton", ok)[1] is None
    a = OwnerLaneAllocator((layout.num_pages - 1) * 4, 4, 2, layout=layout).allocate_extend(
        torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))
    table = torch.full((1, 8), -1, dtype=torch.int64)
    table[0, :3] = a.out_cache_loc
    fb = ForwardBatch(pool, LocalComm(), a, table, "lse", kernels="triton")
    assert fb.kernels == "torch" and fb.fallback == why
    with pytest.raises(ValueError, match="unknown kernel backend"):
        choose_backend("cuda", pool)


def _pool_and_alloc(N=2, rank=0):
    layout = SharedKVLayout(N, 4, 16)
    fams = LlamaAdapter.families(type("A", (), {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4})())
    pool = SharedKVPool(layout, rank, fams, allocate_buffers(layout, fams))
    alloc = OwnerLaneAllocator.for_layout(layout)
    a = alloc.allocate_extend(torch.tensor([0]), torch.tensor([11]), torch.tensor([-1]))
    table = torch.full((1, 16), -1, dtype=torch.int64)
    table[0, :11] = a.out_cache_loc
    return pool, a, table


def test_non_owned_write_refused_once_before_any_layer():
    """A plan in which this rank would write a slot another rank owns raises
    ContractViolation when the batch is planned, and marks nothing written."""
    pool, a, table = _pool_and_alloc()
    with pytest.raises(ContractViolation, match="rank 1 owns"):
        ForwardPlan.build(pool, 1, a, table, "page")  # rank 1's tokens, through rank 0's pool
    assert pool.bytes_held() == 0
    plan = ForwardPlan.build(pool, 0, a, table, "page")
    assert plan.write.slots.numel() == plan.num_tokens > 0 and pool.bytes_held() > 0


def test_plan_lists_each_split_writes():
    """page and lse: every computed slot is written (lse computes a token on its
    home rank, the owner of its slot); interleave: the gathered entries this
    rank owns, -1 elsewhere."""
    pool, a, table = _pool_and_alloc()
    owned = pool.layout.owned_slot_mask(a.out_cache_loc, owner_rank=0)
    p = ForwardPlan.build(pool, 0, a, table, "interleave")
    assert torch.equal(p.write.slots, torch.where(owned, a.out_cache_loc, -1))
    assert torch.equal(p.write.rows, torch.nonzero(owned).flatten())
    assert torch.equal(p.write.local, pool.layout.translate_write_slots(a.out_cache_loc[owned]))
    for mode in ("page", "lse"):
        p = ForwardPlan.build(pool, 0, a, table, mode)
        assert torch.equal(p.write.slots, a.out_cache_loc[owned]) and torch.equal(p.token_indices,
                                                                                 torch.nonzero(owned).flatten())


def test_misuse_refused():
    pool, a, table = _pool_and_alloc()
    with pytest.raises(ValueError, match="unknown kernel backend"):
        ForwardBatch(pool, LocalComm(), a, table, "page", kernels="cuda")
    with pytest.raises(ValueError, match="unknown split"):
        ForwardPlan.build(pool, 0, a, table, "ring")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        CPRunner(None, SharedKVPool(SharedKVLayout(1, 4, 4), 0, pool.families.values(),
                                    allocate_buffers(SharedKVLayout(1, 4, 4), pool.families.values())),
                 kernels="cuda")


def test_sync_counter_counts_host_reads_only():
    x = torch.arange(6)
    with SyncCounter() as c:
        y = (x * 2 + 1).reshape(2, 3).sum(0)  # device work: nothing counted
        torch.full((2,), 3), torch.zeros(2, dtype=torch.int32), torch.as_tensor(x), x.to("cpu")  # nor these
        assert c.total == 0
        int(y[0]), y.tolist(), bool(y.any()), x[x > 2], torch.nonzero(x), y.cpu()
        torch.tensor([0, 6]), torch.as_tensor([1.0])  # made from host data: a host-to-device copy on a GPU
        x.to("meta"), torch.empty(6, dtype=x.dtype, device="meta").copy_(x)  # host to a device (meta stands in)
    assert c.by_name == {"int": 1, "tolist": 1, "bool": 1, "bool-index": 1, "nonzero": 1, "cpu": 1, "h2d": 4}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=1, max_size=4), st.integers(0, 3))
def test_pack_left_keeps_order_without_reading_counts(rows, extra):
    keep = torch.tensor(rows)
    values = torch.arange(keep.numel()).view(keep.shape) * 7
    most = int(keep.sum(1).max())
    want = [[int(v) for v, k in zip(vr, kr) if k] for vr, kr in zip(values, keep)]
    for width in (None, most + extra):
        got = pack_left(keep, values, width)
        assert got.shape == (keep.shape[0], most if width is None else width)
        for r, w in enumerate(want):
            assert got[r, : len(w)].tolist() == w and (got[r, len(w):] == -1).all()
