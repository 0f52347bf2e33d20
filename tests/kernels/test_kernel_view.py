"""The kernels read the group's view through its base table (a LayerView: each rank's segment its own
allocation, as on GPUs) exactly as they read one rank-major buffer, on both backends; a view of another
group size is refused. [[RFC-0001:C-READ-PATH]]"""

import pytest
import torch

from cpkv import kernels as K
from cpkv.consumers.kv_view import KVView


def table_view(view: torch.Tensor, layout):
    """``view`` [N * spr, *row] as N separately allocated segments, read through their base table."""
    spr = layout.slots_per_rank
    return KVView.of_segments([view[None, r * spr: (r + 1) * spr].clone() for r in range(layout.cp_size)]).layer(0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("geometry", [(2, 1), (4, 16), (3, 16)])
def test_every_reading_kernel_through_the_base_table_equals_one_buffer(batch_of, geometry, backend):
    N, S = geometry
    b = batch_of(N, S, seed=N * 31 + S)
    T = b.q_req.numel()
    k, v = b.randn(b.rows, 2, 16), b.randn(b.rows, 2, 16)
    q = b.randn(T, 4, 16)
    kt, vt = table_view(k, b.layout), table_view(v, b.layout)
    args = (b.table, b.q_req, b.q_pos, b.layout, 0.25)
    for only in (None, N - 1):
        got = K.paged_attention(q, kt, vt, *args, only_rank=only, backend=backend)
        want = K.paged_attention(q, k, v, *args, only_rank=only, backend=backend)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    w = b.randn(T, 4)
    ki = k[:, 0].contiguous()  # an indexer key [rows, Di]
    assert torch.equal(K.index_scores(q, w, table_view(ki, b.layout), *args, backend=backend),
                       K.index_scores(q, w, ki, *args, backend=backend))
    lat = b.randn(b.rows, 24)
    sel = b.table[b.q_req][:, :8]
    ql = b.randn(T, 4, 24)
    got = K.sparse_mla_attention(ql, table_view(lat, b.layout), sel, b.layout, 0.2, 16, only_rank=0, backend=backend)
    want = K.sparse_mla_attention(ql, lat, sel, b.layout, 0.2, 16, only_rank=0, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_a_view_of_another_group_size_is_refused(batch_of):
    b = batch_of(2, 16, seed=1)
    other = batch_of(3, 16, seed=1)
    k = b.randn(b.rows, 2, 16)
    q = b.randn(b.q_req.numel(), 4, 16)
    kt = table_view(k, b.layout)
    with pytest.raises(ValueError, match="segments \\(cp_size\\) is 2, expected 3"):
        K.paged_attention(q, kt, kt, other.table, other.q_req, other.q_pos, other.layout, 0.25, backend="torch")
