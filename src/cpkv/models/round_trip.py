"""``transformers``' forward as the reference for a cache stored in a format
(bf16 bytes, FP8): the same quantize/dequantize round trip applied where its
model produces the cached values ([[RFC-0001:C-KV-FORMAT]]).

:class:`RoundTripCache` is a ``DynamicCache`` whose writes pass every new
entry through ``format.decode(format.encode(.))`` before it is stored and
attended to, exactly where ``transformers`` caches it:

* Llama: ``update(key_states, value_states, layer)``, ``[B, Hkv, S, D]``
  after the rotary, through the ``k`` and ``v`` formats (per token and head);
* DeepSeek-V3.2 / GLM-5: the normed latent ``[B, 1, S, r]`` and the rotated
  rope key ``[B, 1, S, dr]`` through the ``latent`` format over their
  concatenation, the layout cpkv's latent family stores: where
  ``transformers`` >= 5.24 caches them (``update(k_pass, k_rot, layer)``),
  or, where an older one caches the K/V its ``expand_kv`` makes of them
  (5.17), as they enter ``expand_kv`` (:func:`cache_forward` wraps it);
  ``update_indexer(k, layer)`` (``[B, S, Di]``) through the ``index_k``
  format.

The model is handed the cache by the keyword its ``forward`` takes: ``cache``
(``transformers`` >= 5.24) or ``past_key_values`` (before); a model that
takes neither is refused (:func:`cache_forward`). The versions this is tested
with are :data:`TRANSFORMERS_TESTED`; :attr:`Agreement.values` counts the
stored values compared, so a reference that ignored its cache shows 0 there
and ``--check`` fails on it (:func:`~cpkv.engine.exactness.failures`).

A forward of a whole sequence with this cache (``use_cache=True``) is the
quantized model cpkv's engine computes: every query attends to stored (rounded)
keys and values, its own included, as a pool write before the read makes it.

Given a :class:`RunRecord` (what a run stored at each position), the cache
stores the run's value instead of its own rounding, once :func:`admit` finds
it one of the roundings the format allows of the reference's value
([[RFC-0001:C-EXACTNESS]]). Why: the engine computes a sequence in
chunks and the reference whole, so their values differ by float32's noise,
and a value within that noise of a rounding boundary of the format (bf16, FP8)
is stored one step apart on the two sides, on some machines' kernels and not
others'. Checking every stored value on its own and then reading the same
values on both sides makes the logits comparable at float32's tolerance in
every format, on every machine, while a stored value that is no rounding of
the reference's (a wrong scale, a wrong row) still fails.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

import torch
from transformers import DynamicCache

from ..consumers import placement
from ..consumers.kv_format import KVFormat
from .selection import NOISE, indexer_layers, pinned_indexers

#: The ``transformers`` releases the reference is tested with, ``[low, high)``: 5.17 (the GPU image's,
#: ``past_key_values=`` and expanded DSA K/V) and 5.25 (``make test``'s: ``cache=`` and cached latents).
TRANSFORMERS_TESTED = ((5, 17), (6, 0))


def transformers_refusal(version: str) -> str | None:
    """Why ``transformers`` ``version`` cannot serve as ``--check``'s reference
    (outside :data:`TRANSFORMERS_TESTED`: its cache may not reach the model),
    one line; ``None`` inside the range."""
    try:
        got = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return f"transformers {version}: not a release version; cpkv's reference is tested with >=5.17,<6"
    (lo, hi) = TRANSFORMERS_TESTED
    if lo <= got < hi:
        return None
    return (f"transformers {version} is outside >={lo[0]}.{lo[1]},<{hi[0]}, the range cpkv's --check reference "
            "is tested with (the keyword and the place its model caches K/V change between releases)")


def round_trip(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """``fmt.decode(fmt.encode(x))`` in ``x``'s dtype and shape (``x [...,
    *fmt.shape]``)."""
    return fmt.decode(fmt.encode(x)).to(x.dtype)


def admit(own: torch.Tensor, x: torch.Tensor, stored: torch.Tensor) -> dict:
    """Whether each value a run ``stored [N, *slot]`` is a rounding the format
    allows of the reference's value ``x [N, *slot]``, whose own rounding is
    ``own`` (``x`` itself without a format). With ``d = NOISE * max |x|`` over
    the slot (float32's noise between the two sides), a stored value is

    * the same rounding: ``|stored - own| <= d``;
    * a flip: the neighbouring rounding, with ``x`` within ``2 d`` of the
      midpoint between the two (``|x - (own + stored) / 2| <= 2 d``: the
      run's value, ``d`` from ``x``, fell on the other side of the format's
      rounding boundary; a scale recomputed from the run's values moves that
      boundary by less than ``d``);
    * outside: anything else.

    Returns ``{"values", "flips", "outside", "worst"}``, ``worst`` the largest
    ``|stored - own| / max |x|`` over the values outside (0 when none is)."""
    if x.shape[0] == 0:
        return {"values": 0, "flips": 0, "outside": 0, "worst": 0.0}
    scale = x.flatten(1).abs().amax(1).view(-1, *[1] * (x.dim() - 1))
    d = NOISE * scale
    dev = (stored - own).abs()
    same = dev <= d
    flip = ~same & ((x - (own + stored) / 2).abs() <= 2 * d)
    rel = torch.where(same | flip, 0.0, dev / scale.clamp(min=torch.finfo(torch.float32).tiny))
    return {"values": x.numel(), "flips": int(flip.sum()), "outside": int((~same & ~flip).sum()),
            "worst": float(rel.max())}


@dataclass
class RunRecord:
    """What a run stored and selected at the positions of one sequence of
    ``S`` tokens: ``stored[name] [len(layers[name]), S, *shape]`` the values
    of each cache family as the run's pool held them (decoded, float32),
    ``layers[name]`` the model layers of that family; ``selected [S, indexer
    layers, k]`` (DSA, or ``None``) its top-k per indexer layer (positions,
    ``-1`` none) on the rows ``pinned [S]`` (bool)."""

    stored: dict[str, torch.Tensor]
    layers: dict[str, tuple[int, ...]]
    selected: torch.Tensor | None = None
    pinned: torch.Tensor | None = None


@dataclass
class Agreement:
    """How a run's record agrees with the reference: stored ``values``
    compared, ``flips`` (the neighbouring rounding at a boundary) and
    ``outside`` (no rounding of the reference's value), ``worst_value`` (how
    far outside, :func:`admit`'s ``worst``); selection ``rows`` compared, ``equal``, ``near_ties``,
    ``mismatches`` and ``worst_gap`` (see
    :func:`~cpkv.models.selection.compare_selection`)."""

    values: int = 0
    flips: int = 0
    outside: int = 0
    worst_value: float = 0.0
    rows: int = 0
    equal: int = 0
    near_ties: int = 0
    mismatches: int = 0
    worst_gap: float = 0.0

    def add_values(self, a: dict) -> None:
        """Accumulate one :func:`admit` result."""
        self.values += a["values"]
        self.flips += a["flips"]
        self.outside += a["outside"]
        self.worst_value = max(self.worst_value, a["worst"])

    def add_rows(self, a: dict) -> None:
        """Accumulate one :func:`~cpkv.models.selection.compare_selection` result."""
        for k in ("rows", "equal", "near_ties", "mismatches"):
            setattr(self, k, getattr(self, k) + a[k])
        self.worst_gap = max(self.worst_gap, a["worst"])

    def merge(self, other: "Agreement") -> None:
        """Accumulate ``other``."""
        for k, v in self.as_dict().items():
            setattr(self, k, max(v, getattr(other, k)) if k.startswith("worst") else v + getattr(other, k))

    def as_dict(self) -> dict:
        """The figures as a plain dict."""
        return {k: getattr(self, k) for k in ("values", "flips", "outside", "worst_value", "rows", "equal",
                                              "near_ties", "mismatches", "worst_gap")}


class RoundTripCache(DynamicCache):
    """A ``DynamicCache`` that stores ``decode(encode(x))`` of every new
    entry, by the formats of cpkv's cache families (``formats`` by family
    name: ``k``/``v`` for GQA, ``latent``/``index_k`` for DSA; a family
    without a format is stored as given), for a model of ``config``. With a
    ``run`` (:class:`RunRecord` of the sequence the forward computes, whole),
    the run's stored value is stored instead, and :func:`admit` of it is added
    to :attr:`agreement`. Raises ``ValueError``
    for formats of neither model kind. [[RFC-0001:C-KV-FORMAT]]
    [[RFC-0001:C-EXACTNESS]]"""

    def __init__(self, config, formats: Mapping[str, KVFormat], run: RunRecord | None = None):
        names = set(formats) | (set(run.stored) if run is not None else set())
        if not names <= {"k", "v"} and not names <= {"latent", "index_k"}:
            raise ValueError(f"formats {sorted(names)} are neither GQA's (k, v) nor DSA's (latent, index_k)")
        super().__init__(config=config)
        self.formats, self.run, self.dsa = dict(formats), run, bool(names & {"latent", "index_k"})
        self.agreement = Agreement()
        self._latent_done: dict[int, Agreement | None] = {}  # layer -> its latent's agreement until cached

    def latent(self, layer: int, k_pass: torch.Tensor, k_rot: torch.Tensor,
               cached: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent ``k_pass [B, 1, S, r]`` and rope key ``k_rot [B, 1, S, dr]``
        of ``layer`` as the cache stores them (:meth:`_entry` of the ``latent``
        family over their concatenation), once per layer and forward.
        ``cached`` false (before ``expand_kv``, 5.17): its agreement counts
        only once the expanded K/V reach :meth:`update`, so a model that never
        hands them to this cache compares nothing."""
        r = k_pass.shape[-1]
        pending = None if cached else Agreement()
        lat = torch.cat([k_pass, k_rot], -1)
        lat = torch.stack([self._entry("latent", layer, b[0], pending) for b in lat])[:, None]
        self._latent_done[layer] = pending
        return lat[..., :r], lat[..., r:]

    def _entry(self, name: str, layer: int, x: torch.Tensor, into: Agreement | None = None) -> torch.Tensor:
        """What the cache stores of family ``name`` for ``x [S, *shape]`` at
        ``layer``; its :func:`admit` added to ``into`` (default :attr:`agreement`)."""
        f = self.formats.get(name)
        own = x if f is None else round_trip(f, x)
        run = self.run
        if run is None or name not in run.stored:
            return own
        ran = run.stored[name][run.layers[name].index(layer)].to(x.device)
        if ran.shape != x.shape:
            raise ValueError(f"{name} at layer {layer}: the run stored {tuple(ran.shape)}, the reference "
                             f"computes {tuple(x.shape)}")
        (self.agreement if into is None else into).add_values(admit(own.float(), x.float(), ran))
        return ran.to(x.dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """The new entries as :meth:`_entry` stores them (see the module doc),
        then stored as ``DynamicCache`` does."""
        if self.dsa:
            if key_states.shape[1] == 1 and layer_idx not in self._latent_done:  # k_pass, k_rot (>= 5.24)
                key_states, value_states = self.latent(layer_idx, key_states, value_states)
            elif layer_idx not in self._latent_done:  # expanded K/V whose latent no expand_kv hook saw
                raise RuntimeError(f"layer {layer_idx}: transformers cached expanded K/V "
                                   f"{tuple(key_states.shape)} and its latent never passed the round trip "
                                   "(run the forward through cache_forward)")
            elif (pending := self._latent_done[layer_idx]) is not None:  # the expanded K/V of a hooked latent
                self.agreement.merge(pending)
                self._latent_done[layer_idx] = None
        else:  # GQA: [B, Hkv, S, D]; the families are per [Hkv, D] slot
            key_states = torch.stack([self._entry("k", layer_idx, b.transpose(0, 1)).transpose(0, 1)
                                      for b in key_states])
            value_states = torch.stack([self._entry("v", layer_idx, b.transpose(0, 1)).transpose(0, 1)
                                        for b in value_states])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_key_states, layer_idx):
        """The new indexer keys ``[B, S, Di]`` as :meth:`_entry` stores them, then stored."""
        if self.dsa:
            indexer_key_states = torch.stack([self._entry("index_k", layer_idx, b) for b in indexer_key_states])
        return super().update_indexer(indexer_key_states, layer_idx)


@contextmanager
def cache_forward(model, cache: RoundTripCache):
    """While open, ``forward(ids)`` runs ``model`` on ``ids [1, S]`` with
    ``cache`` handed over by the keyword its ``forward`` takes (``cache``, or
    ``past_key_values`` before ``transformers`` 5.24) and ``use_cache=True``;
    where the DSA attention expands its latent before caching (5.17), each
    layer's ``expand_kv`` first passes the latent through
    :meth:`RoundTripCache.latent` (once per layer; where the latent was
    cached first, >= 5.24, it passes through). Raises ``TypeError`` for a
    model whose ``forward`` takes neither keyword. Restored on the way out."""
    params = inspect.signature(model.forward).parameters
    word = next((w for w in ("cache", "past_key_values") if w in params), None)
    if word is None:
        raise TypeError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values=: "
                        "the reference cannot be handed the run's cache")
    patched = []

    def wrap(layer, orig):
        def expand_kv(k_pass, k_rot):
            if layer not in cache._latent_done:
                k_pass, k_rot = cache.latent(layer, k_pass, k_rot, cached=False)
            return orig(k_pass, k_rot)
        return expand_kv

    try:
        if cache.dsa:
            for i, blk in enumerate(model.model.layers):
                attn = blk.self_attn
                if hasattr(attn, "expand_kv"):
                    attn.expand_kv = wrap(getattr(attn, "layer_idx", i), attn.expand_kv)
                    patched.append(attn)
        yield lambda ids: model(ids, use_cache=True, **{word: cache})
    finally:
        for attn in patched:
            del attn.expand_kv  # the class's method again


