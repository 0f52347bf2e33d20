"""The records the scheduler keeps and reports: a :class:`Request` (its
tokens, its page-table row, where it stands) and the :class:`Stats` of a trace
(counted identically on every rank), with what each step adds to them
(:meth:`Stats.record`, :func:`lanes_used`). Values with O(1) accessors only;
their life is :class:`~cpkv.engine.scheduler.Scheduler`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..consumers.page_table import PageTable
from ..consumers.prefix_cache import PrefixMatch
from ..contract.allocator import OwnerLaneAllocator
from ..contract.layout import owner_of
from .trace import RequestSpec

__all__ = ["Request", "Stats", "append_tokens", "id_runs", "lanes_used", "outputs"]


@dataclass(eq=False)
class Request:
    """A request in the scheduler: its tokens, its page-table row and where it stands.

    ``row`` is its row in ``table`` while it holds KV (-1 otherwise) and
    ``computed`` how many positions of that row hold KV."""

    spec: RequestSpec
    index: int
    prompt: tuple = ()
    generated: list = field(default_factory=list)
    due: int | None = None  # step it may start; None while its parent runs
    admitted: int = -1  # admission serial; preemption takes the largest
    row: int = -1  # page-table row while it holds KV
    match: PrefixMatch | None = None
    computed: int = 0
    target: int = 0  # prefill until computed == target
    preemptions: int = 0
    finished_at: int = -1
    host_hit: int = 0  # tokens loaded from the host tier at the last admission
    ready: bool = False  # remote prefill: its KV waits elsewhere, ready to arrive (Scheduler.arrive)
    table: PageTable | None = field(default=None, repr=False)
    need: np.ndarray | None = field(default=None, repr=False)  # pages per lane still reserved (Scheduler)
    prefix_lanes: np.ndarray | None = field(default=None, repr=False)  # pages per lane of the shared prefix
    own_from: int = 0  # its first own page position (the shared prefix's pages at admission)
    _ids: np.ndarray | None = field(default=None, repr=False)  # token ids, int32 (see ids())
    key: str | int | None = None  # namespace in the prefix cache: the spec's, else the parent's

    def __post_init__(self):
        if self.key is None:
            self.key = self.spec.key

    @property
    def seq(self) -> tuple:
        """Every token known: the prompt, then the generated tokens. Builds a
        tuple of ``length`` ints on every call (O(context)): the scheduler's
        steps read :meth:`ids` instead."""
        return self.prompt + tuple(self.generated)

    @property
    def length(self) -> int:
        """How many tokens are known (prompt and generated); O(1)."""
        return len(self.prompt) + len(self.generated)

    def ids(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token ids of positions ``start .. end - 1`` (int32, a read-only view
        of the request's buffer; to ``length`` by default). The buffer is
        built once from the prompt, sized for every token the request will
        have (it grows by doubling past that), so a step costs O(its
        tokens), never O(context)."""
        v = self._buffer()[: self.length][start:end]
        v.flags.writeable = False
        return v

    def _buffer(self) -> np.ndarray:
        """The id buffer (built here on first use), holding every known token."""
        if self._ids is None:
            n, p = self.length, len(self.prompt)
            self._ids = np.empty(max(p + self.spec.max_new_tokens, n, 1), dtype=np.int32)
            self._ids[:p] = self.prompt
            self._ids[p:n] = self.generated
        return self._ids

    def append(self, token: int) -> None:
        """A sampled token: appended to ``generated`` and to the id buffer (amortised O(1))."""
        append_tokens([self], [token])

    @property
    def final_len(self) -> int:
        """Tokens with KV when the request finishes (the last generated token has none)."""
        return len(self.prompt) + self.spec.max_new_tokens - 1

    @property
    def slots(self) -> torch.Tensor | None:
        """Its page-table row (a view: KV slot of positions ``0 .. computed - 1``,
        then padding), or None while it holds no row."""
        return None if self.row < 0 else self.table.slots(self.row)

    @property
    def last_loc(self) -> int:
        """Slot of the last position with KV, -1 for none."""
        return int(self.table.req_to_token.numpy()[self.row, self.computed - 1]) if self.computed else -1

    @property
    def prefilling(self) -> bool:
        """Whether the request still has prompt (or recomputed) tokens to prefill."""
        return self.computed < self.target


def outputs(reqs: list[Request]) -> list[dict]:
    """What each request of a run produced, in trace order: ``id``,
    ``prompt_tokens`` (its whole prompt, a follow-up's history included) and
    ``generated`` (its greedy token ids), so a run can be diffed against
    another engine's on the same trace (``cpkv run --json``, ``--print-tokens``)."""
    return [{"id": r.spec.id, "prompt_tokens": len(r.prompt), "generated": [int(t) for t in r.generated]}
            for r in reqs]


