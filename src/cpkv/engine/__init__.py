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

Importing this package imports nothing heavy (no torch): each name below is
imported from the module that defines it on first use, as ``cpkv`` does, so
the command's up-front checks read :mod:`~cpkv.engine.config`,
:mod:`~cpkv.engine.trace` and :mod:`~cpkv.engine.mooncake` before anything
heavy is imported (:mod:`cpkv.tools.sizes`).
"""

from importlib import import_module as _import_module

#: Every public name, by the module (under ``cpkv``) that defines it.
_PUBLIC = {
    "RankFailure": "runtime.group",
    "GroupTooLarge": "runtime.sizing",
    "DisaggConfig": "engine.config",
    "EngineConfig": "engine.config",
    "RunConfig": "engine.config",
    "DisaggFailure": "engine.disagg",
    "TransferAborted": "engine.disagg",
    "format_disagg": "engine.disagg",
    "run_disagg": "engine.disagg",
    "run_engine": "engine.engine",
    "run_engine_threads": "engine.engine",
    "Scheduler": "engine.scheduler",
    "StepPlan": "engine.scheduler",
    "RequestSpec": "engine.trace",
    "TraceError": "engine.trace",
    "load_jsonl": "engine.trace",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept
    here). Every other name is an ``AttributeError``."""
    if name in _PUBLIC:
        value = getattr(_import_module(f"cpkv.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
