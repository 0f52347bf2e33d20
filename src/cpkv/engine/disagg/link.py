"""One rank's end of the KV transfers: post or receive, count, report an abort."""

from __future__ import annotations

import json
import os
import time

from ...consumers.kv_pool import SharedKVPool
from ...consumers.transfer import receive_transfer, send_transfer
from ..config import DisaggConfig
from ..scheduler import StepPlan
from .control import DisaggControl, DisaggStep


class TransferAborted(RuntimeError):
    """A transfer could not complete on this rank (a peer went away or timed
    out); the transfer's pages on this rank's side were freed first."""


class TransferLink:
    """One rank's end of the transfers: posts or receives, counts bytes and
    time."""

    def __init__(self, cfg: DisaggConfig, world_rank: int, side: str, pool: SharedKVPool, transport):
        self.cfg, self.rank, self.side, self.pool, self.transport = cfg, world_rank, side, pool, transport
        self.M = cfg.prefill_size
        self.bytes: dict[int, int] = {}  # peer (group rank of the other side) -> KV bytes
        self.messages = 0
        self.seconds = 0.0
        self.step: DisaggStep | None = None

    def send(self):
        """Prefill rank: post this step's messages (``None`` when nothing moves)."""
        tp = self.step.transfer
        if tp is None:
            return None
        t0 = time.perf_counter()
        pending, sent = send_transfer(tp, self.pool, self.transport, lambda b: self.M + b)
        self._account(sent, t0)
        return pending

    def wait(self, pending) -> None:
        """Prefill rank: wait for this step's sends."""
        if pending is not None:
            t0 = time.perf_counter()
            pending.wait()
            self.seconds += time.perf_counter() - t0

    def receive(self, plan: StepPlan) -> None:
        """Decode rank (the executor's hook): receive and write this step's messages."""
        tp = self.step.transfer
        if tp is None or plan is not self.step.decode:
            raise AssertionError("the executor's arrivals are not this step's transfer")
        t0 = time.perf_counter()
        self._account(receive_transfer(tp, self.pool, self.transport, lambda a: a), t0)

    def _account(self, moved: dict, t0: float) -> None:
        for peer, n in moved.items():
            self.bytes[peer] = self.bytes.get(peer, 0) + n
        self.messages += len(moved)
        self.seconds += time.perf_counter() - t0

    def abort(self, ctl: DisaggControl, error: BaseException, report_dir: str | None) -> TransferAborted:
        """Free this side's pages of the failed transfer, write the abort report, return the error to raise."""
        st = self.step
        freed = ctl.abort(st, self.side)
        report = {"side": self.side, "world_rank": self.rank, "group_rank": self.pool.rank, "transfer": st.index,
                  "step": st.decode.step, "error": f"{type(error).__name__}: {error}"[:400], "time": time.time(),
                  **freed}
        if report_dir:
            path = os.path.join(report_dir, f"abort-{self.rank}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)
        other = "decode" if self.side == "prefill" else "prefill"
        return TransferAborted(f"{self.side} rank {self.rank}: transfer {st.index} (step {st.decode.step}) with the "
                               f"{other} group failed ({report['error']}); freed {freed['freed_pages']} pages of "
                               f"requests {freed['requests']}")


