"""W2: owner-lane paged allocator.

State lives in one class, :class:`OwnerLaneAllocator`. Logical pages are
numbered ``1 .. size // page_size`` (page 0 is reserved for padding); page ``p``
belongs to lane ``p % cp_size`` and lives on its lane's free list until it is
handed out. Invariants, held after every call:

* every usable page is either on exactly one free list (its own lane's) or
  allocated, never both; per lane, free + allocated == the lane's pages;
* after a successful extend or decode, every new slot of request r at position
  t lies on a page owned by ``(b_r + t // S) % N`` ([[RFC-0001:C-OWNER-LANE]]);
* ``out_cache_loc`` is flattened in request order, then position order
  ([[RFC-0001:C-FLATTENED-ORDER]]);
* a refused call (a lane short of pages) or a rejected plan
  (:class:`UnsupportedPagePlan`) leaves the state exactly as it was
  ([[RFC-0001:C-FAIL-FAST]]);
* the result depends only on the inputs and the state, so N ranks running N
  allocators on the same calls agree to the byte with no communication
  ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).

Control state (free lists, the allocated bitmap) and the plan live on the host
in numpy, as a scheduler's do; the token-level expansion into ``out_cache_loc``
runs in torch on ``device``. Nothing loops per page or per token; the only
Python loop is one step per request when lane bases must be chosen one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import plan
from .errors import UnsupportedPagePlan
from .layout import SharedKVLayout, lane_base_from_prefix, lane_of_position, owner_of, page_of


@dataclass
class ExtendAllocation:
    """The result of one extend (or decode) allocation plus its batch plan.

    Consumers (W3, W4, W6, W7) take this as given and validate it against their
    layout; they never recompute owners from prefix and extend lengths
    ([[RFC-0001:C-DOWNSTREAM-CONTRACT]]).

    Per request (length bs): ``prefix_lens``, ``seq_lens``, ``extend_lens``,
    ``extend_start_loc`` (offset into ``out_cache_loc``), ``lane_base`` and
    ``new_page_start`` (offset into ``new_pages``). Per new page:
    ``new_pages``, ``new_page_owners``, ``new_page_positions``.
    """

    out_cache_loc: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_lens: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    lane_base: torch.Tensor
    new_pages: torch.Tensor
    new_page_owners: torch.Tensor
    new_page_positions: torch.Tensor
    new_page_start: torch.Tensor
    page_size: int
    cp_size: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        """Requests in the batch."""
        return self.extend_lens.numel()

    @property
    def request_of_token(self) -> torch.Tensor:
        """Request index of every entry of ``out_cache_loc``."""
        if "req" not in self._cache:
            self._cache["req"] = torch.repeat_interleave(
                torch.arange(self.batch_size, device=self.extend_lens.device), self.extend_lens
            )
        return self._cache["req"]

    @property
    def positions(self) -> torch.Tensor:
        """Sequence position of every entry of ``out_cache_loc``."""
        if "pos" not in self._cache:
            req = self.request_of_token
            i = torch.arange(req.numel(), device=req.device)
            self._cache["pos"] = self.prefix_lens[req] + i - self.extend_start_loc[req]
        return self._cache["pos"]

    @property
    def token_owners(self) -> torch.Tensor:
        """Owner rank of every entry of ``out_cache_loc`` (from the allocated pages)."""
        if "own" not in self._cache:
            self._cache["own"] = owner_of(page_of(self.out_cache_loc, self.page_size), self.cp_size)
        return self._cache["own"]

    def rank_split(self, rank: int) -> plan.RankSplit:
        """Page-granular split for ``rank`` ([[RFC-0001:C-PLANNER-SPLIT]])."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank {rank} is not in a CP group of {self.cp_size}")
        return plan.split_page(self.token_owners, self.request_of_token, self.positions, self.batch_size, rank)

    def rank_token_indices(self, rank: int) -> torch.Tensor:
        """Entries of ``out_cache_loc`` that ``rank`` computes under the page split."""
        return self.rank_split(rank).token_indices

    def to_host(self, name: str) -> np.ndarray:
        """One metadata field as a host numpy array (no copy on CPU)."""
        return getattr(self, name).cpu().numpy()

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


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def _expand_runs(pages, q, prefix, seq, S: int, total: int, device) -> torch.Tensor:
    """Token-level slots of a batch from its touched pages, on ``device``.

    Page k (request-local position ``q[k]``) is used from offset
    ``lo = max(prefix - q*S, 0)`` up to ``hi = min(seq - q*S, S)``; the slots
    are those runs laid end to end. When every run is a whole page this is one
    broadcast add; otherwise one cumulative sum over per-token increments (1
    inside a run, a jump at each run start). No loop per page or token.
    """
    pstart = q * S
    lo = np.maximum(prefix - pstart, 0)
    hi = np.minimum(seq - pstart, S)
    if (lo == 0).all() and (hi == S).all():
        ar = torch.arange(S, device=device)
        return (torch.from_numpy(pages * S).to(device)[:, None] + ar[None, :]).view(-1)
    first = pages * S + lo
    run_start = np.cumsum(hi - lo) - (hi - lo)
    jump = first.copy()
    jump[1:] -= first[:-1] + (hi - lo)[:-1] - 1  # from the last slot of the previous run
    steps = torch.ones(total, dtype=torch.int64, device=device)
    steps[torch.from_numpy(run_start).to(device)] = torch.from_numpy(jump).to(device)
    return torch.cumsum(steps, 0, out=steps)


