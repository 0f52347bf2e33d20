"""The prefill -> decode KV transfer between CP groups of different sizes and page sizes
(prefill/decode disaggregation: one group computes a request's prompt, another decodes it).

A request prefilled by a group of ``M`` ranks (page size ``S_p``) continues
decoding in a group of ``N`` ranks (page size ``S_d``). The decode group
allocates the request's slots with its own owner-lane allocator, so each side
keeps its own owner lanes; this module moves the KV between the two
allocations ([[RFC-0001:C-DISAGG]]):

* :func:`plan_transfer` pairs every source slot with its destination slot,
  entry by entry (the i-th entry of both sides holds the same token), and
  compresses the pairing into *runs*: consecutive entries that advance by one
  slot on both sides without leaving a page on either side. With equal page
  sizes the runs are pages (or the part of a page a request starts or ends
  in); with different page sizes a run ends at whichever side's page boundary
  comes first, so no page size is refused. The plan is pure and vectorised
  (no loop per slot or page) and depends only on the two layouts and the two
  slot lists, so every rank of both groups computes it, to the byte, with no
  collective ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). It takes both
  allocations and their owner lanes as given: owners are the layouts' own
  ``owner_of_slots`` of the slots the allocators returned, never re-derived
  from prefix and extend lengths ([[RFC-0001:C-DOWNSTREAM-CONTRACT]]).
* :func:`send_transfer` / :func:`receive_transfer` move the data over a
  point-to-point transport (``torch.distributed`` isend/irecv, which works
  across machines, where the two groups share no memory). Each source owner
  reads only the pages it owns from its own segment and sends ONE message per
  destination rank (every family, every layer, every request of the
  transfer); each destination owner receives one message per source rank and
  writes only its own segment, through the pool's owner check.

A transport is any object with ``post(sends, recvs) -> pending`` where
``sends`` and ``recvs`` are lists of ``(peer, uint8 tensor)`` and
``pending.wait()`` returns once every message has gone or arrived
(:mod:`cpkv.runtime.p2p` has one on ``torch.distributed`` and one for thread
ranks).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..contract.errors import ContractViolation, UnsupportedPagePlan
from ..contract.layout import SharedKVLayout, page_of
from . import placement
from .kv_pool import Family, SharedKVPool

#: Each family's part of a message starts on this byte boundary, so the
#: receiver views it in its own dtype without a copy.
MESSAGE_ALIGN = 16


def _expand(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``starts[r], starts[r] + 1, .., starts[r] + lengths[r] - 1`` for every run, laid end to end."""
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first, lengths) + torch.arange(total)


