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
"""

from .config import DisaggConfig, EngineConfig, RunConfig
from .engine import run_engine, run_engine_threads
from .scheduler import Scheduler, StepPlan
from .trace import RequestSpec, TraceError, load_jsonl

__all__ = ["DisaggConfig", "EngineConfig", "RequestSpec", "RunConfig", "Scheduler", "StepPlan", "TraceError",
           "load_jsonl", "run_engine", "run_engine_threads"]
