"""Caches in byte formats read and written by the Triton kernels (decoded and
encoded in the kernel), against the torch backend (which decodes on the
gather and encodes with :class:`~cpkv.consumers.kv_format.KVFormat`):
bfloat16 bytes, DeepSeek's FP8 latent (bf16 rope tail), its FP8 indexer key,
FP8 K/V. Stores are byte for byte the format's encoding.
[[RFC-0001:C-KV-FORMAT]] [[RFC-0001:C-DIRECT-WRITE]]"""

import pytest
import torch
from conftest import TOL, make_batch

import cpkv.kernels as K
from cpkv.consumers.kv_format import TorchFormat, gqa_fp8, mla_latent_fp8
from support.kernel_cases import stored

KINDS = ["bf16", "fp8"]


def _close(got, want):
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("kind", KINDS)
def test_paged_attention_reads_formatted_caches(kind):
    """A prefill block after a mid-page prefix, a decode, and queries that see
    nothing, over K/V stored as bytes; and the torch backend over the formatted
    view is attention over the decoded values."""
    b = make_batch(3, 4, seed=40)
    T = b.q_req.numel()
    q = b.randn(T, 4, 16)
    k, fmt = stored(b.randn(b.rows, 2, 16), kind)
    v, _ = stored(b.randn(b.rows, 2, 16), kind)
    args = (q, k, v, b.table, b.q_req, b.q_pos, b.layout, 0.25)
    got = K.paged_attention(*args, fmt=fmt, backend="triton")
    want = K.paged_attention(*args, fmt=fmt, backend="torch")
    _close(got[0], want[0])
    _close(got[1], want[1])
    plain = K.paged_attention(q, fmt.decode(k), fmt.decode(v), *args[3:], backend="torch")
    _close(want[0], plain[0])
    _close(K.paged_attention(*args, fmt=fmt, splits=3, backend="triton")[0], want[0])  # the decode, split


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_mla_reads_a_formatted_latent(kind):
    """The latent in bytes (FP8: 32 e4m3 values, a scale, 8 bf16 rope values),
    decoded in the kernel, as the torch backend reads it; split and owned too."""
    b = make_batch(2, 16, seed=41)
    T = b.q_req.numel()
    lat, fmt = stored(b.randn(b.rows, 40), kind, "mla")
    sel = torch.where(b.table[b.q_req][:, :8] >= 0, b.table[b.q_req][:, :8], -1)
    q = b.randn(T, 4, 40)
    for kw in (dict(splits=2), dict(only_rank=1)):
        got = K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, 32, fmt=fmt, backend="triton", **kw)
        want = K.sparse_mla_attention(q, lat, sel, b.layout, 0.2, 32, fmt=fmt, backend="torch", **kw)
        _close(got[0], want[0])
        _close(got[1], want[1])


@pytest.mark.parametrize("kind", KINDS)
def test_index_scores_read_formatted_keys(kind):
    b = make_batch(4, 16, seed=42)
    T = b.q_req.numel()
    keys, fmt = stored(b.randn(b.rows, 32), kind, "index")
    q, w = b.randn(T, 16, 32), b.randn(T, 16)
    got = K.index_scores(q, w, keys, b.table, b.q_req, b.q_pos, b.layout, 0.3, fmt=fmt, backend="triton")
    want = K.index_scores(q, w, keys, b.table, b.q_req, b.q_pos, b.layout, 0.3, fmt=fmt, backend="torch")
    _close(got, want)