def reference_logits(model, seq: torch.Tensor, formats: Mapping[str, KVFormat] | None = None) -> torch.Tensor:
    """``transformers``' logits ``[S, vocab]`` of ``seq [S]`` (int64): with
    ``formats`` (cache family name -> format, non-empty), one forward with a
    :class:`RoundTripCache` (``use_cache=True``), the quantized reference;
    without, the plain forward (no cache). The forward runs on the model's
    device (the ids are placed there); the logits come back on the CPU,
    where ``--check`` compares them."""
    if seq.dim() != 1:
        raise ValueError(f"seq must be 1-D token ids, got shape {tuple(seq.shape)}")
    ids = placement.place(seq, next(model.parameters()))[None]
    with torch.no_grad():
        if not formats:
            return model(ids).logits[0].cpu()
        with cache_forward(model, RoundTripCache(model.config, formats)) as forward:
            return forward(ids).logits[0].cpu()


def run_reference(model, seq: torch.Tensor, formats: Mapping[str, KVFormat],
                  run: RunRecord) -> tuple[torch.Tensor, Agreement]:
    """``transformers``' logits ``[S, vocab]`` of ``seq [S]`` at what a run
    stored and selected (``run``, for every position of ``seq``): a
    :class:`RoundTripCache` in ``formats`` holding the run's stored values,
    and, with ``run.selected``, each indexer's top-k pinned to the run's
    (:func:`~cpkv.models.selection.pinned_indexers`). Returns the logits and
    the :class:`Agreement` of the run's values and selection with the
    reference's. Runs on the model's device; the logits come back on the CPU.
    [[RFC-0001:C-EXACTNESS]]"""
    if seq.dim() != 1:
        raise ValueError(f"seq must be 1-D token ids, got shape {tuple(seq.shape)}")
    if run.selected is not None:
        n, S = len(indexer_layers(model)), seq.numel()
        if run.selected.dim() != 3 or run.selected.shape[:2] != (S, n) or run.pinned is None \
                or run.pinned.shape != (S,):
            raise ValueError(f"a selection of {S} tokens over {n} indexer layers is [{S}, {n}, k] with pinned "
                             f"[{S}]; got {tuple(run.selected.shape)} and "
                             f"{None if run.pinned is None else tuple(run.pinned.shape)}")
    ids = placement.place(seq, next(model.parameters()))[None]
    cache = RoundTripCache(model.config, formats, run)
    rows: list[dict] = []
    with torch.no_grad(), cache_forward(model, cache) as forward:
        if run.selected is None:
            logits = forward(ids).logits[0].cpu()
        else:
            with pinned_indexers(model, run.selected, run.pinned, rows):
                logits = forward(ids).logits[0].cpu()
    for a in rows:
        cache.agreement.add_rows(a)
    return logits, cache.agreement
