"""The result of an extend or decode allocation (:class:`Allocation`):
``out_cache_loc`` and the owner plan of the batch, moved to the device only
when a consumer asks for it."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .errors import UnsupportedPagePlan
from .layout import SharedKVLayout, owner_of, page_of

REQUEST_FIELDS = ("prefix_lens", "seq_lens", "extend_lens", "extend_start_loc", "lane_base", "new_page_start")
PAGE_FIELDS = ("new_pages", "new_page_owners", "new_page_positions")


def _field(name: str, doc: str) -> property:
    return property(lambda self: self._tensor(name), doc=doc)


class Allocation:
    """The result of one allocation, extend or decode alike, with its owner plan.

    One word for one thing: an *allocation* is what the allocator handed out
    for one batch (a decode is an extend of one token per request, so it
    returns the same kind). Consumers (the pool's direct write,
    the read path, the host tier, the disaggregation transfer) take this as given and validate it against their
    layout; they never recompute owners from prefix and extend lengths
    ([[RFC-0001:C-DOWNSTREAM-CONTRACT]]).

    ``out_cache_loc [E]`` int64 on the allocator's device: the new slots,
    request after request, position after position
    ([[RFC-0001:C-FLATTENED-ORDER]]). The plan fields are int64 tensors on the
    same device, made on first use: per request ``[bs]`` ``prefix_lens``,
    ``seq_lens``, ``extend_lens``, ``extend_start_loc`` (offset into
    ``out_cache_loc``), ``lane_base`` and ``new_page_start`` (offset into
    ``new_pages``); per new page ``[P]`` ``new_pages``, ``new_page_owners``,
    ``new_page_positions`` (request-local page position q). The per-request
    fields travel to the device in one packed copy, the per-page ones in
    another; :meth:`to_host` reads any of them on the host without a copy.
    """

    def __init__(self, out_cache_loc: torch.Tensor, page_size: int, cp_size: int,
                 host_plan: Callable[[], dict[str, np.ndarray]]):
        self.out_cache_loc = out_cache_loc
        self.page_size, self.cp_size = page_size, cp_size
        self._host_plan, self._host = host_plan, None
        self._tensors: dict[str, torch.Tensor] = {}
        self._cache: dict[str, torch.Tensor] = {}

    prefix_lens = _field("prefix_lens", "Prefix length of each request ``[bs]``.")
    seq_lens = _field("seq_lens", "Sequence length after this allocation, per request ``[bs]``.")
    extend_lens = _field("extend_lens", "New tokens per request ``[bs]``.")
    extend_start_loc = _field("extend_start_loc", "Offset of each request in ``out_cache_loc`` ``[bs]``.")
    lane_base = _field("lane_base", "Lane base b_r of each request ``[bs]`` ([[RFC-0001:C-REQUEST-RELATIVE]]).")
    new_page_start = _field("new_page_start", "Offset of each request's first new page in ``new_pages`` ``[bs]``.")
    new_pages = _field("new_pages", "Logical pages newly taken, request by request ``[P]``.")
    new_page_owners = _field("new_page_owners", "Owner lane of each new page ``[P]`` ([[RFC-0001:C-OWNER-LANE]]).")
    new_page_positions = _field("new_page_positions", "Request-local page position q of each new page ``[P]``.")

    def to_host(self, name: str) -> np.ndarray:
        """One plan field as a host int64 numpy array (computed on first use; do not write to it)."""
        if name not in REQUEST_FIELDS and name not in PAGE_FIELDS:
            raise KeyError(f"{name!r} is not a plan field; fields: {REQUEST_FIELDS + PAGE_FIELDS}")
        if self._host is None:
            self._host, self._host_plan = self._host_plan(), None
        return self._host[name]

    def _tensor(self, name: str) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            group = REQUEST_FIELDS if name in REQUEST_FIELDS else PAGE_FIELDS
            packed = torch.from_numpy(np.stack([self.to_host(n) for n in group]))
            packed = packed.to(self.out_cache_loc.device)  # one copy for the whole group
            for i, n in enumerate(group):
                self._tensors[n] = packed[i]
            t = self._tensors[name]
        return t

    @classmethod
    def concat(cls, first: "Allocation", second: "Allocation") -> "Allocation":
        """One allocation of ``first``'s requests then ``second``'s (same page
        size and group), as if made by one call: offsets of the second shifted."""
        e, p = first.out_cache_loc.numel(), first.to_host("new_pages").size
        shift = {"extend_start_loc": e, "new_page_start": p}
        host = {n: np.concatenate([first.to_host(n), second.to_host(n) + shift.get(n, 0)])
                for n in REQUEST_FIELDS + PAGE_FIELDS}
        return cls(torch.cat([first.out_cache_loc, second.out_cache_loc]), first.page_size, first.cp_size,
                   lambda: host)

    @property
    def batch_size(self) -> int:
        """Requests in the batch."""
        return int(self.to_host("seq_lens").size)

    @property
    def request_of_token(self) -> torch.Tensor:
        """Request index of every entry of ``out_cache_loc`` ``[E]``."""
        if "req" not in self._cache:
            self._cache["req"] = torch.repeat_interleave(
                torch.arange(self.batch_size, device=self.out_cache_loc.device), self.extend_lens
            )
        return self._cache["req"]

    @property
    def positions(self) -> torch.Tensor:
        """Sequence position of every entry of ``out_cache_loc`` ``[E]``."""
        if "pos" not in self._cache:
            req = self.request_of_token
            i = torch.arange(req.numel(), device=req.device)
            self._cache["pos"] = self.prefix_lens[req] + i - self.extend_start_loc[req]
        return self._cache["pos"]

    @property
    def token_owners(self) -> torch.Tensor:
        """Owner rank of every entry of ``out_cache_loc`` (from the allocated pages) ``[E]``."""
        if "own" not in self._cache:
            self._cache["own"] = owner_of(page_of(self.out_cache_loc, self.page_size), self.cp_size)
        return self._cache["own"]

    def rank_token_indices(self, rank: int) -> torch.Tensor:
        """Entries of ``out_cache_loc`` that ``rank`` computes under the page
        split: those on pages it owns, in batch order, int64 ``[t]``
        ([[RFC-0001:C-PLANNER-SPLIT]]). ``ValueError`` for a rank outside the group."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is not in a CP group of {self.cp_size}")
        return torch.nonzero(self.token_owners == rank).flatten()

    def validate(self, layout: SharedKVLayout) -> None:
        """Refuse a result planned for another layout ([[RFC-0001:C-FAIL-FAST]])."""
        if layout.slots_per_page != self.page_size or layout.cp_size != self.cp_size:
            raise UnsupportedPagePlan(
                "layout-mismatch",
                f"allocation planned for page_size={self.page_size}, cp_size={self.cp_size}; "
                f"layout has page_size={layout.slots_per_page}, cp_size={layout.cp_size}",
            )
        if self.out_cache_loc.numel() and int(self.out_cache_loc.max()) >= layout.capacity:
            raise UnsupportedPagePlan("slot-out-of-range", f"a slot exceeds the layout capacity {layout.capacity}")
