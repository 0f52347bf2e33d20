"""The one scheduler of cpkv: the engine runs it on a CP group, the simulator without a model.

Every rank runs the same :class:`Scheduler` on the same trace and the same
sampled tokens, so every decision (admission, prefix matches, allocation,
eviction, preemption, host backups and loads) is identical on every rank with
no collective ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). A step is planned by
:meth:`Scheduler.plan` into a :class:`~cpkv.engine.step_plan.StepPlan` (what
to copy, back up, load and compute), carried out by an executor (the engine's
ranks, or nothing), and closed by :meth:`Scheduler.complete` with the sampled
tokens. This module admits and batches; a request's life from arrival to end
(follow-ups, completion, the disaggregation hooks) is
:class:`~cpkv.engine.requests.RequestLifecycle`. The scheduler asks the prefix
cache only (never the allocator behind it): one admission question
(:meth:`~cpkv.consumers.prefix_cache.PrefixCache.can_allocate`) and one verb
to take it (:meth:`~cpkv.consumers.prefix_cache.PrefixCache.allocate`).

Each step:

1. arrivals: a request is due at its arrival step, and a follow-up turn no
   earlier than ``delay`` steps after its parent finished (its prompt is the
   parent's prompt, the parent's generated tokens, then its own tokens);
2. admission, first come first served, while fewer than ``max_running`` run:
   the longest cached prefix is looked up without side effects, and the
   request is admitted only while every lane can hold what the running
   requests and it still need (free plus evictable pages, less a headroom);
   then the prefix is acquired (a mid-page match is copied into a private page
   before the first forward). A longer prefix in the host tier is loaded into
   new device pages, allocated as a continuation with owner lanes;
3. decode: one token for every request past its prefill. A refused decode
   allocation (even after lane-aware eviction) preempts the most recently
   admitted request: its pages are freed and it is requeued to recompute;
4. prefill: chunks of the requests still prefilling, first admitted first, up
   to ``chunk`` tokens in all; a chunk that ends mid-page is continued next
   step from that slot;
5. :meth:`complete`: greedy tokens are appended; a request that has its
   ``max_new_tokens`` is finished and its KV inserted into the prefix cache.

Evicted cache pages are backed up to the host tier before their device pages
can be reused (the executor runs backups first). Never a deadlock: a request
that could never fit the cache is refused before the trace starts, and a
refused allocation always either preempts or shrinks the batch.

Two hooks let two schedulers serve one trace from two CP groups
(prefill/decode disaggregation, :mod:`cpkv.engine.disagg`):

* ``remote_prefill`` (the decode side): a due request's KV is computed
  elsewhere. :meth:`Scheduler.awaiting_kv` lists the due requests whose KV is
  not ready; :meth:`Scheduler.arrive` says that it is (with the token sampled
  after it). Admission then matches the device prefix cache, allocates the
  rest as a continuation with owner lanes (as a host load is allocated) and
  lists it in :attr:`StepPlan.arrivals`; the executor fills those slots before
  the forwards and the request decodes from there;
* ``hold_finished`` (the prefill side): a finished request keeps its KV
  pages (not cached, not freed) until :meth:`Scheduler.release_finished`,
  so another group can read them; :meth:`Scheduler.submit` adds requests at
  run time.
"""

from __future__ import annotations

import numpy as np
import torch

from ..consumers.prefix_cache import Admission, PrefixCache
from ..contract.allocation import Allocation
from .records import Request, Stats
from .requests import RequestLifecycle
from .step_plan import Arrival, Backup, Copy, Forward, Load, StepPlan
from .trace import RequestSpec

__all__ = ["ADMISSION", "Batch", "Request", "Scheduler", "Stats", "StepPlan"]

ADMISSION = ("lanes", "none")
Batch = Forward  # the former name of one forward pass