@dataclass(frozen=True)
class TransferPlan:
    """Which source rank sends which slots to which destination rank, as runs.

    ``R`` runs, sorted by (source rank, destination rank), then entry order:
    run ``r`` moves ``length[r]`` consecutive slots from logical source slot
    ``src_start[r]`` (owned by ``src_rank[r]`` in layout ``src``) to logical
    destination slot ``dst_start[r]`` (owned by ``dst_rank[r]`` in ``dst``);
    it covers entries ``entry[r] .. entry[r] + length[r] - 1`` of the
    transfer. ``pair_slots [M, N]`` counts the slots of each (source rank,
    destination rank) pair, ``pair_offsets [M * N + 1]`` where each pair's runs
    start. ``unit`` is ``"page"`` when both sides have the same page size (a
    run is a page or part of one), ``"slot-run"`` otherwise. All tensors are
    int64 on the CPU (control state, like the allocators').
    """

    src: SharedKVLayout
    dst: SharedKVLayout
    src_start: torch.Tensor
    dst_start: torch.Tensor
    length: torch.Tensor
    src_rank: torch.Tensor
    dst_rank: torch.Tensor
    entry: torch.Tensor
    pair_slots: torch.Tensor
    pair_offsets: torch.Tensor
    num_requests: int

    @property
    def unit(self) -> str:
        """``"page"`` (equal page sizes) or ``"slot-run"`` (different page sizes)."""
        return "page" if self.src.slots_per_page == self.dst.slots_per_page else "slot-run"

    @property
    def num_slots(self) -> int:
        """Slots (tokens) the transfer moves."""
        return int(self.pair_slots.sum())

    @property
    def num_runs(self) -> int:
        """Runs in the plan."""
        return self.length.numel()

    def pairs(self) -> list[tuple[int, int]]:
        """The (source rank, destination rank) pairs that exchange a message, in order."""
        return [tuple(x) for x in torch.nonzero(self.pair_slots).tolist()]

    def destinations_of(self, src_rank: int) -> list[int]:
        """Destination ranks ``src_rank`` sends a message to, in rank order."""
        self._check(src_rank, self.src, "source")
        return torch.nonzero(self.pair_slots[src_rank]).flatten().tolist()

    def sources_of(self, dst_rank: int) -> list[int]:
        """Source ranks ``dst_rank`` receives a message from, in rank order."""
        self._check(dst_rank, self.dst, "destination")
        return torch.nonzero(self.pair_slots[:, dst_rank]).flatten().tolist()

    def _runs(self, a: int, b: int) -> slice:
        self._check(a, self.src, "source")
        self._check(b, self.dst, "destination")
        k = a * self.dst.cp_size + b
        return slice(int(self.pair_offsets[k]), int(self.pair_offsets[k + 1]))

    def send_slots(self, src_rank: int, dst_rank: int) -> torch.Tensor:
        """Logical source slots ``src_rank`` sends to ``dst_rank``, in message order (all its own)."""
        s = self._runs(src_rank, dst_rank)
        return _expand(self.src_start[s], self.length[s])

    def recv_slots(self, src_rank: int, dst_rank: int) -> torch.Tensor:
        """Logical destination slots the message from ``src_rank`` fills on ``dst_rank``, in message order."""
        s = self._runs(src_rank, dst_rank)
        return _expand(self.dst_start[s], self.length[s])

    def entries(self, src_rank: int, dst_rank: int) -> torch.Tensor:
        """Transfer entry (position in the flattened request order) of each slot of that message."""
        s = self._runs(src_rank, dst_rank)
        return _expand(self.entry[s], self.length[s])

    def digest(self) -> str:
        """SHA-256 of the plan's bytes: equal on every rank that planned the same transfer."""
        h = hashlib.sha256()
        for lay in (self.src, self.dst):
            h.update(repr((lay.cp_size, lay.slots_per_page, lay.pages_per_rank)).encode())
        for t in (self.src_start, self.dst_start, self.length, self.src_rank, self.dst_rank, self.entry,
                  self.pair_slots, self.pair_offsets):
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    @staticmethod
    def _check(rank: int, layout: SharedKVLayout, side: str) -> None:
        if not 0 <= rank < layout.cp_size:
            raise ValueError(f"{side} rank {rank} is not in a CP group of {layout.cp_size}")


def _slot_list(slots, what: str) -> list[torch.Tensor]:
    """Slots as a list of 1-D int tensors, one per request (a single tensor is one request)."""
    if isinstance(slots, torch.Tensor):
        slots = [slots]
    out = []
    for i, s in enumerate(slots):
        if not isinstance(s, torch.Tensor) or s.dtype not in (torch.int32, torch.int64) or s.dim() != 1:
            raise UnsupportedPagePlan("bad-slots", f"{what} slots must be 1-D int32/int64 tensors", request=i)
        out.append(s.detach().cpu().to(torch.int64))
    return out


def _first_doubled(x: torch.Tensor) -> int | None:
    """Index of the first entry whose value an earlier entry already has, or None."""
    if x.numel() < 2:
        return None
    vals, idx = torch.sort(x, stable=True)
    dup = vals[1:] == vals[:-1]
    return int(idx[1:][dup].min()) if bool(dup.any()) else None