def _hard_values(n: int, width: int, gen) -> torch.Tensor:
    """Rows whose scale tiles hold the cases rounding must get right: a tile
    whose largest value is 448 (scale 1: the values are encoded as they are),
    with ties between e4m3 neighbours (normal and subnormal), values below the
    smallest subnormal, a tile of zeros (scale 0), and random magnitudes."""
    x = torch.randn(n, width, generator=gen) * torch.logspace(-6, 3, width)[torch.randperm(width, generator=gen)]
    ties = torch.tensor([448.0, 1.0625, -1.1875, 2**-7 * 1.0625, 3 * 2**-10, 5 * 2**-10, 2**-11, -(2**-12), 0.0,
                         -0.0, 240.0, 232.0, 2**-9, 7.5 * 2**-9])
    x[0, : ties.numel()] = ties
    if width >= 32:
        x[1, :32] = 0  # a whole tile of zeros when the tile is 32
    return x


@pytest.mark.parametrize("fmt", [TorchFormat((2, 16), torch.bfloat16), gqa_fp8(2, 16), mla_latent_fp8(64, 8),
                                 TorchFormat((40,), torch.float32)], ids=["bf16", "fp8-kv", "fp8-latent", "fp32"])
def test_store_encodes_byte_for_byte(fmt):
    """The Triton store writes exactly the bytes KVFormat.encode writes, at
    the owned slots, nothing elsewhere; refusals reported alike."""
    b = make_batch(2, 4, seed=43, holes=False)
    slots = b.table.reshape(-1)
    vals = _hard_values(slots.numel(), fmt.values, b.gen).view(slots.numel(), *fmt.shape)
    bufs = {be: torch.zeros(b.layout.slots_per_rank, fmt.bytes_per_slot, dtype=torch.uint8) for be in ("torch", "triton")}
    reps = {be: K.store(bufs[be], vals, slots, b.layout, 1, fmt=fmt, check=False, backend=be) for be in bufs}
    assert torch.equal(reps["torch"], reps["triton"]) and int(reps["triton"][0]) > 0
    assert torch.equal(bufs["triton"], bufs["torch"])
    owned = b.layout.owned_slot_mask(slots, owner_rank=1)
    want = torch.zeros_like(bufs["torch"])
    want[b.layout.translate_write_slots(slots[owned])] = fmt.encode(vals[owned])
    assert torch.equal(bufs["triton"], want)


def test_store_of_float16_values_into_fp8():
    """Values in float16 are widened before encoding, as KVFormat.encode widens them."""
    b = make_batch(1, 16, seed=44, holes=False)
    slots = b.table[0, : int(b.lens[0])]
    fmt = gqa_fp8(2, 16)
    vals = b.randn(slots.numel(), 2, 16, dtype=torch.float16)
    buf = torch.zeros(b.layout.slots_per_rank, fmt.bytes_per_slot, dtype=torch.uint8)
    K.store(buf, vals, slots, b.layout, 0, fmt=fmt, backend="triton")
    assert torch.equal(buf[b.layout.translate_write_slots(slots)], fmt.encode(vals))


def test_format_misuse_is_refused_before_anything_runs():
    b = make_batch(2, 4, seed=45)
    q = b.randn(1, 4, 16)
    k, fmt = stored(b.randn(b.rows, 2, 16), "fp8")
    args = (b.table, b.q_req[:1], b.q_pos[:1], b.layout, 1.0)
    with pytest.raises(ValueError, match="must be uint8 rows of 40 bytes"):
        K.paged_attention(q, k[:, :-1], k, *args, fmt=fmt, backend="triton")
    with pytest.raises(ValueError, match="1 value axes, expected 2"):
        K.paged_attention(q, k, k, *args, fmt=mla_latent_fp8(24, 6), backend="triton")  # also 40 bytes
    with pytest.raises(TypeError, match="fmt must be a KVFormat"):
        K.paged_attention(q, k, k, *args, fmt="fp8", backend="torch")
    with pytest.raises(ValueError, match="splits must be a positive int"):
        K.paged_attention(q, fmt.decode(k), fmt.decode(k), *args, splits=0, backend="triton")
    buf = torch.zeros(b.layout.slots_per_rank, 10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="buffer in format"):
        K.store(buf, torch.zeros(1, 2, 16), torch.tensor([4]), b.layout, 0, fmt=fmt)
    assert not buf.any()