class Scheduler(RequestLifecycle):
    """Continuous batching over a trace on one owner-lane cache (see the module doc).

    ``cache`` is the device prefix cache (over the allocator every rank
    replicates); ``host`` an optional :class:`~cpkv.consumers.hicache.HostTier`.
    ``report_lanes`` is the lane count used for occupancy figures (the
    allocator's own by default; the simulator's owner-oblivious baseline runs
    one lane and reports ``page % N``). ``remote_prefill`` and
    ``hold_finished`` are the disaggregation hooks of the module docstring
    (a remote-prefill scheduler keeps no host tier). The cache's eviction hook
    is set here and only here (backups to ``host``).
    """

    def __init__(self, specs: list[RequestSpec], cache: PrefixCache, *, chunk: int = 512, max_running: int = 64,
                 admission: str = "lanes", headroom: float = 0.0, host=None, report_lanes: int | None = None,
                 remote_prefill: bool = False, hold_finished: bool = False):
        if admission not in ADMISSION:
            raise ValueError(f"unknown admission {admission!r}; choose from {ADMISSION}")
        if chunk < 1 or max_running < 1:
            raise ValueError(f"chunk and max_running must be >= 1, got {chunk}, {max_running}")
        if remote_prefill and host is not None:
            raise ValueError("a remote-prefill scheduler keeps no host tier: its KV arrives from the prefill group")
        self.chunk, self.max_running, self.admission, self.headroom = chunk, max_running, admission, headroom
        super().__init__(specs, cache, max_running, remote_prefill, hold_finished, host, report_lanes)
        self._serial = 0
        self._need_sum = np.zeros(self.N, dtype=np.int64)  # what the running requests with pages still need
        cache.on_evict = self._on_evict if host is not None else None

    @property
    def alloc(self):
        """The allocator behind the cache, for callers not yet moved to the
        cache's own questions (``engine/disagg.py``); the scheduler never uses it."""
        return self.cache.alloc

    @property
    def layout(self):
        """The layout of the device cache."""
        return self.cache.layout

    # -- planning -------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Plan the next step: admissions, then the decode and prefill batches
        (allocating, evicting and preempting as needed)."""
        p = self._plan = StepPlan(self.step)
        self._admit(p)
        p.decode = self._plan_decode(p)
        p.prefill = self._plan_prefill(p)
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
        headroom = int(self.headroom * int(self.cache.lane_pages.min()))
        for r in due:
            if self.remote_prefill and not r.ready:
                continue  # its KV is still being computed elsewhere
            if len(self.running) >= self.max_running:
                break
            adm = self.cache.can_allocate(r.ids(), r.final_len, self.host, key=r.key)
            if reserved is not None and self.running and not adm.fits(reserved + headroom):
                break
            if not self._start(p, r, adm):
                break
            if reserved is not None:
                reserved = reserved + self.cache.chain_need(r.last_loc, r.computed, r.final_len)

    def _start(self, p: StepPlan, r: Request, adm: Admission) -> bool:
        """Take the admission (the prefix match), a page-table row, and plan
        the copy, the host load or the arrival."""
        seq = adm.tokens
        m = self.cache.allocate(adm)
        computed, loaded, rest = m.length, 0, None
        if self.remote_prefill:  # the rest of the KV arrives from the prefill group: allocate it as a continuation
            kv = len(seq) - 1  # the last token (sampled there) has no KV yet
            if m.length < kv:
                rest = self.cache.allocate_extend([m.length], [kv], torch.tensor([m.last_loc]))
                if rest is None:
                    self.cache.release(m)
                    return False
            computed = kv
        elif adm.host_len:  # pin the host copy first: the allocation below may evict and back up
            host_slots = self.host.take(seq, m.length, adm.host_len, key=r.key)
            rest = self.cache.allocate_extend([m.length], [adm.host_len], torch.tensor([m.last_loc]))
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
        r.prefix_lanes = self.cache.tree.pages_of(slots[: m.shared : self.S])[1]
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
        self.cache.release(r.match, r.slots[: r.computed])
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
        return Forward(reqs, rows_t, a, ids, [True] * n, True, self.table)

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
                if a is not None:
                    return self._prefill_batch(reqs, chunks, a)
                self._refused()
                reqs, chunks = reqs[: len(reqs) // 2], chunks[: len(chunks) // 2]
            # nothing fits: preempt the newest prefilling request, never the oldest one
            # (it finishes once the decoding requests free their pages) nor one of this step's decode batch
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
        return Forward(reqs, rows, a, torch.cat(ids), [not r.prefilling for r in reqs], False, self.table)

    # -- host tier ------------------------------------------------------------------------------
    def _on_evict(self, tokens: np.ndarray, slots: torch.Tensor, key=None) -> None:
        """A device node is evicted: back its whole pages up to the host tier first (same namespace ``key``)."""
        got = self.host.backup(tokens, slots, key=key)
        if got is not None and self._plan is not None:
            dev, host = got
            self._plan.backups.append(Backup(dev, host))
            self.stats.backup_pages += dev.numel() // self.S
