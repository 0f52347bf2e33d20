"""The stored KV formats, pinned to their definitions byte for byte.

The reference here is written from the formats' definitions, not from torch's
casts: an e4m3fn code table built from its bit fields (sign, 4 exponent bits of
bias 7, 3 mantissa bits, subnormals at exponent 0, 0x7F/0xFF NaN, no inf),
round to nearest with ties to the even code; float32 scales and bfloat16 rope
values packed with ``struct`` (bf16 = the high half of float32, rounded to
nearest even). [[RFC-0001:C-KV-FORMAT]]"""

import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.consumers.kv_format import (ScaledFp8Format, TorchFormat, gqa_fp8, indexer_key_fp8, mla_latent_fp8)

torch.set_num_threads(1)


# -- the reference, from the definitions ---------------------------------------------------------
def _e4m3_value(code: int) -> float:
    e, m = (code >> 3) & 15, code & 7
    mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if code >> 7 else mag


MAGS = np.array([_e4m3_value(c) for c in range(127)])  # 0x00 .. 0x7E; 0x7F is NaN


def _e4m3_code(y: np.float32) -> int:
    """Nearest e4m3fn code to ``y`` (|y| <= 448), ties to the even code."""
    a = abs(float(y))
    d = np.abs(MAGS - a)
    best = np.flatnonzero(d == d.min())
    code = int(best[0]) if len(best) == 1 else int(next(c for c in best if c % 2 == 0))
    return code | (0x80 if np.signbit(y) else 0)


