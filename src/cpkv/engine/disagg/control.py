"""The control state of a disaggregated run: both schedulers and the hand-offs between them.

Every rank of both groups builds the same :class:`DisaggControl` over the same
trace and feeds it the same sampled tokens, so every decision, allocation and
transfer plan is identical everywhere with no planning collective
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ...consumers.hicache import HostTier
from ...consumers.transfer import TransferPlan, payload_nbytes, plan_transfer
from ..config import DisaggConfig
from ..rank import build_cache
from ..scheduler import Scheduler, StepPlan
from ..trace import RequestSpec


@dataclass
class DisaggStep:
    """One step of both groups: each scheduler's plan and the transfer (``None``: nothing moves)."""

    prefill: StepPlan
    decode: StepPlan
    transfer: TransferPlan | None
    index: int  # transfer number when ``transfer`` is set


class DisaggControl:
    """Both schedulers and the hand-offs between them: identical on every rank of both groups.

    ``families`` (the model's cache families) are needed only to count bytes.
    Raises ``TraceError`` for a trace whose requests could never fit either
    group's cache, ``ValueError`` for a configuration not sized yet.
    """

    def __init__(self, cfg: DisaggConfig, specs: list[RequestSpec], families=None):
        cfg.check_sized()
        M, N = cfg.prefill_size, cfg.decode_size
        common = dict(chunk=cfg.chunk, max_running=cfg.max_running, admission=cfg.admission,
                      wait_for_prefix=cfg.wait_for_prefix)
        host = HostTier(cfg.host_pages, cfg.page_size) if cfg.host_pages else None
        prefill_cache = lambda: build_cache(M, cfg.page_size, cfg.device_pages, cfg.eviction)  # noqa: E731
        self.decode = Scheduler(specs, build_cache(N, cfg.d_page, cfg.d_pages, cfg.eviction), remote_prefill=True,
                                **common)
        Scheduler(specs, prefill_cache(), **common)  # every request fits the prefill side
        self.prefill = Scheduler([], prefill_cache(), host=host, hold_finished=True, **common)
        self.max_len = self.decode.max_len
        self.inflight: dict[int, int] = {}  # decode request -> prefill request computing or holding its KV
        self.origin: dict[int, int] = {}  # prefill request -> decode request
        self._attempts: dict[int, int] = {}
        self.transfers = 0
        self.slot_bytes = payload_nbytes(families, 1) if families is not None else 0
        self.pair_slots = np.zeros((M, N), dtype=np.int64)
        self.pair_messages = np.zeros((M, N), dtype=np.int64)
        self.units: set[str] = set()
        self._digest = hashlib.sha256()

    @property
    def done(self) -> bool:
        """Whether every request of the trace has finished."""
        return self.decode.done

    @property
    def digest(self) -> str:
        """SHA-256 over every transfer plan so far (equal on every rank)."""
        return self._digest.copy().hexdigest()

    def plan(self) -> DisaggStep:
        """Submit the requests awaiting KV to the prefill side, plan both
        schedulers' steps and the transfer of the KV the decode side admits."""
        for r in self.decode.awaiting_kv():
            if r.index in self.inflight:
                continue
            k = self._attempts[r.index] = self._attempts.get(r.index, 0) + 1
            pr = self.prefill.submit(RequestSpec(f"{r.spec.id}#{k}", self.prefill.step, r.seq, 1))
            self.inflight[r.index], self.origin[pr.index] = pr.index, r.index
        pp, dp = self.prefill.plan(), self.decode.plan()
        tp = None
        if dp.arrivals:
            src = [self.prefill.held[self.inflight[a.request.index]].slots[a.start : a.start + a.slots.numel()]
                   for a in dp.arrivals]
            tp = plan_transfer(self.prefill.layout, self.decode.layout, src, [a.slots for a in dp.arrivals])
        return DisaggStep(pp, dp, tp, self.transfers)

    def complete(self, st: DisaggStep, prefill_tokens: list, decode_tokens: list) -> None:
        """Close the step on both schedulers; cache the transferred pages on the
        prefill side; hand the requests the prefill side finished to the decode side."""
        finished = self.prefill.complete(st.prefill, prefill_tokens)
        self.decode.complete(st.decode, decode_tokens)
        if st.transfer is not None:
            self.transfers += 1
            self.pair_slots += st.transfer.pair_slots.numpy()
            self.pair_messages += (st.transfer.pair_slots > 0).numpy()
            self.units.add(st.transfer.unit)
            self._digest.update(st.transfer.digest().encode())
            for a in st.decode.arrivals:
                self.prefill.release_finished(self.inflight.pop(a.request.index))
        for pr in finished:
            d = self.origin[pr.index]
            if self.decode.arrive(d, pr.generated[-1]):  # that token finished it: no KV needs to move
                self.prefill.release_finished(self.inflight.pop(d))

    def abort(self, st: DisaggStep, side: str) -> dict:
        """A transfer failed: free its pages on ``side`` (the prefill side's
        held requests; the decode side's receiving requests). Returns what was freed."""
        sched = self.prefill if side == "prefill" else self.decode
        alloc = sched.cache.alloc
        before = sum(alloc.lane_free_pages())
        reqs = [a.request for a in st.decode.arrivals]
        for r in reqs:
            if side == "prefill":
                self.prefill.release_finished(self.inflight.pop(r.index), cache=False)
            else:
                self.decode.cancel(r.index)
        after = sum(alloc.lane_free_pages())
        return {"requests": [r.spec.id for r in reqs], "freed_pages": int(after - before),
                "used_pages_after": int(alloc.num_pages - after)}


