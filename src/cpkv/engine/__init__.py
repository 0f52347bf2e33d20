"""The engine: one scheduler (also the simulator's) driving a CP group on real KV.

* :mod:`~cpkv.engine.trace` - serving traces: built-in seeded workloads and JSONL files
* :mod:`~cpkv.engine.scheduler` - :class:`Scheduler`: admission by lanes, chunked
  prefill, decode, prefix cache, eviction, preemption, host tier
* :mod:`~cpkv.engine.engine` - :func:`run_engine`: the scheduler on a CP group, checked
  against ``transformers``
* :mod:`~cpkv.engine.disagg` - :func:`~cpkv.engine.disagg.run_disagg`: a prefill group and a
  decode group of other sizes and page sizes, the same scheduler on both sides, KV moved
  point to point
"""

from .engine import EngineConfig, run_engine, run_engine_threads
from .scheduler import Scheduler, StepPlan
from .trace import RequestSpec, TraceError, load_jsonl

__all__ = ["EngineConfig", "RequestSpec", "Scheduler", "StepPlan", "TraceError", "load_jsonl", "run_engine",
           "run_engine_threads"]
