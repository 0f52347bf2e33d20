"""The one scheduler of cpkv: the engine runs it on a CP group, the simulator without a model.

Every rank runs the same :class:`Scheduler` on the same trace and the same
sampled tokens, so every decision (admission, prefix matches, allocation,
eviction, preemption, host backups and loads) is identical on every rank with
no collective ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). A step is planned by
:meth:`Scheduler.plan` into a :class:`~cpkv.engine.step_plan.StepPlan` (what
to copy, back up, load, and the one forward to compute), carried out by an
executor (the engine's ranks, or nothing), and closed by
:meth:`Scheduler.complete` with the sampled tokens. Every request's KV slots
live in one :class:`~cpkv.consumers.page_table.PageTable` (a row per admitted
request, written once from each allocation); a :class:`Request` keeps its row
and its length (``computed``) only. The scheduler changes pages through the
prefix cache's verbs only (never the allocator behind it): one admission
question (:meth:`~cpkv.consumers.prefix_cache.PrefixCache.can_allocate`), one
verb to take it (:meth:`~cpkv.consumers.prefix_cache.PrefixCache.allocate`).

Each step:

1. arrivals: a request is due at its arrival step, and a follow-up turn no
   earlier than ``delay`` steps after its parent finished (its prompt is the
   parent's prompt, the parent's generated tokens, then its own tokens);
2. admission, first come first served, while fewer than ``max_running`` run:
   the longest cached prefix is looked up without side effects, and the
   request is admitted only while every lane can hold what the running
   requests and it still need (free plus evictable pages, less a headroom);
   then the prefix is taken (a mid-page match is copied into a private page
   before the first forward). A longer prefix in the host tier is loaded into
   new device pages, allocated as a continuation with owner lanes. A request
   whose prompt shares at least one whole page more than the caches hold with
   a running request still prefilling those pages (one admitted in the same
   step, typically: a burst with one system prompt) waits, and later requests
   go ahead of it, until that request's pages enter the cache; then it hits
   them instead of computing them again (``wait_for_prefix``; SGLang's
   in-batch prefix check defers such a request one round, this waits as long
   as the pages are being computed, a long prefix's chunks included);
3. decode: one token for every request past its prefill. A refused decode
   allocation (even after lane-aware eviction) preempts the most recently
   admitted request: its pages are freed and it is requeued to recompute;
4. prefill: chunks of the requests still prefilling, first admitted first, up
   to ``chunk`` tokens in all; a chunk that ends mid-page is continued next
   step from that slot. The decodes and the chunks go in one forward, the
   decodes first as one-token extends (SGLang's mixed chunk);
5. :meth:`complete`: greedy tokens are appended; the running requests' full
   pages enter the prefix cache; a request that has its ``max_new_tokens``
   is finished and the rest of its KV cached.

What an allocation evicts comes back from the cache as values
(:attr:`~cpkv.consumers.prefix_cache.PrefixCache.last_evicted`); with a host
tier the scheduler backs each chain up there and lists the copies first in
the plan (the executor runs them before the device pages are reused). Never a
deadlock: a request that could never fit the cache is refused before the
trace starts, and a refused allocation always either preempts or shrinks the
batch.

Two hooks let two schedulers serve one trace from two CP groups
(prefill/decode disaggregation, :mod:`cpkv.engine.disagg`):

* ``remote_prefill`` (the decode side): a due request's KV is computed
  elsewhere. :meth:`Scheduler.awaiting_kv` lists the due requests whose KV is
  not ready; :meth:`Scheduler.arrive` says that it is (with the token sampled
  after it). Admission then matches the device prefix cache, allocates the
  rest as a continuation with owner lanes (as a host load is allocated) and
  lists it in :attr:`StepPlan.arrivals`; the executor fills those slots before
  the forward and the request decodes from there;
* ``hold_finished`` (the prefill side): a finished request keeps its KV
  pages (not cached, not freed) until :meth:`Scheduler.release_finished`,
  so another group can read them; :meth:`Scheduler.submit` adds requests at
  run time.
"""

from __future__ import annotations

import numpy as np
import torch

