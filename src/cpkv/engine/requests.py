"""A request's life in the scheduler: arrival, follow-ups, completion, and
the hooks that hand requests between two groups.

:class:`RequestLifecycle` is the half of :class:`~cpkv.engine.scheduler.Scheduler`
that knows requests from their arrival to their end (and their follow-up
turns); the scheduler adds admission and batching. Every request's KV slots
live in one :class:`~cpkv.consumers.page_table.PageTable` (a row per admitted
request, written once from each allocation); a :class:`Request` keeps its row
and its length (``computed``) only.
"""

from __future__ import annotations

import numpy as np

from ..consumers.page_table import PageTable
from ..consumers.prefix_cache import PrefixCache
from ..contract import layout
from ..contract.layout import lane_base_of_last_loc, owner_of
from .records import Request, Stats, append_tokens, id_runs
from .step_plan import StepPlan
from .trace import CacheTooSmall, RequestSpec, TraceError, check_fits, validate


class RequestLifecycle:
    """Requests from arrival to end on one prefix ``cache``: the trace's
    follow-ups, run-time submissions, completion, cancellation, the
    disaggregation hand-offs and the final drain. Subclassed by
    :class:`~cpkv.engine.scheduler.Scheduler`, which admits and batches."""

    def __init__(self, specs: list[RequestSpec], cache: PrefixCache, max_running: int, remote_prefill: bool,
                 hold_finished: bool, host, report_lanes: int | None):
        self.remote_prefill, self.hold_finished = remote_prefill, hold_finished
        self.held: dict[int, Request] = {}  # hold_finished: finished requests whose KV pages are kept
        validate(specs)
        self.cache, self.host = cache, host
        self.S, self.N = cache.S, cache.N
        self.report_lanes = report_lanes or self.N
        self.requests = [Request(s, i) for i, s in enumerate(specs)]
        self._by_id = {r.spec.id: r for r in self.requests}
        self._children: dict[str, list[Request]] = {}
        for r in self.requests:
            if r.spec.after is None:
                r.prompt, r.due = r.spec.tokens, r.spec.arrival
            else:
                self._children.setdefault(r.spec.after, []).append(r)
                if r.key is None:
                    r.key = self._by_id[r.spec.after].key  # parents come first (validated)
        self._check_capacity()
        self.waiting: list[Request] = sorted((r for r in self.requests if r.due is not None),
                                             key=lambda x: (x.due, x.index))
        self.running: list[Request] = []
        self.table = PageTable(max_running, self.max_len + 1)
        self.step = 0
        self.stats = Stats()
        self._plan: StepPlan | None = None
        self._all_pages = np.arange(cache.num_pages + 1)

    # -- set-up ----------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        """Refuse, before anything runs, the requests that could never fit the
        cache: every one of them in one :class:`CacheTooSmall` (:func:`check_fits`)."""
        self.max_len = check_fits([r.spec for r in self.requests], self.cache.lane_pages, self.S)

    def _check_fits(self, rid: str, kv_tokens: int) -> None:
        pages = -(-kv_tokens // self.S)
        per_lane = int(layout.chain_lane_pages(0, 0, pages, self.N).max())  # the fullest lane, whatever the base
        if per_lane > int(self.cache.lane_pages.min()):
            raise CacheTooSmall([(rid, kv_tokens)], self.cache.lane_pages, self.S)
        self.max_len = max(self.max_len, kv_tokens)

    def submit(self, spec: RequestSpec) -> Request:
        """Add a request while the trace runs (a router's arrival): due at
        ``max(spec.arrival, step)``, prompt ``spec.tokens``. Returns it.
        Raises :class:`TraceError`, nothing changed, for a spec with
        ``after``, an id already used, a malformed spec, or a request that
        could never fit the cache."""
        if spec.after is not None:
            raise TraceError(f"request {spec.id!r}: a submitted request has no 'after'; submit the whole prompt")
        if spec.id in self._by_id:
            raise TraceError(f"request {spec.id!r}: id {spec.id!r} is used twice")
        validate([spec])
        self._check_fits(spec.id, len(spec.tokens) + spec.max_new_tokens - 1)
        r = Request(spec, len(self.requests), prompt=spec.tokens, due=max(spec.arrival, self.step))
        self.requests.append(r)
        self._by_id[spec.id] = r
        self.waiting.append(r)
        self.waiting.sort(key=lambda x: (x.due, x.index))
        return r

    @property
    def done(self) -> bool:
        """Whether every request has finished."""
        return self.stats.finished == len(self.requests)

    def _due(self) -> list[Request]:
        return [r for r in self.waiting if r.due <= self.step]

    def skip_idle(self) -> int:
        """When nothing runs and nothing is due, move the step counter to the
        next arrival: the steps between would plan nothing (a request arriving
        at step 1,000,000 costs no million empty steps). Returns the steps
        skipped, 0 when a request runs or is due. Call it between steps."""
        if self.running or not self.waiting:
            return 0
        skipped = max(min(r.due for r in self.waiting) - self.step, 0)
        self.step += skipped
        return skipped

    def _give_back(self, r: Request) -> None:
        """``r`` holds KV no more: its page-table row goes back."""
        self.table.free_row(r.row, r.computed)
        r.row = -1

    def _track(self, r: Request, leaving: bool = False) -> None:
        """Keep ``_need_sum`` (pages per lane the running requests with pages
        still need) exact: ``r``'s share is recomputed after its page count
        changed, and dropped when it leaves the running set (or has no page
        yet: :meth:`Scheduler._reserved` asks for those each step)."""
        if r.need is not None:
            self._need_sum -= r.need
        r.need = None if leaving or r.computed == 0 else self.cache.chain_need(r.last_loc, r.computed, r.final_len)
        if r.need is not None:
            self._need_sum += r.need

    # -- completion -------------------------------------------------------------------------------
    def complete(self, plan: StepPlan, tokens: list[list[int]]) -> list[Request]:
        """Close a step: ``tokens[i]`` are the greedy tokens of the requests of
        ``plan.forwards()[i]`` (entries where ``sample`` is False are ignored).
        Finishes requests at ``max_new_tokens``; returns them. The requests
        whose KV filled a page cache it in one batched call, and the finished
        ones end in another: one Python step per request, the rest vectorised."""
        finished, caching, S = [], [], self.S
        for b, toks in zip(plan.forwards(), tokens):
            if all(b.sample):
                sampled = b.requests
            else:
                sampled = [r for r, s in zip(b.requests, b.sample) if s]
                toks = [t for t, s in zip(toks, b.sample) if s]
            done = append_tokens(sampled, toks)
            finished += done
            self.stats.generated_tokens += len(sampled)
            held = set(done) if self.hold_finished else ()  # their pages stay as they are until release_finished
            caching += [r for r in b.requests if (m := r.match) is not None and m.live and r.computed - m.shared >= S
                        and r not in held]  # full pages with KV: into the cache
            self.stats.computed_tokens += b.alloc.out_cache_loc.numel()
        if caching:
            ends = np.fromiter((r.computed // S * S for r in caching), np.int64, len(caching))
            self.cache.cache_pages_many([r.match for r in caching], *self._runs(caching, ends))
        for a in plan.arrivals:  # their KV is here now; a later preemption needs it computed again
            a.request.ready = False
            self.stats.arrived_tokens += a.slots.numel()
        if finished:
            self._finish(finished)
            gone = set(finished)
            self.running = [r for r in self.running if r not in gone]
        if self.host is not None:
            self.host.step_done()
        self._record()
        self.step += 1
        self._plan = None
        return finished

    def _runs(self, reqs: list[Request], ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions ``match.shared .. ends[i] - 1`` of each request, back to
        back: token ids, slots (one gather from the page table) and counts."""
        shared = np.fromiter((r.match.shared for r in reqs), np.int64, len(reqs))
        counts = ends - shared
        if not counts.any():  # every page is cached already (they finished as their last page filled)
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64), counts
        rows = np.fromiter((r.row for r in reqs), np.int64, len(reqs))
        return (id_runs(reqs, shared.tolist(), ends.tolist()),
                self.table.gather(np.repeat(rows, counts), layout.ranges(shared, counts)), counts)

    def _finish(self, done: list[Request]) -> None:
        """``done`` have their tokens (the caller takes them off ``running``):
        their pages per lane into the skew figure, then their KV past what
        :meth:`PrefixCache.cache_pages` cached into the cache in one batched
        call (or held): what is left past their last full page, as
        :meth:`complete` cached those with the running ones. O(their uncached
        tails + N) each, vectorised: nothing reads a whole sequence."""
        S, N, n = self.S, self.N, len(done)
        computed = np.fromiter((r.computed for r in done), np.int64, n)
        rows = [r.row for r in done]
        last = self.table.gather(np.array(rows, dtype=np.int64), computed - 1)
        first = np.fromiter((r.own_from for r in done), np.int64, n)  # its own pages: one lane base
        own = layout.chain_lane_pages(lane_base_of_last_loc(last, computed, S, N), first, -(-computed // S) - first, N)
        per_lane = np.array([r.prefix_lanes for r in done]) + own
        self.stats.max_request_skew = max(self.stats.max_request_skew, int((per_lane.max(1) - per_lane.min(1)).max()))
        needs = [r.need for r in done if r.need is not None]
        if needs:  # _track(r, leaving=True) for all of them, in one sum
            self._need_sum -= np.sum(needs, axis=0)
        if self.hold_finished:  # the rows stay with the held KV until release_finished
            self.held.update((r.index, r) for r in done)
        else:
            self.cache.insert_tails([r.match for r in done], *self._runs(done, computed))
            self.table.free_rows(rows, computed.tolist())
        step, keep = self.step, self.hold_finished
        for r in done:
            r.need, r.finished_at = None, step
            if not keep:  # the KV is the cache's now, the row the table's
                r.match, r.row = None, -1
        self._conclude(done)

    def _conclude(self, done: list[Request]) -> None:
        """Requests are done: counted, their follow-ups released, and
        ``waiting`` sorted by due step (once for the batch)."""
        self.stats.finished += len(done)
        kids = self._children
        for r in done if kids else ():
            for c in kids.get(r.spec.id, ()):
                c.prompt = r.seq + c.spec.tokens
                c.due = max(c.spec.arrival, self.step + 1 + c.spec.delay)
                self.waiting.append(c)
        self.waiting.sort(key=lambda x: (x.due, x.index))

    def _record(self) -> None:
        self.stats.evicted_nodes, self.stats.evicted_pages = self.cache.evicted_nodes, self.cache.evicted_pages
        if self.report_lanes == self.N:  # from the allocator's counters, O(N)
            used = self.cache.lane_pages - np.asarray(self.cache.lane_free_pages())
            self.stats.occupancy.append(used.tolist())
        else:  # lanes the allocator does not keep (the owner-oblivious baseline): count the pages
            used = np.flatnonzero(self.cache.is_allocated(self._all_pages))
            self.stats.occupancy.append(np.bincount(owner_of(used, self.report_lanes),
                                                    minlength=self.report_lanes).tolist())
        if self.host is not None:
            self.stats.host_occupancy.append(self.host.used_pages())
        self.stats.steps = self.step + 1

    # -- disaggregation hooks --------------------------------------------------------------------
    def awaiting_kv(self) -> list[Request]:
        """Remote prefill: the due requests whose KV is not ready (it must be
        computed elsewhere, then :meth:`arrive`), in admission order."""
        if not self.remote_prefill:
            return []
        return [r for r in self._due() if not r.ready]

    def arrive(self, index: int, token: int) -> bool:
        """Remote prefill: request ``index`` (waiting, not ready) has its whole
        sequence's KV computed elsewhere, and ``token`` was sampled after it:
        the token is appended and the request becomes ready, to be admitted
        (its KV allocated and listed in :attr:`StepPlan.arrivals`) by a later
        :meth:`plan`. Returns True when that token finished the request (no
        KV needs to arrive). Raises ``ValueError``, nothing changed, for a
        scheduler without remote prefill or a request that is not waiting for
        its KV."""
        if not self.remote_prefill:
            raise ValueError("arrive() is for a remote-prefill scheduler")
        r = self.requests[index] if 0 <= index < len(self.requests) else None
        if r is None or r not in self.waiting or r.ready or r.due is None or r.due > self.step:
            raise ValueError(f"request {index} is not waiting for its KV")
        r.append(token)
        self.stats.generated_tokens += 1
        if len(r.generated) == r.spec.max_new_tokens:
            self.waiting.remove(r)
            r.finished_at = self.step
            self._conclude([r])
            return True
        r.ready = True
        return False

    def release_finished(self, index: int, cache: bool = True) -> None:
        """Hold finished: end the hold on request ``index``'s KV pages: into
        the prefix cache (``cache``), or back to the free lists (their KV is
        not wanted, e.g. a transfer failed). Raises ``KeyError`` for a request
        not held."""
        if index not in self.held:
            raise KeyError(f"request {index} is not held")
        r = self.held.pop(index)
        m = r.match
        if cache:  # what cache_pages has not cached yet: O(the tail)
            self.cache.insert_tail(m, r.ids(m.shared, r.computed), r.slots[m.shared : r.computed])
        else:
            self.cache.release(m, r.slots[: r.computed])
        r.match = None
        self._give_back(r)

    def cancel(self, index: int) -> None:
        """Drop a running request without caching its KV (a client abort, or
        KV that never arrived): its private pages go back to the free lists,
        its row is freed, and it counts as finished with what it generated.
        Raises ``ValueError`` for a request that is not running."""
        r = self.requests[index] if 0 <= index < len(self.requests) else None
        if r is None or r not in self.running:
            raise ValueError(f"request {index} is not running")
        if self._plan is not None:
            self._plan.drop(r)
        self.cache.release(r.match, r.slots[: r.computed])
        self.running.remove(r)
        self._track(r, leaving=True)
        self._give_back(r)
        r.match, r.finished_at = None, self.step
        self._conclude([r])

    def check_drained(self) -> None:
        """After :meth:`drain`: raise ``AssertionError`` if any device or host
        page, or any prefix match, is still held (a leak)."""
        held = self.cache.num_pages - sum(self.cache.lane_free_pages())
        host = 0 if self.host is None else self.host.used_pages()
        matches = self.cache.open_matches + (0 if self.host is None else self.host.index.open_matches)
        if held or host or matches or self.running:
            raise AssertionError(f"leak after the trace: {held} device pages, {host} host pages, {matches} "
                                 f"prefix matches, {len(self.running)} requests still held")

    def drain(self) -> None:
        """After the trace: every cached page back to the free lists (no
        backup), and every held request's pages with them."""
        for i in list(self.held):
            self.release_finished(i, cache=False)
        self.cache.clear(notify=False)
        if self.host is not None:
            self.host.clear()
