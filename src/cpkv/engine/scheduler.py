"""The one scheduler of cpkv: the engine runs it on a CP group, the simulator without a model.

Every rank runs the same :class:`Scheduler` on the same trace and the same
sampled tokens, so every decision (admission, prefix matches, allocation,
eviction, preemption, host backups and loads) is identical on every rank with
no collective ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). A step is planned by
:meth:`Scheduler.plan` into a :class:`StepPlan` (what to copy, back up, load
and compute), carried out by an executor (the engine's ranks, or nothing), and
closed by :meth:`Scheduler.complete` with the sampled tokens.

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

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from ..consumers.prefix_cache import PrefixCache, PrefixHit, PrefixMatch
from ..contract.allocator import ExtendAllocation, OwnerLaneAllocator
from ..contract.layout import lane_base_from_prefix, lane_of_position, owner_of, page_of
from .trace import CacheTooSmall, RequestSpec, TraceError, validate

ADMISSION = ("lanes", "none")


@dataclass(eq=False)
class Request:
    """A request in the scheduler: its tokens, its KV slots and where it stands."""

    spec: RequestSpec
    index: int
    prompt: tuple = ()
    generated: list = field(default_factory=list)
    due: int | None = None  # step it may start; None while its parent runs
    admitted: int = -1  # admission serial; preemption takes the largest
    row: int = -1  # page-table row while running
    match: PrefixMatch | None = None
    slots: torch.Tensor | None = None  # KV slot of every position 0 .. computed - 1
    computed: int = 0
    target: int = 0  # prefill until computed == target
    preemptions: int = 0
    finished_at: int = -1
    host_hit: int = 0  # tokens loaded from the host tier at the last admission
    ready: bool = False  # remote prefill: its KV waits elsewhere, ready to arrive (Scheduler.arrive)

    @property
    def seq(self) -> tuple:
        """Every token known: the prompt, then the generated tokens."""
        return self.prompt + tuple(self.generated)

    @property
    def final_len(self) -> int:
        """Tokens with KV when the request finishes (the last generated token has none)."""
        return len(self.prompt) + self.spec.max_new_tokens - 1

    @property
    def last_loc(self) -> int:
        """Slot of the last position with KV, -1 for none."""
        return int(self.slots[self.computed - 1]) if self.computed else -1

    @property
    def prefilling(self) -> bool:
        """Whether the request still has prompt (or recomputed) tokens to prefill."""
        return self.computed < self.target


@dataclass
class Batch:
    """One forward: ``requests`` in batch order, their page-table ``rows``, the
    allocation of their new slots, the new token ids (flattened, in
    ``alloc.out_cache_loc`` order) and whether each request's last token gives
    a new token (a prefill chunk that ends before the prompt does not)."""

    requests: list
    rows: torch.Tensor
    alloc: ExtendAllocation
    ids: torch.Tensor
    sample: list
    decode: bool


@dataclass
class StepPlan:
    """What the executor does in one step, in this order: ``backups`` (device
    slots -> host slots, by the IO rank), ``loads`` (host slots -> device
    slots, by each owner), ``copies`` (device -> device, by the destination's
    owner), ``arrivals`` (remote prefill: ``(request, start, slots)``, the KV
    of positions ``start ..`` arriving from another group into the new
    ``slots``, written by each owner), ``assign`` (page-table rows of admitted
    requests: row, slots of their cached prefix), then the ``decode`` and
    ``prefill`` batches."""

    step: int
    backups: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    arrivals: list = field(default_factory=list)
    assign: list = field(default_factory=list)
    decode: Batch | None = None
    prefill: Batch | None = None

    def batches(self) -> list[Batch]:
        """The forwards of the step, decode first."""
        return [b for b in (self.decode, self.prefill) if b is not None]

    def _drop(self, r: Request) -> None:
        """Forget what was planned for a request preempted in the step it was admitted."""
        self.assign = [a for a in self.assign if a[0] != r.row]
        self.copies = [c for c in self.copies if c[2] is not r]
        self.loads = [x for x in self.loads if x[2] is not r]
        self.arrivals = [x for x in self.arrivals if x[0] is not r]


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
    evicted_nodes: int = 0  # device prefix-cache evictions under memory pressure
    evicted_pages: int = 0
    served_tokens: int = 0  # cached prefixes matched, tokens prefilled and decoded
    tokens_before_refusal: int | None = None
    max_request_skew: int = 0
    occupancy: list = field(default_factory=list)  # per step: used device pages per lane
    host_occupancy: list = field(default_factory=list)  # per step: used host pages

    def lane_gap(self, lane_pages: int) -> float:
        """Largest gap between the fullest and the emptiest lane over the run, in % of a lane."""
        occ = np.array(self.occupancy) if self.occupancy else np.zeros((1, 1))
        return 100.0 * float((occ.max(1) - occ.min(1)).max()) / max(lane_pages, 1)


def remaining_need(alloc: OwnerLaneAllocator, last_loc: int, length: int, end: int) -> np.ndarray:
    """Pages per lane a request still needs to grow from ``length`` to ``end``
    tokens. With a prefix its lanes are fixed by ``last_loc``
    ([[RFC-0001:C-REQUEST-RELATIVE]]); without one the allocator will pick the
    lane with the most free pages, assumed here."""
    S, N = alloc.page_size, alloc.cp_size
    first, stop = -(-length // S), -(-end // S)
    if stop <= first:
        return np.zeros(N, dtype=np.int64)
    if length:
        base = lane_base_from_prefix(owner_of(page_of(last_loc, S), N), length, S, N)
    else:
        base = alloc.lane_for_new_chain(0)
    return np.bincount(lane_of_position(base, np.arange(first, stop), N), minlength=N)


class Scheduler:
    """Continuous batching over a trace on one owner-lane cache (see the module doc).

    ``cache`` is the device prefix cache (over the allocator every rank
    replicates); ``host`` an optional :class:`~cpkv.consumers.hicache.HostTier`.
    ``report_lanes`` is the lane count used for occupancy figures (the
    allocator's own by default; the simulator's owner-oblivious baseline runs
    one lane and reports ``page % N``). ``remote_prefill`` and
    ``hold_finished`` are the disaggregation hooks of the module docstring
    (a remote-prefill scheduler keeps no host tier).
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
        self.remote_prefill, self.hold_finished = remote_prefill, hold_finished
        self.held: dict[int, Request] = {}  # hold_finished: finished requests whose KV pages are kept
        validate(specs)
        self.cache, self.alloc, self.host = cache, cache.alloc, host
        self.S, self.N = self.alloc.page_size, self.alloc.cp_size
        self.chunk, self.max_running, self.admission, self.headroom = chunk, max_running, admission, headroom
        self.report_lanes = report_lanes or self.N
        self.requests = [Request(s, i) for i, s in enumerate(specs)]
        self._by_id = {r.spec.id: r for r in self.requests}
        self._children: dict[str, list[Request]] = {}
        for r in self.requests:
            if r.spec.after is None:
                r.prompt, r.due = r.spec.tokens, r.spec.arrival
            else:
                self._children.setdefault(r.spec.after, []).append(r)
        self._check_capacity()
        self.waiting: list[Request] = sorted((r for r in self.requests if r.due is not None),
                                             key=lambda x: (x.due, x.index))
        self.running: list[Request] = []
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.step = 0
        self.stats = Stats()
        self._serial = 0
        self._plan: StepPlan | None = None
        self._all_pages = np.arange(self.alloc.num_pages + 1)
        cache.on_evict = self._on_evict if host is not None else None

    # -- set-up ----------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        """Refuse, before anything runs, the requests that could never fit the
        cache: every one of them in one :class:`CacheTooSmall`."""
        lengths, too_large = {}, []
        self.max_len = 0  # the most KV tokens any request will hold
        for r in self.requests:  # a follow-up's prompt: parent prompt + parent replies + own tokens
            s = r.spec
            base = 0 if s.after is None else lengths[s.after] + self._by_id[s.after].spec.max_new_tokens
            lengths[s.id] = base + len(s.tokens)
            try:
                self._check_fits(s.id, lengths[s.id] + s.max_new_tokens - 1)
            except CacheTooSmall as e:
                too_large += e.requests
        if too_large:
            raise CacheTooSmall(too_large, self.alloc.lane_pages, self.S)

    def _check_fits(self, rid: str, kv_tokens: int) -> None:
        per_lane = -(-(-(-kv_tokens // self.S)) // self.N)  # its pages may start on any lane
        if per_lane > int(self.alloc.lane_pages.min()):
            raise CacheTooSmall([(rid, kv_tokens)], self.alloc.lane_pages, self.S)
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

    # -- planning -------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Plan the next step: admissions, then the decode and prefill batches
        (allocating, evicting and preempting as needed)."""
        p = self._plan = StepPlan(self.step)
        self._admit(p)
        p.decode = self._plan_decode(p)
        p.prefill = self._plan_prefill(p)
        return p

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

    def _due(self) -> list[Request]:
        return [r for r in self.waiting if r.due <= self.step]

    def _reserved(self) -> np.ndarray:
        need = np.zeros(self.N, dtype=np.int64)
        for r in self.running:
            need += remaining_need(self.alloc, r.last_loc, r.computed, r.final_len)
        return need

    def _admit(self, p: StepPlan) -> None:
        reserved = self._reserved() if self.admission == "lanes" else None
        for r in self._due():
            if self.remote_prefill and not r.ready:
                continue  # its KV is still being computed elsewhere
            if len(self.running) >= self.max_running:
                break
            seq = r.seq
            hit = self.cache.lookup(seq)
            host_len = self.host.lookup(seq, hit) if self.host is not None else 0
            if host_len:  # the host tier holds more: share the device's whole pages, load the rest
                hit = dataclasses.replace(hit, length=hit.shared, copy=0, copy_lane=-1)
            if reserved is not None and self.running:
                need = self.cache.lane_need(hit, r.final_len)
                spare = (np.asarray(self.alloc.lane_free_pages()) + self.cache.evictable_pages() - hit.newly_pinned
                         - int(self.headroom * int(self.alloc.lane_pages.min())) - reserved)
                if (need > spare).any():
                    break
            if not self._start(p, r, seq, hit, host_len):
                break
            if reserved is not None:
                reserved = reserved + remaining_need(self.alloc, r.last_loc, r.computed, r.final_len)

    def _start(self, p: StepPlan, r: Request, seq: tuple, hit: PrefixHit, host_len: int) -> bool:
        """Acquire the prefix, take a row, plan the copy or the host load."""
        m = self.cache.acquire(seq, max_length=hit.shared if host_len else None)
        slots = torch.full((r.final_len,), -1, dtype=torch.int64)
        slots[: m.length] = m.slots
        computed = m.length
        loaded = 0
        if self.remote_prefill:  # the rest of the KV arrives from the prefill group: allocate it as a continuation
            kv = len(seq) - 1  # the last token (sampled there) has no KV yet
            if m.length < kv:
                a = self.cache.allocate_extend([m.length], [kv], torch.tensor([m.last_loc]))
                if a is None:
                    self.cache.release(m)
                    return False
                slots[m.length : kv] = a.out_cache_loc
                p.arrivals.append((r, m.length, a.out_cache_loc))
            computed = kv
        elif host_len:  # pin the host copy first: the allocation below may evict and back up
            host_slots = self.host.take(seq, m.length, host_len)
            a = self.cache.allocate_extend([m.length], [host_len], torch.tensor([m.last_loc]))
            if a is not None:
                slots[m.length : host_len] = a.out_cache_loc
                p.loads.append((host_slots, a.out_cache_loc, r))
                computed, loaded = host_len, host_len - m.length
        r.match, r.slots, r.computed = m, slots, computed
        r.target = computed if self.remote_prefill else len(seq)
        r.row = self.free_rows.pop()
        r.admitted = self._serial = self._serial + 1
        r.host_hit = loaded
        self.waiting.remove(r)
        self.running.append(r)
        p.assign.append((r.row, slots[:computed].clone()))
        if m.copy_dst.numel():
            p.copies.append((m.copy_src, m.copy_dst, r))
            self.stats.copies += 1
            self.stats.copied_slots += m.copy_dst.numel()
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
        p._drop(r)
        self.cache.release(r.match, r.slots[: r.computed])
        self.running.remove(r)
        self.free_rows.append(r.row)
        r.match, r.slots, r.computed, r.target, r.row = None, None, 0, 0, -1
        r.preemptions += 1
        r.due = self.step
        self.waiting.insert(0, r)
        self.stats.preemptions += 1
        return r

    def _plan_decode(self, p: StepPlan) -> Batch | None:
        while True:
            reqs = [r for r in self.running if not r.prefilling and r.generated]
            if not reqs:
                return None
            seq_lens = torch.tensor([r.computed + 1 for r in reqs])
            last = torch.tensor([r.last_loc for r in reqs])
            a = self.cache.allocate_decode(seq_lens, last)
            if a is not None:
                break
            self._refused()
            self._preempt(p)
        for r, s in zip(reqs, a.out_cache_loc.tolist()):
            r.slots[r.computed] = s
            r.computed += 1
        ids = torch.tensor([r.generated[-1] for r in reqs], dtype=torch.int64)
        self.stats.served_tokens += len(reqs)
        return Batch(reqs, torch.tensor([r.row for r in reqs]), a, ids, [True] * len(reqs), True)

    def _plan_prefill(self, p: StepPlan) -> Batch | None:
        while True:
            pre = sorted((r for r in self.running if r.prefilling), key=lambda x: x.admitted)
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

    def _prefill_batch(self, reqs, chunks, a: ExtendAllocation) -> Batch:
        ids = []
        for i, (r, c) in enumerate(zip(reqs, chunks)):
            if r.computed > r.match.length + r.host_hit:
                self.stats.chunk_continuations += 1
                self.stats.mid_page_continuations += r.computed % self.S != 0
            s, n = int(a.extend_start_loc[i]), int(a.extend_lens[i])
            r.slots[r.computed : r.computed + n] = a.out_cache_loc[s : s + n]
            ids.append(torch.tensor(r.seq[r.computed : r.computed + n], dtype=torch.int64))
            r.computed += n
        self.stats.served_tokens += sum(chunks)
        return Batch(reqs, torch.tensor([r.row for r in reqs]), a, torch.cat(ids),
                     [not r.prefilling for r in reqs], False)

    # -- host tier ------------------------------------------------------------------------------
    def _on_evict(self, tokens: tuple, slots: torch.Tensor) -> None:
        """A device node is evicted: back its whole pages up to the host tier first."""
        got = self.host.backup(tokens, slots)
        if got is not None and self._plan is not None:
            dev, host = got
            self._plan.backups.append((dev, host))
            self.stats.backup_pages += dev.numel() // self.S

    # -- completion -------------------------------------------------------------------------------
    def complete(self, plan: StepPlan, tokens: list[list[int]]) -> list[Request]:
        """Close a step: ``tokens[i]`` are the greedy tokens of the requests of
        ``plan.batches()[i]`` (entries where ``sample`` is False are ignored).
        Finishes requests at ``max_new_tokens``; returns them."""
        finished = []
        for b, toks in zip(plan.batches(), tokens):
            for r, t, s in zip(b.requests, toks, b.sample):
                if s:
                    r.generated.append(int(t))
                    self.stats.generated_tokens += 1
                    if len(r.generated) == r.spec.max_new_tokens:
                        finished.append(r)
            self.stats.computed_tokens += b.alloc.out_cache_loc.numel()
        for r, _, slots in plan.arrivals:  # their KV is here now; a later preemption needs it computed again
            r.ready = False
            self.stats.arrived_tokens += slots.numel()
        for r in finished:
            self._finish(r)
        if self.host is not None:
            self.host.step_done()
        self._record()
        self.step += 1
        self._plan = None
        return finished

    def _finish(self, r: Request) -> None:
        kv = r.slots[: r.computed]
        pages = np.unique(page_of(kv.numpy(), self.S))
        per_lane = np.bincount(owner_of(pages, self.N), minlength=self.N)
        self.stats.max_request_skew = max(self.stats.max_request_skew, int(per_lane.max() - per_lane.min()))
        if self.hold_finished:
            self.held[r.index] = r
        else:
            self.cache.insert(r.seq[: r.computed], kv, r.match)
            r.match = None
        self.running.remove(r)
        self.free_rows.append(r.row)
        r.finished_at, r.row = self.step, -1
        self._conclude(r)

    def _conclude(self, r: Request) -> None:
        """A request is done: count it and release its follow-ups."""
        self.stats.finished += 1
        for c in self._children.get(r.spec.id, ()):
            c.prompt = r.seq + c.spec.tokens
            c.due = max(c.spec.arrival, self.step + 1 + c.spec.delay)
            self.waiting.append(c)
        self.waiting.sort(key=lambda x: (x.due, x.index))

    def _record(self) -> None:
        self.stats.evicted_nodes, self.stats.evicted_pages = self.cache.evicted_nodes, self.cache.evicted_pages
        used = np.flatnonzero(self.alloc.is_allocated(self._all_pages))
        self.stats.occupancy.append(np.bincount(owner_of(used, self.report_lanes), minlength=self.report_lanes).tolist())
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
        r.generated.append(int(token))
        self.stats.generated_tokens += 1
        if len(r.generated) == r.spec.max_new_tokens:
            self.waiting.remove(r)
            r.finished_at = self.step
            self._conclude(r)
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
        kv = r.slots[: r.computed]
        if cache:
            self.cache.insert(r.seq[: r.computed], kv, r.match)
        else:
            self.cache.release(r.match, kv)
        r.match = None

    def cancel(self, index: int) -> None:
        """Drop a running request without caching its KV (a client abort, or
        KV that never arrived): its private pages go back to the free lists,
        its row is freed, and it counts as finished with what it generated.
        Raises ``ValueError`` for a request that is not running."""
        r = self.requests[index] if 0 <= index < len(self.requests) else None
        if r is None or r not in self.running:
            raise ValueError(f"request {index} is not running")
        if self._plan is not None:
            self._plan._drop(r)
        self.cache.release(r.match, r.slots[: r.computed])
        self.running.remove(r)
        self.free_rows.append(r.row)
        r.match, r.row, r.finished_at = None, -1, self.step
        self._conclude(r)

    def check_drained(self) -> None:
        """After :meth:`drain`: raise ``AssertionError`` if any device or host
        page, or any prefix match, is still held (a leak)."""
        held = self.alloc.num_pages - sum(self.alloc.lane_free_pages())
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
        hook, self.cache.on_evict = self.cache.on_evict, None
        self.cache.clear()
        self.cache.on_evict = hook
        if self.host is not None:
            self.host.clear()