from ..consumers.page_table import PageTable
from ..consumers.prefix_cache import Admission, PrefixCache, PrefixMatch
from ..contract import layout
from ..contract.allocation import Allocation
from ..contract.layout import lane_base_of_last_loc, owner_of, page_of
from .records import Request, Stats, append_tokens, id_runs, lanes_used
from .step_plan import Arrival, Backup, Copy, Forward, Load, StepPlan
from .trace import RequestSpec, TraceError, check_fits, validate

__all__ = ["ADMISSION", "Request", "Scheduler", "Stats", "StepPlan"]

ADMISSION = ("lanes", "none")


class Scheduler:
    """Continuous batching over a trace on one owner-lane cache (see the module doc).

    ``cache`` is the device prefix cache (over the allocator every rank
    replicates); ``host`` an optional :class:`~cpkv.consumers.hicache.HostTier`.
    ``report_lanes`` is the lane count used for occupancy figures (the
    allocator's own by default; the simulator's owner-oblivious baseline runs
    one lane and reports ``page % N``). ``remote_prefill`` and
    ``hold_finished`` are the disaggregation hooks of the module docstring
    (a remote-prefill scheduler keeps no host tier). ``wait_for_prefix``: a
    due request waits for the pages of a prefix a running request is
    computing (the module docstring, step 2; never in a remote-prefill
    scheduler, whose KV is computed elsewhere). Raises ``ValueError``
    for a bad setting and :class:`~cpkv.engine.trace.TraceError` (a
    :class:`~cpkv.engine.trace.CacheTooSmall` naming every such request) for
    a trace that could never fit the cache.
    """

    def __init__(self, specs: list[RequestSpec], cache: PrefixCache, *, chunk: int = 512, max_running: int = 64,
                 admission: str = "lanes", headroom: float = 0.0, host=None, report_lanes: int | None = None,
                 remote_prefill: bool = False, hold_finished: bool = False, wait_for_prefix: bool = True):
        if admission not in ADMISSION:
            raise ValueError(f"unknown admission {admission!r}; choose from {ADMISSION}")
        if chunk < 1 or max_running < 1:
            raise ValueError(f"chunk and max_running must be >= 1, got {chunk}, {max_running}")
        if remote_prefill and host is not None:
            raise ValueError("a remote-prefill scheduler keeps no host tier: its KV arrives from the prefill group")
        self.chunk, self.max_running, self.admission, self.headroom = chunk, max_running, admission, headroom
        if not isinstance(wait_for_prefix, bool):
            raise ValueError(f"wait_for_prefix must be a bool, got {wait_for_prefix!r}")
        self.remote_prefill, self.hold_finished = remote_prefill, hold_finished
        self.wait_for_prefix = wait_for_prefix and not remote_prefill
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
        self._all_pages = np.arange(cache.alloc.num_pages + 1)
        self._serial = 0
        self._need_sum = np.zeros(self.N, dtype=np.int64)  # what the running requests with pages still need

    @property
    def layout(self):
        """The :class:`~cpkv.contract.layout.SharedKVLayout` of the device cache."""
        return self.cache.alloc.layout

    @property
    def done(self) -> bool:
        """Whether every request has finished."""
        return self.stats.finished == len(self.requests)

    # -- set-up and arrivals -----------------------------------------------------------------------
    def _check_capacity(self) -> None:
        """Refuse, before anything runs, the requests that could never fit the
        cache: every one of them in one :class:`CacheTooSmall` (:func:`check_fits`)."""
        self.max_len = check_fits([r.spec for r in self.requests], self.cache.alloc.lane_pages, self.S)

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
        self.max_len = max(self.max_len, check_fits([spec], self.cache.alloc.lane_pages, self.S))
        r = Request(spec, len(self.requests), prompt=spec.tokens, due=max(spec.arrival, self.step))
        self.requests.append(r)
        self._by_id[spec.id] = r
        self.waiting.append(r)
        self.waiting.sort(key=lambda x: (x.due, x.index))
        return r

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

    # -- planning -------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Plan the next step: admissions, then the decodes and the prefill
        chunks (allocating, evicting and preempting as needed), as one forward."""
        p = self._plan = StepPlan(self.step)
        self._admit(p)
        decode = self._plan_decode(p)
        p.forward = Forward.mixed(decode, self._plan_prefill(p))
        return p

    def _reserved(self) -> np.ndarray:
        """Pages per lane the running requests still need: the kept sum of
        their needs (each recomputed only when its page count changes), plus
        the requests with no page yet, whose lanes the allocator picks later
        (asked now). O(N) per request without a page, O(1) for the others."""
        need = self._need_sum.copy()
        for r in self.running:
            if r.computed == 0:
                need += self.cache.chain_need(-1, 0, r.final_len)
        return need

    def _admit(self, p: StepPlan) -> None:
        due = self._due()
        if not due:
            return
        reserved = self._reserved() if self.admission == "lanes" else None
        headroom = int(self.headroom * int(self.cache.alloc.lane_pages.min()))
        leaders = self._prefilling() if self.wait_for_prefix else None
        for r in due:
            if self.remote_prefill and not r.ready:
                continue  # its KV is still being computed elsewhere
            if len(self.running) >= self.max_running:
                break
            adm = self.cache.can_allocate(r.ids(), r.final_len, self.host, key=r.key)
            if leaders and self._waits(r, leaders, max(adm.hit.length, adm.host_len)):
                self.stats.prefix_waits += 1
                continue  # the pages it would compute are being computed: it hits them once they are cached
            if reserved is not None and self.running and not adm.fits(reserved + headroom):
                break
            if not self._start(p, r, adm):
                break
            if reserved is not None:
                reserved = reserved + self.cache.chain_need(r.last_loc, r.computed, r.final_len)
            if leaders is not None and r.prefilling:
                self._lead(leaders, r)

    def _prefilling(self) -> dict:
        """The running requests still prefilling, by their first page (and
        namespace): the requests a due one may wait for (:meth:`_waits`)."""
        leaders: dict = {}
        for r in self.running:
            if r.prefilling:
                self._lead(leaders, r)
        return leaders

    def _lead(self, leaders: dict, r: Request) -> None:
        if r.target > self.S:
            leaders.setdefault((r.key, r.ids(0, self.S).tobytes()), []).append(r)

    def _waits(self, r: Request, leaders: dict, hit: int) -> bool:
        """Whether ``r`` (whose prefix the caches hold for ``hit`` tokens)
        shares with a request of ``leaders`` at least one whole page more,
        that request has yet to compute: once computed, those pages are cached
        (:meth:`complete`) and ``r``'s lookup finds them. O(1) without a
        request of the same first page, else one vectorised comparison each."""
        S, end = self.S, r.length - 1  # the last token is always computed (a match stops before it)
        if end < hit + S:
            return False
        same = leaders.get((r.key, r.ids(0, S).tobytes()))
        if not same:
            return False
        mine = r.ids(0, end)
        for lead in same:
            theirs = lead.ids(0, min(lead.target, end))
            n = theirs.size
            diff = np.flatnonzero(mine[:n] != theirs)
            shared = (int(diff[0]) if diff.size else n) // S * S
            if shared >= hit + S and lead.computed < shared:
                return True
        return False

    def _start(self, p: StepPlan, r: Request, adm: Admission) -> bool:
        """Take the admission (the prefix match), a page-table row, and plan
        the copy, the host load or the arrival."""
        seq = adm.tokens
        m = self.cache.allocate(adm)
        self._back_up(p)
        computed, loaded, rest = m.length, 0, None
        if self.remote_prefill:  # the rest of the KV arrives from the prefill group: allocate it as a continuation
            kv = len(seq) - 1  # the last token (sampled there) has no KV yet
            if m.length < kv:
                rest = self.cache.allocate_extend([m.length], [kv], torch.tensor([m.last_loc]))
                self._back_up(p)
                if rest is None:
                    self._release(m, m.copy_dst)
                    return False
            computed = kv
        elif adm.host_len:  # pin the host copy first: the allocation below may evict and back up
            host_slots = self.host.take(seq, m.length, adm.host_len, key=r.key)
            rest = self.cache.allocate_extend([m.length], [adm.host_len], torch.tensor([m.last_loc]))
            self._back_up(p)
            if rest is not None:
                computed, loaded = adm.host_len, adm.host_len - m.length
        r.table, r.row = self.table, self.table.take_row()
        slots = m.slots  # derived: read once
        self.table.write(r.row, 0, slots)
        if rest is not None:
            self.table.write(r.row, m.length, rest.out_cache_loc)
            if self.remote_prefill:
                p.arrivals.append(Arrival(r, m.length, rest.out_cache_loc))
            else:
                p.loads.append(Load(host_slots, rest.out_cache_loc, r))
        r.match, r.computed = m, computed
        r.target = computed if self.remote_prefill else len(seq)
        r.admitted = self._serial = self._serial + 1
        r.host_hit = loaded
        self.waiting.remove(r)
        self.running.append(r)
        self._track(r)
        r.prefix_lanes = np.bincount(owner_of(page_of(slots[: m.shared : self.S].numpy(), self.S), self.N),
                                     minlength=self.N)
        r.own_from = m.shared // self.S
        if (dst := m.copy_dst).numel():
            p.copies.append(Copy(m.copy_src, dst, r))
            self.stats.copies += 1
            self.stats.copied_slots += dst.numel()
        st = self.stats
        st.prompt_tokens += len(seq)
        st.hit_tokens += m.length
        st.host_hit_tokens += loaded
        st.served_tokens += computed
        return True

    def _back_up(self, p: StepPlan) -> None:
        """With a host tier: back up to it the chains the cache's last call
        evicted (their device slots are read before anything reuses them: the
        executor runs ``p.backups`` first)."""
        if self.host is None:
            return
        for e in self.cache.last_evicted:
            got = self.host.backup(e.tokens, e.slots, key=e.key)
            if got is not None:
                p.backups.append(Backup(*got))
                self.stats.backup_pages += got[0].numel() // self.S

    def _refused(self) -> None:
        self.stats.refusals += 1
        if self.stats.tokens_before_refusal is None:
            self.stats.tokens_before_refusal = self.stats.served_tokens

    def _preempt(self, p: StepPlan, among: list[Request] | None = None) -> Request | None:
        """Free the most recently admitted running request (of ``among``) and
        requeue it to recompute later; ``None`` when there is none."""
        among = self.running if among is None else among
        if not among:
            return None
        r = max(among, key=lambda x: x.admitted)
        p.drop(r)
        self._release(r.match, r.slots[r.match.shared : r.computed])
        self.running.remove(r)
        self._track(r, leaving=True)
        self._give_back(r)
        r.match, r.computed, r.target = None, 0, 0
        r.preemptions += 1
        r.due = self.step
        self.waiting.insert(0, r)
        self.stats.preemptions += 1
        return r

    def _plan_decode(self, p: StepPlan) -> Forward | None:
        """One token for every request past its prefill: O(batch) host work,
        vectorised but for one attribute read and one increment per request."""
        while True:
            reqs = [r for r in self.running if r.computed >= r.target and r.generated]
            if not reqs:
                return None
            n = len(reqs)
            rows = np.fromiter((r.row for r in reqs), np.int64, n)
            computed = np.fromiter((r.computed for r in reqs), np.int64, n)
            last = self.table.gather(rows, computed - 1)  # every request has KV
            a = self.cache.allocate_decode(computed + 1, last)
            self._back_up(p)
            if a is not None:
                break
            self._refused()
            self._preempt(p)
        rows_t = torch.from_numpy(rows)
        if int(computed.max()) + 1 > self.table.width:  # never: the table is as wide as the longest request
            self.table.write_allocation(rows_t, a)
        else:
            self.table.scatter(rows, computed, a.out_cache_loc.numpy())  # position ``computed``: one slot each
        for r in reqs:
            r.computed += 1
        for i in np.flatnonzero(computed % self.S == 0).tolist():  # a new page: the need changed
            self._track(reqs[i])
        ids = torch.from_numpy(np.fromiter((r.generated[-1] for r in reqs), np.int64, n))
        self.stats.served_tokens += n
        return Forward(reqs, rows_t, a, ids, [True] * n, n, self.table)

    def _plan_prefill(self, p: StepPlan) -> Forward | None:
        while True:
            pre = sorted([r for r in self.running if r.prefilling], key=lambda x: x.admitted)
            reqs, chunks, budget = [], [], self.chunk
            for r in pre:
                if budget == 0:
                    break
                c = min(r.target - r.computed, budget)
                reqs.append(r)
                chunks.append(c)
                budget -= c
            while reqs:
                a = self.cache.allocate_extend([r.computed for r in reqs], [r.computed + c for r, c in zip(reqs, chunks)],
                                               torch.tensor([r.last_loc for r in reqs]))
                self._back_up(p)
                if a is not None:
                    return self._prefill_batch(reqs, chunks, a)
                self._refused()
                reqs, chunks = reqs[: len(reqs) // 2], chunks[: len(chunks) // 2]
            # nothing fits: preempt the newest prefilling request, never the oldest one
            # (it finishes once the decoding requests free their pages) nor one of this step's decodes
            if self._preempt(p, among=pre[1:]) is None:
                return None

    def _prefill_batch(self, reqs: list[Request], chunks: list[int], a: Allocation) -> Forward:
        rows = torch.tensor([r.row for r in reqs])
        self.table.write_allocation(rows, a)
        ids = []
        for r, c in zip(reqs, chunks):
            if r.computed > r.match.length + r.host_hit:
                self.stats.chunk_continuations += 1
                self.stats.mid_page_continuations += r.computed % self.S != 0
            ids.append(torch.from_numpy(r.ids(r.computed, r.computed + c).astype(np.int64)))
            r.computed += c
            self._track(r)
        self.stats.served_tokens += sum(chunks)
        return Forward(reqs, rows, a, torch.cat(ids), [not r.prefilling for r in reqs], 0, self.table)

    # -- a request's pages and row -----------------------------------------------------------------
    def _release(self, m: PrefixMatch, own: torch.Tensor) -> None:
        """End ``m`` without caching: its request's slots past ``m.shared``
        (``own``) go back to the free lists."""
        self.cache.finish([m], None, own, [own.numel()], cache=False)

    def _give_back(self, r: Request) -> None:
        """``r`` holds KV no more: its page-table row goes back."""
        self.table.free_row(r.row, r.computed)
        r.row = -1

    def _track(self, r: Request, leaving: bool = False) -> None:
        """Keep ``_need_sum`` (pages per lane the running requests with pages
        still need) exact: ``r``'s share is recomputed after its page count
        changed, and dropped when it leaves the running set (or has no page
        yet: :meth:`_reserved` asks for those each step)."""
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
            self.cache.cache_pages([r.match for r in caching], *self._runs(caching, ends))
        for a in plan.arrivals:  # their KV is here now; a later preemption needs it computed again
            a.request.ready = False
            self.stats.arrived_tokens += a.slots.numel()
        if finished:
            self._finish(finished)
            gone = set(finished)
            self.running = [r for r in self.running if r not in gone]
        if self.host is not None:
            self.host.step_done()
        self.stats.record(self.step, lanes_used(self.cache.alloc, self.report_lanes, self._all_pages),
                          None if self.host is None else self.host.used_pages(), self.cache.evicted_nodes,
                          self.cache.evicted_pages)
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
        self.stats.record_finished(np.array([r.prefix_lanes for r in done]) + own)
        needs = [r.need for r in done if r.need is not None]
        if needs:  # _track(r, leaving=True) for all of them, in one sum
            self._need_sum -= np.sum(needs, axis=0)
        if self.hold_finished:  # the rows stay with the held KV until release_finished
            self.held.update((r.index, r) for r in done)
        else:
            self.cache.finish([r.match for r in done], *self._runs(done, computed))
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
        own = r.slots[m.shared : r.computed]  # what cache_pages has not cached yet: O(the tail)
        self.cache.finish([m], r.ids(m.shared, r.computed) if cache else None, own, [own.numel()], cache=cache)
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
        self._release(r.match, r.slots[r.match.shared : r.computed])
        self.running.remove(r)
        self._track(r, leaving=True)
        self._give_back(r)
        r.match, r.finished_at = None, self.step
        self._conclude([r])

    # -- the end of a trace --------------------------------------------------------------------------
    def check_drained(self) -> None:
        """After :meth:`drain`: raise ``AssertionError`` if any device or host
        page, or any prefix match, is still held (a leak)."""
        held = self.cache.alloc.num_pages - sum(self.cache.alloc.lane_free_pages())
        host = 0 if self.host is None else self.host.used_pages()
        matches = self.cache.open_matches + (0 if self.host is None else self.host.open_matches)
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
