"""The engine: one scheduler (also the simulator's) driving a CP group on real KV.

* :mod:`~cpkv.engine.trace` - serving traces: built-in seeded workloads and JSONL files
* :mod:`~cpkv.engine.config` - the run configuration the engine, the disaggregation driver
  and ``cpkv run`` share: :class:`RunConfig`, :class:`EngineConfig`, :class:`DisaggConfig`
* :mod:`~cpkv.engine.scheduler` - :class:`Scheduler`: admission by lanes, chunked
  prefill, decode, prefix cache, eviction, preemption, host tier
* :mod:`~cpkv.engine.rank` - one rank's parts (cache, pool, host pool, runner), built
  alike by the engine and the disaggregation driver
* :mod:`~cpkv.engine.engine` - :func:`run_engine`: the scheduler on a CP group, checked
  against ``transformers``
* :mod:`~cpkv.engine.disagg` - :func:`~cpkv.engine.disagg.run_disagg`: a prefill group and a
  decode group of other sizes and page sizes, the same scheduler on both sides, KV moved
  point to point

The errors a run raises: :class:`TraceError` (a trace file), :class:`GroupTooLarge`
(a group this machine cannot hold, before it starts), :class:`RankFailure` (a rank
failed), :class:`DisaggFailure` and :class:`TransferAborted` (a disaggregated run).
"""

from ..runtime.group import RankFailure
from ..runtime.sizing import GroupTooLarge
from .config import DisaggConfig, EngineConfig, RunConfig
from .disagg import DisaggFailure, TransferAborted, format_disagg, run_disagg
from .engine import run_engine, run_engine_threads
from .scheduler import Scheduler, StepPlan
from .trace import RequestSpec, TraceError, load_jsonl

__all__ = ["DisaggConfig", "DisaggFailure", "EngineConfig", "GroupTooLarge", "RankFailure", "RequestSpec",
           "RunConfig", "Scheduler", "StepPlan", "TraceError", "TransferAborted", "format_disagg", "load_jsonl",
           "run_disagg", "run_engine", "run_engine_threads"]