def append_tokens(reqs: list[Request], tokens: list[int]) -> list[Request]:
    """``tokens[i]`` sampled for ``reqs[i]``: appended to its ``generated``
    and its id buffer (amortised O(1) each, one pass). Returns the requests
    that now have their ``max_new_tokens``, in order. Raises ``ValueError``,
    nothing appended, for counts that differ or a token that is not an int >= 0."""
    if len(tokens) != len(reqs):
        raise ValueError(f"{len(reqs)} requests but {len(tokens)} tokens")
    tokens = [int(t) for t in tokens]  # every conversion before the first append
    if tokens and min(tokens) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
    done = []
    for r, t in zip(reqs, tokens):
        g = r.generated
        g.append(t)
        ids = r._ids
        if ids is not None:
            n = len(r.prompt) + len(g)
            if n > ids.size:
                ids = r._ids = np.concatenate([ids, np.empty(ids.size, dtype=np.int32)])
            ids[n - 1] = t
        if len(g) == r.spec.max_new_tokens:
            done.append(r)
    return done


def id_runs(reqs: list[Request], starts: list[int], ends: list[int]) -> np.ndarray:
    """Token ids of positions ``starts[i] .. ends[i] - 1`` of each request,
    back to back (int32, a new array): one concatenate, no read-only view per
    request. Raises ``ValueError`` for a run outside ``0 .. length`` or
    counts that differ."""
    if not len(reqs) == len(starts) == len(ends):
        raise ValueError(f"{len(reqs)} requests, {len(starts)} starts, {len(ends)} ends")
    if not all(0 <= a <= e <= r.length for r, a, e in zip(reqs, starts, ends)):
        raise ValueError("every run must lie within its request's known tokens")
    runs = [r._buffer()[a:e] for r, a, e in zip(reqs, starts, ends)]
    return np.concatenate(runs) if runs else np.empty(0, dtype=np.int32)


@dataclass
class Stats:
    """What a trace did, counted by the scheduler (identical on every rank)."""

    steps: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # device prefix-cache hits at admission
    host_hit_tokens: int = 0  # tokens loaded from the host tier
    arrived_tokens: int = 0  # remote prefill: tokens whose KV arrived from another group
    computed_tokens: int = 0
    generated_tokens: int = 0
    chunk_continuations: int = 0  # prefill chunks continuing an earlier chunk of the same request
    mid_page_continuations: int = 0  # ... from a slot in the middle of a page
    copies: int = 0  # mid-page copies
    copied_slots: int = 0
    backup_pages: int = 0
    load_pages: int = 0
    preemptions: int = 0
    refusals: int = 0
    prefix_waits: int = 0  # steps a due request waited for a prefix another request was computing (per request)
    evicted_nodes: int = 0  # device prefix-cache evictions under memory pressure
    evicted_pages: int = 0
    served_tokens: int = 0  # cached prefixes matched, tokens prefilled and decoded
    tokens_before_refusal: int | None = None
    max_request_skew: int = 0
    occupancy: list = field(default_factory=list)  # per step: used device pages per lane
    host_occupancy: list = field(default_factory=list)  # per step: used host pages

    def record(self, step: int, used: np.ndarray, host_used: int | None, evicted_nodes: int,
               evicted_pages: int) -> None:
        """Step ``step`` closed: its used device pages per lane ``used`` (see
        :func:`lanes_used`), its used host pages (``None``: no host tier) and
        the prefix cache's eviction counters so far."""
        self.evicted_nodes, self.evicted_pages = evicted_nodes, evicted_pages
        self.occupancy.append(used.tolist())
        if host_used is not None:
            self.host_occupancy.append(host_used)
        self.steps = step + 1

    def record_finished(self, per_lane: np.ndarray) -> None:
        """Requests finished holding ``per_lane`` ``[n, N]`` pages per lane:
        ``max_request_skew`` keeps the largest spread of one request's pages
        over the lanes (at most 1 while every chain keeps one lane base)."""
        if per_lane.size:
            self.max_request_skew = max(self.max_request_skew, int((per_lane.max(1) - per_lane.min(1)).max()))

    def lane_gap(self, lane_pages: int) -> float:
        """Largest gap between the fullest and the emptiest lane over the run, in % of a lane."""
        occ = np.array(self.occupancy) if self.occupancy else np.zeros((1, 1))
        return 100.0 * float((occ.max(1) - occ.min(1)).max()) / max(lane_pages, 1)


def lanes_used(alloc: OwnerLaneAllocator, lanes: int, pages: np.ndarray) -> np.ndarray:
    """Used device pages per lane ``[lanes]``: from the allocator's own
    counters when ``lanes`` is its lane count (O(N)); else (the
    owner-oblivious baseline, one allocator lane, reported over ``lanes``)
    the allocated pages among ``pages`` (every page, ``0 .. num_pages``)
    counted by ``page % lanes``."""
    if lanes == alloc.cp_size:
        return alloc.lane_pages - np.asarray(alloc.lane_free_pages())
    used = pages[alloc.is_allocated(pages)]
    return np.bincount(owner_of(used, lanes), minlength=lanes)
