"""The kernels read the group's view through a segment table (each rank's segment its own allocation, as on
GPUs) exactly as they read one rank-major buffer, on both backends, for every reading kernel, dtype and cache
format; a view of another group size is refused. The segments lie in memory out of rank order with gaps
between them, so a read that ignored the table (rank-major arithmetic from segment 0) would read wrong rows.
[[RFC-0001:C-READ-PATH]]"""

import pytest
import torch
from conftest import TOL

from cpkv import kernels as K
from cpkv.consumers.kv_view import OFFSET_ALIGN_BYTES, KVView, SegmentTable
from support.kernel_cases import stored

BACKENDS = ["torch", "triton"]
#: float32 and float16 everywhere; bfloat16 where the triton backend compiles (a GPU)
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="bfloat16: the interpreter has none"))]


def table_view(view: torch.Tensor, layout, seed: int = 0) -> SegmentTable:
    """``view [N * spr, *row]`` as N segments laid in one allocation in a shuffled order, a gap of 64 bytes
    or more between them (every start 64-byte aligned), read through their segment table."""
    N, spr = layout.cp_size, layout.slots_per_rank
    esize, row = view.element_size(), view[0].numel()
    places = -(-(spr * row * esize) // OFFSET_ALIGN_BYTES) + 1  # a segment's aligned bytes and a gap, in 64s
    step = places * OFFSET_ALIGN_BYTES // esize  # elements per place
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()
    if N > 1 and order[0] == 0:
        order = order[1:] + order[:1]  # segment 0 never first: some offsets are negative
    flat = torch.full((N * step,), 7, dtype=view.dtype)  # 7s between segments: a read past one shows
    segs = []
    for r in range(N):
        seg = flat[order[r] * step: order[r] * step + spr * row].view(1, spr, *view.shape[1:])
        seg.copy_(view[None, r * spr: (r + 1) * spr])
        segs.append(seg)
    t = KVView.of_segments(segs).layer(0)
    if N > 1:
        assert bool((t.offsets < 0).any()) and not torch.equal(t.offsets, torch.arange(N) * spr * row)
    return t


def _equal(got, want):
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geometry", [(2, 1), (4, 16), (3, 16)])
def test_every_reading_kernel_through_the_table_equals_one_buffer(batch_of, geometry, backend):
    N, S = geometry
    b = batch_of(N, S, seed=N * 31 + S)
    T = b.q_req.numel()
    k, v = b.randn(b.rows, 2, 16), b.randn(b.rows, 2, 16)
    q = b.randn(T, 4, 16)
    kt, vt = table_view(k, b.layout, 1), table_view(v, b.layout, 2)
    args = (b.table, b.q_req, b.q_pos, b.layout, 0.25)
    for kw in (dict(), dict(only_rank=N - 1), dict(splits=3)):
        _equal(K.paged_attention(q, kt, vt, *args, backend=backend, **kw),
               K.paged_attention(q, k, v, *args, backend=backend, **kw))
    w = b.randn(T, 4)
    ki = k[:, 0].contiguous()  # an indexer key [rows, Di]
    assert torch.equal(K.index_scores(q, w, table_view(ki, b.layout), *args, backend=backend),
                       K.index_scores(q, w, ki, *args, backend=backend))
    lat = b.randn(b.rows, 24)
    sel = b.table[b.q_req][:, :8]
    ql = b.randn(T, 4, 24)
    for kw in (dict(only_rank=0), dict(splits=2)):
        _equal(K.sparse_mla_attention(ql, table_view(lat, b.layout), sel, b.layout, 0.2, 16, backend=backend, **kw),
               K.sparse_mla_attention(ql, lat, sel, b.layout, 0.2, 16, backend=backend, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_through_the_table_equals_one_buffer_and_the_reference(batch_of, dtype):
    """Per backend the table and the buffer give the same bits; triton over the table is the torch
    reference within the kernel tests' tolerance for the dtype."""
    b = batch_of(3, 4, seed=5)
    dev = "cuda" if dtype == torch.bfloat16 else "cpu"
    T = b.q_req.numel()
    k, v, q = (b.randn(b.rows, 2, 16, dtype=dtype), b.randn(b.rows, 2, 16, dtype=dtype),
               b.randn(T, 4, 16, dtype=dtype))
    lat, ql, w = b.randn(b.rows, 24, dtype=dtype), b.randn(T, 4, 24, dtype=dtype), b.randn(T, 4)
    ki = k[:, 0].contiguous()
    sel = b.table[b.q_req][:, :8]
    tol = TOL.get(dtype, dict(atol=3e-2, rtol=3e-2))
    to = (lambda x: x.to(dev)) if dev != "cpu" else (lambda x: x)
    table, q_req, q_pos, sel, w = map(to, (b.table, b.q_req, b.q_pos, sel, w))
    bufs = {n: to(x) for n, x in dict(k=k, v=v, ki=ki, lat=lat).items()}
    tabs = {n: table_view(x, b.layout, i) for i, (n, x) in enumerate(bufs.items())}
    q, ql = to(q), to(ql)
    args = (table, q_req, q_pos, b.layout, 0.25)
    calls = {
        "paged": lambda c, be: K.paged_attention(q, c["k"], c["v"], *args, backend=be),
        "paged lse": lambda c, be: K.paged_attention(q, c["k"], c["v"], *args, only_rank=1, backend=be),
        "index": lambda c, be: (K.index_scores(q, w, c["ki"], *args, backend=be),),
        "mla": lambda c, be: K.sparse_mla_attention(ql, c["lat"], sel, b.layout, 0.2, 16, backend=be),
    }
    for name, call in calls.items():
        ref = call(bufs, "torch")
        _equal(call(tabs, "torch"), ref)
        got = call(tabs, "triton")
        _equal(got, call(bufs, "triton"))
        for x, y in zip(got, ref):
            torch.testing.assert_close(x.float(), y.float(), **tol, msg=name)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "f32bytes"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_byte_formats_through_the_table_equal_one_buffer(batch_of, kind, backend):
    """uint8 rows in a format (bfloat16 bytes, scaled FP8, float32 bytes, which the Triton kernels read as
    float32 rows: the table's offsets in 4-byte elements), decoded in the kernel or on the gather."""
    b = batch_of(3, 4, seed=9)
    T = b.q_req.numel()

    def cache(values, what):
        if kind == "f32bytes":
            from cpkv.consumers.kv_format import TorchFormat

            fmt = TorchFormat(tuple(values.shape[1:]), torch.float32)
            return fmt.encode(values), fmt
        return stored(values, kind, what)

    (k, fmt), (v, _) = cache(b.randn(b.rows, 2, 16), "gqa"), cache(b.randn(b.rows, 2, 16), "gqa")
    q = b.randn(T, 4, 16)
    args = (b.table, b.q_req, b.q_pos, b.layout, 0.25)
    for kw in (dict(), dict(only_rank=2)):
        _equal(K.paged_attention(q, table_view(k, b.layout), table_view(v, b.layout, 3), *args, fmt=fmt,
                                 backend=backend, **kw),
               K.paged_attention(q, k, v, *args, fmt=fmt, backend=backend, **kw))
    ki, fi = cache(b.randn(b.rows, 16), "index")
    w = b.randn(T, 4)
    assert torch.equal(K.index_scores(q, w, table_view(ki, b.layout), *args, fmt=fi, backend=backend),
                       K.index_scores(q, w, ki, *args, fmt=fi, backend=backend))
    lat, fl = cache(b.randn(b.rows, 40), "mla")
    sel = b.table[b.q_req][:, :8]
    ql = b.randn(T, 4, 40)
    _equal(K.sparse_mla_attention(ql, table_view(lat, b.layout), sel, b.layout, 0.2, 32, fmt=fl, backend=backend),
           K.sparse_mla_attention(ql, lat, sel, b.layout, 0.2, 32, fmt=fl, backend=backend))


def test_a_view_of_another_group_size_is_refused(batch_of):
    b = batch_of(2, 16, seed=1)
    other = batch_of(3, 16, seed=1)
    k = b.randn(b.rows, 2, 16)
    q = b.randn(b.q_req.numel(), 4, 16)
    kt = table_view(k, b.layout)
    with pytest.raises(ValueError, match="segments \\(cp_size\\) is 2, expected 3"):
        K.paged_attention(q, kt, kt, other.table, other.q_req, other.q_pos, other.layout, 0.25, backend="torch")
    with pytest.raises(TypeError, match="k_view must be a torch.Tensor or a SegmentTable, got list"):
        K.paged_attention(q, [k], k, b.table, b.q_req, b.q_pos, b.layout, 0.25, backend="torch")
    with pytest.raises(TypeError, match="k_view must be float32, float16 or bfloat16, got torch.int32"):
        K.paged_attention(q, table_view(k.to(torch.int32), b.layout), kt, b.table, b.q_req, b.q_pos, b.layout, 0.25)