def _check_side(layout: SharedKVLayout, x: torch.Tensor, req: torch.Tensor, side: str) -> None:
    """Refuse padding, out-of-range and reserved-page slots on one side, and
    doubled slots on the destination side (a source slot may feed several
    destinations: two requests that share a cached prefix on the source side)."""
    pad = x == layout.padding_value
    if bool(pad.any()):
        i = int(torch.nonzero(pad)[0])
        raise UnsupportedPagePlan("padding-slot", f"{side} entry {i} is padding: that position would be missed",
                                  request=int(req[i]))
    bad = (x < 0) | (x >= layout.capacity)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise UnsupportedPagePlan("slot-out-of-range", f"{side} slot {int(x[i])} (entry {i}) is outside the layout "
                                  f"[0, {layout.capacity})", request=int(req[i]))
    zero = page_of(x, layout.slots_per_page) == 0
    if bool(zero.any()):
        i = int(torch.nonzero(zero)[0])
        raise UnsupportedPagePlan("reserved-page", f"{side} slot {int(x[i])} (entry {i}) is on page 0, which "
                                  "no allocation hands out", request=int(req[i]))
    j = _first_doubled(x) if side == "destination" else None
    if j is not None:
        raise UnsupportedPagePlan("doubled-destination-slot", f"destination slot {int(x[j])} appears twice (again "
                                  f"at entry {j}): it would be written twice", request=int(req[j]))


def plan_transfer(src: SharedKVLayout, dst: SharedKVLayout, src_slots, dst_slots) -> TransferPlan:
    """Plan moving the KV of ``src_slots`` (source group) into ``dst_slots`` (destination group).

    ``src_slots`` and ``dst_slots`` are one int tensor each, or one per request
    (in the same request order): entry i of both holds the same token. The
    destination slots are the decode group's own owner-lane allocation for
    these positions; the source slots the prefill group's.

    Refuses, with :class:`UnsupportedPagePlan` naming the request and the rule
    and before anything is planned, a pairing that would miss or double a
    slot: ``mismatched-requests`` and ``mismatched-lengths`` (the two sides
    differ in requests or entries), ``padding-slot`` (a position has no
    slot), ``slot-out-of-range``, ``reserved-page`` (a slot on page 0),
    ``doubled-destination-slot`` (a slot would be written twice); and
    ``bad-slots`` (not 1-D integer tensors), ``not-a-layout``. Anything else
    is well formed and planned, whatever the two page sizes and group sizes;
    a source slot may appear more than once (requests sharing a cached
    prefix on the source side each receive it).

    Every destination slot is then written exactly once, by its owner, from
    the source slot of the same entry, sent by that slot's owner
    ([[RFC-0001:C-DISAGG]]).
    """
    if not isinstance(src, SharedKVLayout) or not isinstance(dst, SharedKVLayout):
        raise UnsupportedPagePlan("not-a-layout", "src and dst must be SharedKVLayout")
    s_list, d_list = _slot_list(src_slots, "source"), _slot_list(dst_slots, "destination")
    if len(s_list) != len(d_list):
        raise UnsupportedPagePlan("mismatched-requests", f"{len(s_list)} source requests, {len(d_list)} destination")
    s_len = torch.tensor([s.numel() for s in s_list], dtype=torch.int64)
    d_len = torch.tensor([d.numel() for d in d_list], dtype=torch.int64)
    if bool((s_len != d_len).any()):
        i = int(torch.nonzero(s_len != d_len)[0])
        raise UnsupportedPagePlan("mismatched-lengths", f"{int(s_len[i])} source slots, {int(d_len[i])} destination "
                                  "slots: a slot would be missed", request=i)
    empty = torch.empty(0, dtype=torch.int64)
    s = torch.cat(s_list) if s_list else empty
    d = torch.cat(d_list) if d_list else empty
    req = torch.repeat_interleave(torch.arange(len(s_list)), s_len)
    _check_side(src, s, req, "source")
    _check_side(dst, d, req, "destination")
    M, N = src.cp_size, dst.cp_size
    T = s.numel()
    if T == 0:
        return TransferPlan(src, dst, empty, empty, empty, empty, empty, empty,
                            torch.zeros((M, N), dtype=torch.int64), torch.zeros(M * N + 1, dtype=torch.int64),
                            len(s_list))
    sp, dp = page_of(s, src.slots_per_page), page_of(d, dst.slots_per_page)
    cont = (s[1:] == s[:-1] + 1) & (d[1:] == d[:-1] + 1) & (sp[1:] == sp[:-1]) & (dp[1:] == dp[:-1])
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), ~cont])).flatten()
    length = torch.diff(torch.cat([starts, torch.tensor([T])]))
    s0, d0 = s[starts], d[starts]
    a, b = src.owner_of_slots(s0), dst.owner_of_slots(d0)
    key = a * N + b
    order = torch.sort(key, stable=True).indices
    key, length = key[order], length[order]
    slots = torch.zeros(M * N, dtype=torch.int64).index_add_(0, key, length)
    runs = torch.bincount(key, minlength=M * N)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(runs, 0)])
    return TransferPlan(src, dst, s0[order], d0[order], length, a[order], b[order], starts[order],
                        slots.view(M, N), offsets, len(s_list))


