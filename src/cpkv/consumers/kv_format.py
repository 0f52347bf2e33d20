"""How one slot of a cache family is laid out in bytes: plain torch dtypes and
scaled FP8 ([[RFC-0001:C-KV-FORMAT]]).

A :class:`KVFormat` turns ``values [..., *shape]`` (any float dtype) into
``uint8 [..., bytes_per_slot]`` rows (:meth:`~KVFormat.encode`) and back into
``float32 [..., *shape]`` (:meth:`~KVFormat.decode`), vectorised over every
leading dimension. A pool family with a format stores these rows and nothing
else; copies between pools move the rows as they are.

Two kinds:

* :class:`TorchFormat` - the values in one torch dtype (``float32``,
  ``bfloat16``): ``bytes_per_slot = values * itemsize``.
* :class:`ScaledFp8Format` - ``[fp8 body | fp32 scales | bf16 tail]``: the
  first ``prod(shape) - tail`` values (flattened row-major) as
  ``float8_e4m3fn``, one little-endian float32 scale per ``tile`` of them
  (``scale = amax / 448``, the largest finite e4m3 value; a tile of zeros keeps
  scale 0 and decodes to zeros), then the last ``tail`` values in ``bfloat16``.
  Three instances:

  - :func:`mla_latent_fp8` - DeepSeek's FP8 MLA cache (FlashMLA's sparse FP8
    layout, DeepSeek-V3.2 / GLM-5): ``kv_lora_rank`` latent values in FP8 with
    a scale per 128, the ``rope_dim`` rope values in bf16. 656 bytes at 512 + 64.
  - :func:`indexer_key_fp8` - the lightning indexer's key: ``index_head_dim``
    values in FP8, a scale per 128. 132 bytes at 128.
  - :func:`gqa_fp8` - a GQA K or V ``[kv_heads, head_dim]``: FP8 with one
    scale per token and head (``tile = head_dim``), 1056 bytes at 8 x 128.
    vLLM's FP8 cache keeps one scale per tensor, calibrated offline or taken
    from the checkpoint; a cache written on the fly has no calibration, and a
    per-tensor scale set from the first batch would clip (NaN in e4m3fn) a
    later, larger value. A scale per token and head is computed from the
    values it scales, so it never clips, needs no state, and costs 4 bytes per
    ``head_dim`` values (3% at 128), the same rule as DeepSeek's per-128 tiles.

Error of a scaled-FP8 value ``x`` in a tile of scale ``s``:
``|decode(encode(x)) - x| <= 2^-4 |x| + 2^-10 s`` (e4m3 keeps 3 mantissa bits:
half an ulp is ``2^-4`` relative for normal numbers, ``2^-10`` absolute in
scaled units for subnormals), for ``|x|`` in float32's normal range (a tile
whose ``amax / 448`` underflows float32, ``amax < ~1e-36``, adds float32's
subnormal step); the bf16 tail's error is ``<= 2^-8 |x|`` up to bf16's largest
finite value, where it saturates.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_TILE = 128  # values per fp32 scale in DeepSeek's FP8 cache formats
BF16_MAX = torch.finfo(torch.bfloat16).max  # a bf16 tail saturates here rather than turn inf
PLAIN_DTYPES = (torch.float32, torch.bfloat16)
FP8_ROUNDING = 2.0**-4  # half an ulp of e4m3 (3 mantissa bits), relative, for normal numbers
FP8_SUBNORMAL = 2.0**-10  # half the e4m3 subnormal step (2^-9), in units of the tile's scale
BF16_ROUNDING = 2.0**-8  # half an ulp of bfloat16 (7 mantissa bits), relative


class KVFormat(ABC):
    """The byte layout of one slot of a cache family.

    ``shape``: the values of one slot; ``bytes_per_slot``: the bytes one slot
    is stored in. :meth:`encode` and :meth:`decode` keep
    ``decode(encode(x))`` within the format's error of ``x``, on ``x``'s device.
    """

    shape: tuple[int, ...]

    @property
    @abstractmethod
    def bytes_per_slot(self) -> int:
        """Bytes of one slot."""

    @abstractmethod
    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        """``float32 [N, values]`` -> ``uint8 [N, bytes_per_slot]``."""

    @abstractmethod
    def _decode(self, raw: torch.Tensor) -> torch.Tensor:
        """``uint8 [N, bytes_per_slot]`` -> ``float32 [N, values]``."""

    @property
    def values(self) -> int:
        """Values of one slot, ``prod(shape)``."""
        return math.prod(self.shape)

    def encode(self, x: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """``x [..., *shape]`` of a floating dtype, finite -> ``uint8 [...,
        bytes_per_slot]`` (contiguous, on ``x``'s device). Raises ``ValueError``
        for another trailing shape, a non-float dtype or (``check``, the
        default) a non-finite value. ``check=False`` skips only the finiteness
        test, which reads a device value on the host (a synchronisation): a
        per-layer path checks finiteness on the device and reads it once per
        batch instead (:func:`all_finite`); a non-finite value then encodes
        to garbage bytes, never an error."""
        if x.dim() < len(self.shape) or tuple(x.shape[x.dim() - len(self.shape):]) != self.shape:
            raise ValueError(f"{self}: values of shape {tuple(x.shape)} do not end in {self.shape}")
        if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{self}: values must be float32/bfloat16/float16, got {x.dtype}")
        if check and not bool(all_finite(x)):
            raise ValueError(f"{self}: values must be finite (a NaN or inf would poison its tile's scale)")
        lead = x.shape[: x.dim() - len(self.shape)]
        return self._encode(x.reshape(-1, self.values).float()).view(*lead, self.bytes_per_slot)

    def rounding(self, x: torch.Tensor) -> torch.Tensor:
        """The format's rounding bound of each value of ``x [..., *shape]``:
        ``|decode(encode(x)) - x| <= rounding(x)`` elementwise (float32, the
        shape of ``x``), within the ranges the module doc states. Two values
        that differ by less than float32's own rounding may round to
        neighbouring stored values: their stored forms then differ by at most
        ``2 * rounding(x)`` (one step of the format)."""
        if x.dim() < len(self.shape) or tuple(x.shape[x.dim() - len(self.shape):]) != self.shape:
            raise ValueError(f"{self}: values of shape {tuple(x.shape)} do not end in {self.shape}")
        lead = x.shape[: x.dim() - len(self.shape)]
        return self._rounding(x.reshape(-1, self.values).float()).view(*lead, *self.shape)

    @abstractmethod
    def _rounding(self, flat: torch.Tensor) -> torch.Tensor:
        """``float32 [N, values]`` -> the bound of each, ``float32 [N, values]``."""

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw uint8 [..., bytes_per_slot]`` -> ``float32 [..., *shape]`` (a new
        tensor). Raises ``ValueError`` for another dtype or width."""
        if raw.dtype != torch.uint8 or raw.dim() < 1 or raw.shape[-1] != self.bytes_per_slot:
            raise ValueError(f"{self}: stored rows must be uint8 [..., {self.bytes_per_slot}], "
                             f"got {raw.dtype} {tuple(raw.shape)}")
        lead = raw.shape[:-1]
        return self._decode(raw.reshape(-1, self.bytes_per_slot)).view(*lead, *self.shape)


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``x`` is finite, as a bool tensor on ``x``'s
    device (no host read: AND it into a flag and read that once)."""
    return torch.isfinite(x).all()


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x [N, k]`` -> its native (little-endian) bytes ``uint8 [N, k * itemsize]``
    (through a flat view: an empty or single-column tensor may carry strides
    that a direct byte view refuses)."""
    return x.contiguous().view(-1).view(torch.uint8).view(x.shape[0], x.shape[1] * x.element_size())


def _from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``uint8 [N, k * itemsize]`` (any offset) -> ``dtype [N, k]`` (copied, so aligned)."""
    if raw.numel() == 0:  # an empty slice keeps its offset through contiguous(), which the view refuses
        return torch.empty(raw.shape[0], raw.shape[1] // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                           device=raw.device)
    return raw.contiguous().view(dtype)


@dataclass(frozen=True)
class TorchFormat(KVFormat):
    """``shape`` values in ``dtype``: ``bytes_per_slot = prod(shape) * itemsize``;
    decode is exact, encode rounds to ``dtype`` (round to nearest even)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        _check_shape(self.shape)
        if self.dtype not in PLAIN_DTYPES:
            raise ValueError(f"a plain format is one of {PLAIN_DTYPES}, not {self.dtype}")

    @property
    def bytes_per_slot(self) -> int:
        """``prod(shape) * itemsize``."""
        return self.values * torch.empty((), dtype=self.dtype).element_size()

    def _encode(self, flat):
        return _as_bytes(flat.to(self.dtype))

    def _decode(self, raw):
        return _from_bytes(raw, self.dtype).float()

    def _rounding(self, flat):
        """0 for float32 (stored as given); half a bf16 ulp, ``2^-8 |x|``, for bfloat16."""
        return flat.abs() * (BF16_ROUNDING if self.dtype == torch.bfloat16 else 0.0)


@dataclass(frozen=True)
class ScaledFp8Format(KVFormat):
    """``[fp8 body | fp32 scale per tile | bf16 tail]`` over the flattened slot.

    The body is the first ``prod(shape) - tail`` values, cut into tiles of
    ``tile`` (the last one may be shorter); each tile stores
    ``clamp(x / s, -448, 448)`` as ``float8_e4m3fn`` with ``s = amax(|x|) / 448``
    (divided by 1 when ``s`` is 0, so zeros stay zeros of their sign), and
    ``s`` as float32. Decode is ``fp8 * s`` then the tail widened from bf16.
    """

    shape: tuple[int, ...]
    tile: int = FP8_TILE
    tail: int = 0

    def __post_init__(self):
        _check_shape(self.shape)
        if self.tile < 1 or not 0 <= self.tail < self.values:
            raise ValueError(f"tile {self.tile} must be >= 1 and tail {self.tail} in 0 .. {self.values - 1}")

    @property
    def body(self) -> int:
        """Values stored as FP8."""
        return self.values - self.tail

    @property
    def tiles(self) -> int:
        """Scales per slot, ``ceil(body / tile)``."""
        return -(-self.body // self.tile)

    @property
    def bytes_per_slot(self) -> int:
        """``body + 4 * tiles + 2 * tail``."""
        return self.body + 4 * self.tiles + 2 * self.tail

    def _encode(self, flat):
        n, pad = flat.shape[0], self.tiles * self.tile - self.body
        body = F.pad(flat[:, : self.body], (0, pad)).view(n, self.tiles, self.tile)
        scale = body.abs().amax(-1) / FP8_MAX  # [N, tiles]
        q = (body / torch.where(scale > 0, scale, 1.0)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        parts = [q.view(torch.uint8).reshape(n, self.tiles * self.tile)[:, : self.body], _as_bytes(scale)]
        if self.tail:
            parts.append(_as_bytes(flat[:, self.body :].clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)))
        return torch.cat(parts, 1)

    def _decode(self, raw):
        b, t = self.body, self.tiles
        q = raw[:, :b].contiguous().view(FP8_DTYPE).float()
        scale = _from_bytes(raw[:, b : b + 4 * t], torch.float32)
        body = q * scale.repeat_interleave(self.tile, 1)[:, :b]
        if not self.tail:
            return body
        return torch.cat([body, _from_bytes(raw[:, b + 4 * t :], torch.bfloat16).float()], 1)


    def _rounding(self, flat):
        """``2^-4 |x| + 2^-10 s`` over the body (tile scale ``s``, as
        :meth:`_encode` computes it; float32's own rounding of the division
        and the product adds ``2^-22 |x|``), ``2^-8 |x|`` over the bf16 tail."""
        n, pad = flat.shape[0], self.tiles * self.tile - self.body
        body = F.pad(flat[:, : self.body], (0, pad)).view(n, self.tiles, self.tile)
        scale = body.abs().amax(-1, keepdim=True) / FP8_MAX
        bound = (body.abs() * (FP8_ROUNDING + 2.0**-22) + scale * FP8_SUBNORMAL).view(n, -1)[:, : self.body]
        return torch.cat([bound, flat[:, self.body :].abs() * BF16_ROUNDING], 1)


def _check_shape(shape):
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"a format's shape {shape} must be positive ints")


def mla_latent_fp8(kv_lora_rank: int, rope_dim: int, tile: int = FP8_TILE) -> ScaledFp8Format:
    """DeepSeek's FP8 MLA latent: ``[kv_lora_rank + rope_dim]`` values, the
    latent in FP8 with a float32 scale per ``tile``, the rope key in bf16 (656
    bytes at 512 + 64, FlashMLA's sparse FP8 cache). [[RFC-0001:C-KV-FORMAT]]"""
    if rope_dim < 1:
        raise ValueError(f"rope_dim must be >= 1, got {rope_dim}")
    return ScaledFp8Format((kv_lora_rank + rope_dim,), tile, rope_dim)


def indexer_key_fp8(index_head_dim: int, tile: int = FP8_TILE) -> ScaledFp8Format:
    """DeepSeek's FP8 indexer key: ``[index_head_dim]`` in FP8 with a float32
    scale per ``tile`` (132 bytes at 128). [[RFC-0001:C-KV-FORMAT]]"""
    return ScaledFp8Format((index_head_dim,), tile)


def gqa_fp8(kv_heads: int, head_dim: int) -> ScaledFp8Format:
    """A GQA K or V ``[kv_heads, head_dim]`` in FP8 with a float32 scale per
    token and head (1056 bytes at 8 x 128; the module docstring says why not
    per tensor). [[RFC-0001:C-KV-FORMAT]]"""
    return ScaledFp8Format((kv_heads, head_dim), head_dim)