def _rank_in_lane(lanes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries share its lane (one stable sort)."""
    order = np.argsort(lanes, kind="stable")
    rank = np.empty_like(lanes)
    rank[order] = np.arange(lanes.size) - (np.cumsum(counts) - counts)[lanes[order]]
    return rank


def _host_ints(x) -> np.ndarray:
    """A flat int64 host copy of a list, array or tensor (any device)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.array(x, dtype=np.int64).reshape(-1)


class OwnerLaneAllocator:
    """Paged KV allocator with one free list per owner lane.

    ``size`` tokens make ``size // page_size`` usable pages, numbered from 1.
    ``base_policy`` picks lane bases for requests without a prefix:
    ``"least_full"`` (default, DESIGN 3.2) or ``"lane0"`` (a baseline).
    ``layout``, if given, must agree with ``page_size`` and ``cp_size`` and hold
    every page. Results are torch tensors on ``device``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        cp_size: int,
        device: str | torch.device = "cpu",
        *,
        base_policy: str = "least_full",
        layout: SharedKVLayout | None = None,
    ):
        if page_size < 1 or cp_size < 1:
            raise ValueError(f"page_size and cp_size must be >= 1, got {page_size}, {cp_size}")
        self.page_size, self.cp_size, self.device = page_size, cp_size, torch.device(device)
        self.num_pages = size // page_size
        if self.num_pages < 1:
            raise ValueError(f"size {size} holds no page of {page_size} tokens")
        if base_policy not in plan.BASE_POLICIES:
            raise ValueError(f"unknown base_policy {base_policy!r}; choose from {plan.BASE_POLICIES}")
        self.base_policy = base_policy
        if layout is None:
            layout = SharedKVLayout(cp_size, page_size, -(-(self.num_pages + 1) // cp_size))
        elif layout.slots_per_page != page_size or layout.cp_size != cp_size or layout.num_pages < self.num_pages + 1:
            raise UnsupportedPagePlan(
                "layout-mismatch",
                f"allocator (page_size={page_size}, cp_size={cp_size}, pages 1..{self.num_pages}) "
                f"does not fit {layout}",
            )
        self.layout = layout
        self.lane_pages = np.bincount(np.arange(1, self.num_pages + 1) % cp_size, minlength=cp_size)
        self.last_deficit: np.ndarray | None = None
        self.last_allocation: ExtendAllocation | None = None
        self.clear()

    # -- state ----------------------------------------------------------------
    def clear(self) -> None:
        """Every page back on its lane's free list, lowest page on top."""
        N = self.cp_size
        self._stack = np.zeros((N, int(self.lane_pages.max())), dtype=np.int64)
        for lane in range(N):  # once per lane, at set-up only
            pages = np.arange(lane if lane else N, self.num_pages + 1, N)
            self._stack[lane, : pages.size] = pages[::-1]
        self._free = self.lane_pages.copy()
        self._allocated = np.zeros(self.num_pages + 1, dtype=bool)

    def lane_free_pages(self) -> list[int]:
        """Free pages per lane."""
        return self._free.tolist()

    def available_size(self) -> int:
        """Tokens on new pages that fit whatever lane base the next request gets.

        A request of n new pages takes at most ``ceil(n / N)`` pages of any
        lane, so it fits for every base iff ``ceil(n / N) <= min lane free``:
        ``N * min(lane_free_pages) * page_size`` tokens. With ``cp_size == 1``
        that is the plain free-token count.
        """
        return self.cp_size * int(self._free.min()) * self.page_size

    def lane_for_new_chain(self, position: int, prefer: int | None = None) -> int:
        """Lane for a request's first own page at request-local position
        ``position`` when nothing fixes it yet: the lane with the most free
        pages (``least_full``; ties to ``prefer`` if it is among them, else to
        the lowest), or the lane that gives base 0 (``lane0``).
        [[RFC-0001:C-REQUEST-RELATIVE]]"""
        if self.base_policy == "lane0":
            return int(lane_of_position(0, position, self.cp_size))
        if prefer is not None and self._free[prefer] == self._free.max():
            return int(prefer)
        return int(np.argmax(self._free))

    def snapshot(self) -> tuple:
        """A copy of the whole allocator state (for tests and debugging)."""
        lanes = tuple(tuple(self._stack[l, : self._free[l]].tolist()) for l in range(self.cp_size))
        return tuple(self._free.tolist()), lanes, self._allocated.tobytes()

    def is_allocated(self, pages) -> np.ndarray:
        """Whether each page is currently handed out."""
        return self._allocated[_host_ints(pages)]

    # -- page level -----------------------------------------------------------
    def _take(self, owners: np.ndarray, rank: np.ndarray | None = None, counts: np.ndarray | None = None):
        """Pop one page from lane ``owners[i]`` for every i, or refuse (None,
        state unchanged, ``last_deficit`` set).

        ``rank[i]`` (how many earlier entries share ``owners[i]``) and
        ``counts`` (pages per lane) may be passed when the caller knows them.
        """
        if counts is None:
            counts = np.bincount(owners, minlength=self.cp_size)
        deficit = np.maximum(counts - self._free, 0)
        if deficit.any():
            self.last_deficit = deficit
            return None
        if rank is None:
            rank = _rank_in_lane(owners, counts)
        pages = self._stack.ravel()[owners * self._stack.shape[1] + self._free[owners] - 1 - rank]
        self._free -= counts
        self._allocated[pages] = True
        return pages

    def alloc_pages_with_owners(self, owners) -> torch.Tensor | None:
        """int64 pages on ``device``, page i in lane ``owners[i]``; ``None``
        (state unchanged, ``last_deficit`` set) if any lane lacks pages."""
        owners = _host_ints(owners)
        if owners.size and (owners.min() < 0 or owners.max() >= self.cp_size):
            bad = int(np.nonzero((owners < 0) | (owners >= self.cp_size))[0][0])
            raise UnsupportedPagePlan("owner-out-of-range", f"owner {owners[bad]} not in [0, {self.cp_size})", bad)
        pages = self._take(owners)
        return None if pages is None else torch.from_numpy(pages).to(self.device)

    def free(self, slots) -> None:
        """Return the pages holding ``slots`` to their own lanes.

        Padding is ignored. Freeing a page that is not allocated (or not a
        usable page) raises ``ValueError`` and frees nothing.
        """
        slots = _host_ints(slots)
        slots = slots[slots != self.layout.padding_value]
        if slots.size == 0:
            return
        pages = np.unique(page_of(slots, self.page_size))
        if pages[0] < 1 or pages[-1] > self.num_pages:
            bad = pages[0] if pages[0] < 1 else pages[-1]
            raise ValueError(f"free: page {bad} is not a usable page (1..{self.num_pages})")
        live = self._allocated[pages]
        if not live.all():
            raise ValueError(f"free: page {pages[~live][0]} is not allocated (double free?)")
        lanes = owner_of(pages, self.cp_size)
        counts = np.bincount(lanes, minlength=self.cp_size)
        rank = _rank_in_lane(lanes, counts)
        self._stack.ravel()[lanes * self._stack.shape[1] + self._free[lanes] + rank] = pages
        self._free += counts
        self._allocated[pages] = False

    # -- extend / decode --------------------------------------------------------
    def _check(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray) -> None:
        """Every fail-fast rule of [[RFC-0001:C-FAIL-FAST]], before any change:
        one fused test on the fast path, then :meth:`_explain` names the rule."""
        S, pad = self.page_size, self.layout.padding_value
        has = prefix > 0
        page = page_of(last_loc, S)
        bad = (prefix < 0) | (prefix > seq) | (~has & (last_loc != pad))
        bad |= has & ((page < 1) | (page > self.num_pages) | (last_loc - page * S != (prefix - 1) % S))
        bad |= has & ~self._allocated[np.clip(page, 0, self.num_pages)]
        partial = has & (prefix % S != 0) & (seq > prefix)
        if bad.any() or (partial.any() and np.unique(page[partial]).size < partial.sum()):
            self._explain(prefix, seq, last_loc)

    def _explain(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray) -> None:
        """Raise :class:`UnsupportedPagePlan` for the first broken rule."""
        S, pad = self.page_size, self.layout.padding_value

        def first(mask: np.ndarray) -> int | None:
            return int(np.nonzero(mask)[0][0]) if mask.any() else None

        if (r := first(prefix < 0)) is not None:
            raise UnsupportedPagePlan("negative-prefix", f"prefix_len {prefix[r]} < 0", r)
        if (r := first(prefix > seq)) is not None:
            raise UnsupportedPagePlan("prefix-longer-than-sequence", f"prefix_len {prefix[r]} > seq_len {seq[r]}", r)
        has = prefix > 0
        if (r := first(~has & (last_loc != pad))) is not None:
            raise UnsupportedPagePlan(
                "last-loc-without-prefix", f"prefix_len 0 needs last_loc {pad}, got {last_loc[r]}", r
            )
        page = page_of(last_loc, S)
        if (r := first(has & ((page < 1) | (page > self.num_pages)))) is not None:
            raise UnsupportedPagePlan(
                "slot-out-of-range", f"last_loc {last_loc[r]} is not a slot of a usable page (1..{self.num_pages})", r
            )
        if (r := first(has & (last_loc - page * S != (prefix - 1) % S))) is not None:
            raise UnsupportedPagePlan(
                "inconsistent-last-loc",
                f"last_loc {last_loc[r]} sits at page offset {last_loc[r] % S}, but a prefix of "
                f"{prefix[r]} tokens ends at offset {(prefix[r] - 1) % S}",
                r,
            )
        if (r := first(has & ~self._allocated[np.clip(page, 0, self.num_pages)])) is not None:
            raise UnsupportedPagePlan("last-loc-not-allocated", f"last_loc {last_loc[r]} lies on free page {page[r]}", r)
        partial = np.nonzero(has & (prefix % S != 0) & (seq > prefix))[0]
        _, first_use, counts = np.unique(page[partial], return_index=True, return_counts=True)
        dup = partial[np.isin(page[partial], page[partial][first_use[counts > 1]])]
        raise UnsupportedPagePlan(
            "shared-partial-page",
            f"requests {dup.tolist()} would all extend into partial page {page[dup[0]]}; "
            "give all but one a copy of that page",
            int(dup[1]),
        )

    def allocate_extend(self, prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens: int | None = None):
        """Allocate the new slots of a batch on owner lanes, with the batch plan.

        Returns an :class:`ExtendAllocation`, or ``None`` when some lane lacks
        pages (``last_deficit`` says how many per lane; nothing changed).
        Raises :class:`UnsupportedPagePlan` for a plan the owner-lane path
        cannot honour, before anything changes.
        """
        S, N, dev = self.page_size, self.cp_size, self.device
        prefix, seq, last = _host_ints(prefix_lens_cpu), _host_ints(seq_lens_cpu), _host_ints(last_loc)
        bs = seq.size
        if prefix.size != bs or last.size != bs:
            raise UnsupportedPagePlan(
                "mismatched-lengths", f"{prefix.size} prefix_lens, {bs} seq_lens, {last.size} last_loc"
            )
        self._check(prefix, seq, last)
        ext = seq - prefix
        total = int(ext.sum())
        if extend_num_tokens is not None and int(extend_num_tokens) != total:
            raise UnsupportedPagePlan(
                "extend-num-tokens", f"extend_num_tokens={extend_num_tokens} but seq_lens - prefix_lens sum to {total}"
            )

        # request level: lane bases and the owner plan  [[RFC-0001:C-REQUEST-RELATIVE]]
        has = prefix > 0
        first_new = -(-prefix // S)
        n_new = -(-seq // S) - first_new
        last_page = page_of(last, S)
        fixed = np.where(has, lane_base_from_prefix(owner_of(last_page, N), prefix, S, N), 0)
        base = plan.choose_lane_bases(fixed, has, first_new, n_new, self._free, N, self.base_policy)
        op = plan.owner_plan(base, first_new, n_new, N)
        new_pages = self._take(op.owners, op.rank_in_lane, op.lane_counts)
        if new_pages is None:
            return None

        # page level: every page the extend touches; a partial prefix page
        # (the prefix ends mid-page) comes first in its request
        partial = (prefix % S != 0) & (ext > 0)
        if partial.any():
            touched = np.where(ext > 0, -(-seq // S) - prefix // S, 0)
            req = np.repeat(np.arange(bs), touched)
            q = prefix[req] // S + np.arange(req.size) - _excl_cumsum(touched)[req]
            is_partial = q * S < prefix[req]
            pages = np.empty_like(q)
            pages[~is_partial] = new_pages
            pages[is_partial] = last_page[req[is_partial]]
        else:
            req, q, pages = op.request, op.positions, new_pages
        out = _expand_runs(pages, q, prefix[req], seq[req], S, total, dev)

        t = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        alloc = ExtendAllocation(
            out_cache_loc=out,
            extend_start_loc=t(_excl_cumsum(ext)),
            extend_lens=t(ext),
            prefix_lens=t(prefix),
            seq_lens=t(seq),
            lane_base=t(base),
            new_pages=t(new_pages),
            new_page_owners=t(op.owners),
            new_page_positions=t(op.positions),
            new_page_start=t(_excl_cumsum(n_new)),
            page_size=S,
            cp_size=N,
        )
        self.last_allocation = alloc
        return alloc

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """SGLang's paged ``alloc_extend``: ``out_cache_loc`` or ``None`` when a
        lane is short (state unchanged). The full plan is ``last_allocation``."""
        if len(prefix_lens) != len(prefix_lens_cpu) or len(seq_lens) != len(seq_lens_cpu):
            raise UnsupportedPagePlan("mismatched-lengths", "device and cpu copies of the lengths differ in size")
        alloc = self.allocate_extend(prefix_lens_cpu, seq_lens_cpu, last_loc, extend_num_tokens)
        return None if alloc is None else alloc.out_cache_loc

    def allocate_decode(self, seq_lens_cpu, last_loc) -> ExtendAllocation | None:
        """One new token per request: an extend with ``prefix_lens = seq_lens - 1``."""
        seq = _host_ints(seq_lens_cpu)
        if seq.size and seq.min() < 1:
            r = int(np.nonzero(seq < 1)[0][0])
            raise UnsupportedPagePlan("empty-decode", f"decode needs seq_len >= 1, got {seq[r]}", r)
        return self.allocate_extend(seq - 1, seq, last_loc)

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor):
        """SGLang's paged ``alloc_decode``: ``seq_lens`` include the new token,
        ``last_loc`` is the previous token's slot (-1 for none). Returns
        ``out_cache_loc`` or ``None`` (state unchanged)."""
        if len(seq_lens) != len(seq_lens_cpu):
            raise UnsupportedPagePlan("mismatched-lengths", "device and cpu copies of seq_lens differ in size")
        alloc = self.allocate_decode(seq_lens_cpu, last_loc)
        return None if alloc is None else alloc.out_cache_loc