def _stored_as(f: Family) -> str:
    return f"{f.shape} {f.dtype} on layers {f.layers}" if f.format is None else f"{f.format} on layers {f.layers}"


def check_formats(src: Sequence[Family], dst: Sequence[Family]) -> None:
    """Refuse a transfer between groups whose caches are stored differently:
    ``UnsupportedPagePlan`` (rule ``kv-format-mismatch``) unless both sides
    have the same families, each with the same shape, layers, dtype and
    format. A message carries stored bytes and the receiver writes them as
    they are, so groups that disagree (one in bf16, one in FP8) must be
    refused before any byte moves; nothing converts between formats.
    [[RFC-0001:C-KV-FORMAT]] [[RFC-0001:C-DISAGG]]"""
    s, d = {f.name: f for f in src}, {f.name: f for f in dst}
    if list(s) != list(d):
        raise UnsupportedPagePlan("kv-format-mismatch", f"the source keeps caches {list(s)}, the destination "
                                  f"{list(d)}")
    for n in s:
        if s[n] != d[n]:
            raise UnsupportedPagePlan("kv-format-mismatch", f"cache {n!r} is stored as {_stored_as(s[n])} by the "
                                      f"source and {_stored_as(d[n])} by the destination; a transfer moves stored "
                                      "bytes and never converts them")


# -- messages -------------------------------------------------------------------------------
def _family_nbytes(f: Family, n: int) -> int:
    return n * f.slot_bytes()  # stored bytes: a formatted family's rows [[RFC-0001:C-KV-FORMAT]]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // MESSAGE_ALIGN) * MESSAGE_ALIGN


def message_nbytes(families: Sequence[Family], n: int) -> int:
    """Bytes of one message carrying ``n`` slots of every family and layer
    (each family's part padded to :data:`MESSAGE_ALIGN`)."""
    return sum(_aligned(_family_nbytes(f, n)) for f in families)


def payload_nbytes(families: Sequence[Family], n: int) -> int:
    """KV bytes of ``n`` slots of every family and layer (no padding)."""
    return sum(_family_nbytes(f, n) for f in families)


