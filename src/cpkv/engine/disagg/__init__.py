"""Prefill/decode disaggregation: a prefill CP group and a decode CP group serve one trace.

One ``torch.distributed`` world holds both groups: ranks ``0 .. M-1`` prefill,
ranks ``M .. M+N-1`` decode. Each group has its own subgroup (the fences and
all-gathers of its forward), its own shared segments, its own allocator
replicas and owner lanes, and its own page size. The KV of a prefilled request
moves from the prefill owners to the decode owners point to point
(:mod:`cpkv.consumers.transfer`), which also works where the two groups share no
memory ([[RFC-0001:C-DISAGG]]).

Control state: every rank of both groups runs BOTH schedulers (the engine's
one :class:`~cpkv.engine.scheduler.Scheduler`) on the same trace and the same
sampled tokens, so every decision, every allocation and every transfer plan
is identical everywhere with no planning collective
([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]):

* the decode scheduler holds the trace (arrivals, follow-up turns, lengths)
  with ``remote_prefill``: a due request waits for its KV;
* each such request is submitted to the prefill scheduler (``hold_finished``)
  with its whole sequence so far as the prompt and one token to generate, so
  the prefill group runs it to its first token. The prefill side's prefix
  cache is on: shared prompts and earlier turns are matched, not recomputed;
* the finished prefill request keeps its pages; the decode scheduler gets the
  token (``arrive``) and, when it admits the request, matches its own prefix
  cache (on as well: a follow-up's earlier turns are still there and do not
  move) and allocates the rest with its own owner lanes, like a host load;
* the transfer plan pairs the held source slots with those destination slots
  (:func:`~cpkv.consumers.transfer.plan_transfer`) on every rank.

A step: both schedulers plan; prefill ranks post their messages, run their
forward and wait for the sends; decode ranks receive and write their own
segments inside their executor (after copies, before the fence) and run their
forward; one all-gather of the sampled tokens over the world (data, not
planning) closes the step on both schedulers and confirms the transfer, after
which the prefill side caches the transferred pages.

If anything fails between posting a transfer and that all-gather (a peer group
died mid-transfer), every surviving rank frees the transfer's pages on its side
(prefill: the held requests; decode: the requests that were to receive), writes
an abort report into the run's report folder and raises
:class:`TransferAborted`; :func:`run_disagg` raises :class:`DisaggFailure` with
those reports.


The package, one job a module: :mod:`.control` (both schedulers and the
hand-offs, identical on every rank), :mod:`.link` (one rank's end of the
transfers and its abort report), :mod:`.driver` (one rank's
loop and the two launchers), :mod:`.figures` (the run's report and its table).
The configuration is :class:`~cpkv.engine.config.DisaggConfig`, a
:class:`~cpkv.engine.config.RunConfig` shared with the engine and ``cpkv run``.
"""

from ..config import DisaggConfig, parse_disagg
from .control import DisaggControl, DisaggStep
from .driver import DisaggFailure, disagg_rank, run_disagg, run_disagg_sweep, run_disagg_threads
from .figures import disagg_report, format_disagg
from .link import TransferAborted, TransferLink

__all__ = ["DisaggConfig", "DisaggControl", "DisaggFailure", "DisaggStep", "TransferAborted", "TransferLink",
           "disagg_rank", "disagg_report", "format_disagg", "parse_disagg", "run_disagg", "run_disagg_sweep",
           "run_disagg_threads"]