def _bf16_bits(x: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def reference_encode(fmt: ScaledFp8Format, row) -> bytes:
    """One slot's bytes: fp8 body, float32 scale per tile, bf16 tail."""
    x = np.asarray(row, dtype=np.float32).reshape(-1)
    body, tail = x[: fmt.body], x[fmt.body :]
    codes, scales = [], []
    for t in range(0, fmt.body, fmt.tile):
        tile = body[t : t + fmt.tile]
        s = np.float32(np.abs(tile).max()) / np.float32(448)
        scales.append(s)
        div = s if s > 0 else np.float32(1)
        codes += [_e4m3_code(np.clip(v / div, -448, 448)) for v in tile]
    return (bytes(codes) + b"".join(struct.pack("<f", s) for s in scales)
            + b"".join(struct.pack("<H", _bf16_bits(float(v))) for v in tail))


def reference_decode(fmt: ScaledFp8Format, raw: bytes) -> np.ndarray:
    b, t = fmt.body, fmt.tiles
    scales = struct.unpack(f"<{t}f", raw[b : b + 4 * t])
    body = [np.float32(_e4m3_value(raw[i])) * np.float32(scales[i // fmt.tile]) for i in range(b)]
    tail = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack(f"<{fmt.tail}H", raw[b + 4 * t :])]
    return np.array(body + tail, dtype=np.float32)


def _rows(n_values, seed=0):
    """Rows that exercise the format: random, zeros, -0, 448 exactly, values that
    need the scale (large, tiny), a zero tile next to a nonzero one, halfway ties."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n_values, generator=g) * 3, torch.zeros(n_values), -torch.zeros(n_values)]
    r = torch.randn(n_values, generator=g)
    r[0] = 448.0
    rows.append(r.clamp(-448, 448))  # amax 448: scale 1, values as they are
    rows.append(torch.randn(n_values, generator=g) * 1e4)
    rows.append(torch.randn(n_values, generator=g) * 1e-3)
    z = torch.randn(n_values, generator=g)
    z[: n_values // 2] = 0.0
    z[1] = -0.0
    rows.append(z)
    h = torch.full((n_values,), 448.0)
    h[1:] = torch.tensor([1.0625, 1.1875, -3 * 2.0**-10])[torch.arange(n_values - 1) % 3]  # ties in e4m3
    rows.append(h)
    return torch.stack(rows)


FORMATS = [mla_latent_fp8(20, 4, tile=8), mla_latent_fp8(32, 8), indexer_key_fp8(12, tile=8), gqa_fp8(2, 5),
           mla_latent_fp8(512, 64), indexer_key_fp8(128), gqa_fp8(8, 128)]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_scaled_fp8_matches_the_reference_byte_for_byte(fmt):
    """Encode equals the hand-laid bytes; decode of those bytes equals the
    reference decode; a zero tile decodes to zeros of its sign, no NaN."""
    rows = _rows(fmt.values).view(-1, *fmt.shape)
    raw = fmt.encode(rows)
    assert raw.dtype == torch.uint8 and tuple(raw.shape) == (rows.shape[0], fmt.bytes_per_slot)
    for i in range(rows.shape[0]):
        assert bytes(raw[i].tolist()) == reference_encode(fmt, rows[i]), f"row {i}"
    dec = fmt.decode(raw)
    assert dec.dtype == torch.float32 and dec.shape == rows.shape and not dec.isnan().any()
    for i in range(rows.shape[0]):
        assert np.array_equal(dec[i].reshape(-1).numpy(), reference_decode(fmt, bytes(raw[i].tolist())))
    assert torch.equal(dec[1], rows[1]) and torch.equal(dec[2].reshape(-1).signbit(), torch.ones(fmt.values, dtype=torch.bool))
    assert raw[2, 0] == 0x80 and raw[1, 0] == 0x00  # -0 and +0 in e4m3
    assert float(dec[3].reshape(-1)[0]) == 448.0


def test_bytes_per_slot_at_the_real_shapes_and_layout_rule():
    """656 (DeepSeek MLA latent), 132 (indexer key), 1056 (Llama-3 8B K or V:
    8 heads x 128 + 8 scales), and the same rule at small widths."""
    assert mla_latent_fp8(512, 64).bytes_per_slot == 512 + 4 * 4 + 2 * 64 == 656
    assert indexer_key_fp8(128).bytes_per_slot == 128 + 4 == 132
    assert gqa_fp8(8, 128).bytes_per_slot == 8 * 128 + 8 * 4 == 1056
    assert mla_latent_fp8(20, 4, tile=8).bytes_per_slot == 20 + 3 * 4 + 4 * 2
    assert TorchFormat((8, 128)).bytes_per_slot == 4096 and TorchFormat((576,), torch.bfloat16).bytes_per_slot == 1152
    for fmt in FORMATS:  # the encoded row really is that wide
        assert fmt.encode(torch.ones(1, *fmt.shape)).shape[-1] == fmt.bytes_per_slot


def _bound(fmt, x):
    """Per value: 2^-4 |x| + 2^-10 s in the fp8 body (s its tile's scale), 2^-8 |x| in the bf16 tail."""
    flat = x.reshape(x.shape[0], -1)
    body = flat[:, : fmt.body]
    pad = torch.nn.functional.pad(body.abs(), (0, fmt.tiles * fmt.tile - fmt.body)).view(x.shape[0], fmt.tiles, fmt.tile)
    s = (pad.amax(-1) / 448).repeat_interleave(fmt.tile, 1)[:, : fmt.body]
    return torch.cat([2**-4 * body.abs() + 2**-10 * s, 2**-8 * flat[:, fmt.body :].abs()], 1).view_as(x)


@pytest.mark.parametrize("fmt", [mla_latent_fp8(512, 64), indexer_key_fp8(128), gqa_fp8(8, 128)], ids=repr)
def test_round_trip_error_is_within_the_e4m3_bound_and_the_bound_is_tight(fmt):
    torch.manual_seed(1)
    x = torch.randn(64, *fmt.shape) * torch.logspace(-3, 3, 64)[:, *([None] * len(fmt.shape))]
    err = (fmt.decode(fmt.encode(x)) - x).abs()
    bound = _bound(fmt, x)
    assert (err <= bound * (1 + 2**-20)).all()
    body = err.reshape(64, -1)[:, : fmt.body] / x.reshape(64, -1)[:, : fmt.body].abs().clamp_min(1e-30)
    assert body.max() > 2**-5  # e4m3's 3 mantissa bits show: the bound is not vacuous
    assert (err.reshape(64, -1)[:, : fmt.body].sum() > 0)


def test_plain_formats_are_the_dtype_bytes():
    """float32 is exact; bfloat16 rounds to nearest even; both are the native bytes."""
    x = torch.randn(3, 2, 5)
    f32, bf = TorchFormat((2, 5)), TorchFormat((2, 5), torch.bfloat16)
    assert bytes(f32.encode(x)[0].tolist()) == struct.pack("<10f", *x[0].reshape(-1).tolist())
    assert torch.equal(f32.decode(f32.encode(x)), x)
    want = struct.pack("<10H", *(_bf16_bits(v) for v in x[1].reshape(-1).tolist()))
    assert bytes(bf.encode(x)[1].tolist()) == want
    assert torch.equal(bf.decode(bf.encode(x)), x.to(torch.bfloat16).float())
    assert torch.equal(bf.decode(bf.encode(x.to(torch.bfloat16))), x.to(torch.bfloat16).float())


def test_leading_dimensions_and_empty_batches():
    fmt = mla_latent_fp8(20, 4, tile=8)
    x = torch.randn(2, 3, 24)
    assert torch.equal(fmt.encode(x), fmt.encode(x.reshape(6, 24)).view(2, 3, -1))
    assert fmt.decode(fmt.encode(x)).shape == (2, 3, 24)
    for fmt in FORMATS:  # a rank with no token writes an empty batch; one tile per slot included
        assert fmt.encode(torch.zeros(0, *fmt.shape)).shape == (0, fmt.bytes_per_slot)
        assert fmt.decode(torch.zeros(0, fmt.bytes_per_slot, dtype=torch.uint8)).shape == (0, *fmt.shape)


def test_misuse_is_refused_clearly():
    fmt = mla_latent_fp8(20, 4, tile=8)
    with pytest.raises(ValueError, match="do not end in"):
        fmt.encode(torch.zeros(2, 23))
    with pytest.raises(ValueError, match="do not end in"):
        gqa_fp8(2, 5).encode(torch.zeros(5))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        fmt.encode(torch.zeros(2, 24, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        fmt.encode(torch.zeros(2, 24).to(torch.float8_e4m3fn))
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(2, 24)
        x[1, 3] = bad
        with pytest.raises(ValueError, match="finite"):
            fmt.encode(x)
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 40\]"):
        fmt.decode(torch.zeros(2, 41, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        fmt.decode(torch.zeros(2, 40, dtype=torch.int8))
    with pytest.raises(ValueError):
        ScaledFp8Format((4,), tile=0)
    with pytest.raises(ValueError):
        ScaledFp8Format((4,), tail=4)
    with pytest.raises(ValueError):
        mla_latent_fp8(512, 0)
    with pytest.raises(ValueError):
        TorchFormat((4,), torch.int8)
    with pytest.raises(ValueError):
        TorchFormat((0,))


MAGNITUDE = st.one_of(st.just(0.0), st.floats(2.0**-100, 2.0**100, width=32))


@given(st.lists(st.tuples(MAGNITUDE, st.booleans()), min_size=1, max_size=4 * 36),
       st.sampled_from([mla_latent_fp8(20, 4, tile=8), indexer_key_fp8(12, tile=8), gqa_fp8(3, 4)]))
def test_round_trip_property(values, fmt):
    """For any finite values in float32's normal range: decode(encode(x)) is
    within the per-value bound, keeps every sign (zeros included) and is
    finite; encoding is a pure function of the values."""
    n = fmt.values
    flat = torch.tensor([-m if neg else m for m, neg in values], dtype=torch.float32)
    flat = torch.cat([flat, torch.zeros(-len(values) % n)])
    x = flat.view(-1, *fmt.shape)
    raw = fmt.encode(x)
    y = fmt.decode(raw)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= _bound(fmt, x) * (1 + 2**-20)).all()
    nz = y != 0
    assert torch.equal(y.signbit()[nz], x.signbit()[nz])
    assert torch.equal((x == 0) & x.signbit(), (y == 0) & y.signbit() & (x == 0))
    assert torch.equal(fmt.encode(x.clone()), raw)