def pack_message(families: Sequence[Family], values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One ``uint8`` message from stored rows ``values[name] [len(layers), n, *row_shape]``, families in order."""
    parts = []
    for f in families:
        raw = values[f.name].contiguous().view(-1).view(torch.uint8)
        pad = _aligned(raw.numel()) - raw.numel()
        parts.append(raw)
        if pad:
            parts.append(raw.new_zeros(pad))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def unpack_message(families: Sequence[Family], buf: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """Views ``{name: [len(layers), n, *row_shape]}`` (stored rows) into a message of ``n`` slots
    (no copy). Raises :class:`ContractViolation` when its size is not the
    size ``n`` slots of these families make."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != message_nbytes(families, n):
        raise ContractViolation(f"a message of {buf.numel()} bytes cannot hold {n} slots of "
                                f"{[f.name for f in families]} ({message_nbytes(families, n)} bytes)")
    out, o = {}, 0
    for f in families:
        nb = _family_nbytes(f, n)
        out[f.name] = buf[o : o + nb].view(f.dtype).view(len(f.layers), n, *f.row_shape)
        o += _aligned(nb)
    return out


def _families(pool: SharedKVPool) -> list[Family]:
    return list(pool.families.values())


def _check_pool(pool: SharedKVPool, layout: SharedKVLayout, side: str) -> None:
    if pool.layout != layout:
        raise UnsupportedPagePlan("layout-mismatch", f"the {side} pool's layout {pool.layout} is not the plan's {layout}")


def send_transfer(plan: TransferPlan, pool: SharedKVPool, transport, peer: Callable[[int], int]):
    """Post this source rank's messages of ``plan``: for every destination rank
    ``b`` it has slots for, ONE message with every family and layer of those
    slots, read from its own segment only (the pool refuses any slot another
    rank owns), sent to ``peer(b)``. Returns ``(pending, sent)``: wait on
    ``pending`` before the pages may change; ``sent[b]`` is the KV bytes sent
    to ``b``. [[RFC-0001:C-DISAGG]]"""
    _check_pool(pool, plan.src, "source")
    fams, a = _families(pool), pool.rank
    sends, sent = [], {}
    for b in plan.destinations_of(a):
        slots = placement.place(plan.send_slots(a, b), pool.device)
        sends.append((peer(b), pack_message(fams, pool.read_owned_all_layers(slots))))
        sent[b] = payload_nbytes(fams, slots.numel())
    return transport.post(sends, []), sent


def receive_transfer(plan: TransferPlan, pool: SharedKVPool, transport, peer: Callable[[int], int]) -> dict[int, int]:
    """Receive this destination rank's messages of ``plan`` (one from every
    source rank ``a`` that has slots for it, from ``peer(a)``) and write them
    into its own segment through the pool's owner check
    (:meth:`SharedKVPool.write_all_layers`). Returns ``{a: KV bytes received}``.
    The caller fences before anyone reads the slots. [[RFC-0001:C-DISAGG]]"""
    _check_pool(pool, plan.dst, "destination")
    fams, b = _families(pool), pool.rank
    device = pool.device
    srcs = plan.sources_of(b)
    counts = [int(plan.pair_slots[a, b]) for a in srcs]
    bufs = [torch.empty(message_nbytes(fams, n), dtype=torch.uint8, device=device) for n in counts]
    transport.post([], [(peer(a), buf) for a, buf in zip(srcs, bufs)]).wait()
    if not srcs:
        return {}
    parts = [unpack_message(fams, buf, n) for buf, n in zip(bufs, counts)]
    slots = placement.place(torch.cat([plan.recv_slots(a, b) for a in srcs]), device)
    pool.write_all_layers(slots, {f.name: torch.cat([p[f.name] for p in parts], 1) for f in fams})
    return {a: payload_nbytes(fams, n) for a, n in zip(srcs, counts)}


def slot_pairs(plan: TransferPlan) -> dict[str, torch.Tensor]:
    """The plan slot by slot, in entry order (tests and debugging):
    ``{"src_rank", "src_local", "dst_rank", "dst_local", "src_slot", "dst_slot"}``,
    each ``[T]``, local slots through each side's layout."""
    order = torch.sort(plan.entry).indices
    src = _expand(plan.src_start[order], plan.length[order])
    dst = _expand(plan.dst_start[order], plan.length[order])
    return {"src_slot": src, "dst_slot": dst,
            "src_rank": plan.src.owner_of_slots(src), "src_local": plan.src.translate_write_slots(src),
            "dst_rank": plan.dst.owner_of_slots(dst), "dst_local": plan.dst.translate_write_slots(dst)}
