"""The CP group at run time: processes, shared memory, collectives, one rank's forward.

* :mod:`~cpkv.runtime.group` - process lifetime: :func:`launch`, :class:`RankFailure`
* :mod:`~cpkv.runtime.sizing` - sizing a group before it starts: :func:`check_capacity`
* :mod:`~cpkv.runtime.shm` - shared-memory segment lifetime
* :mod:`~cpkv.runtime.reaper` - what removes a run's names and folders when its processes died first
* :mod:`~cpkv.runtime.comm` - the collectives a rank uses (process group or threads)
* :mod:`~cpkv.runtime.device` - the group on GPUs: :func:`~cpkv.runtime.device.plan_devices`, each rank's KV
  segment and the group's view (:func:`~cpkv.runtime.device.group_segments`), the pinned host tier
* :mod:`~cpkv.runtime.forward_plan` - a batch planned once per rank before its layers: :class:`ForwardPlan`
* :mod:`~cpkv.runtime.batch` - one rank's share of a batch under each split: :class:`ForwardBatch`
* :mod:`~cpkv.runtime.syncs` - counting host synchronisations: :class:`SyncCounter`
* :mod:`~cpkv.runtime.runner` - one rank's forward on the shared cache: :class:`CPRunner`

Importing this package imports nothing heavy (no torch): each name below is
imported from the module that defines it on first use, as ``cpkv`` does, so
the command's up-front checks read :mod:`~cpkv.runtime.sizing` (this machine's
memory and cores) before anything heavy is imported (:mod:`cpkv.tools.sizes`).
"""

from importlib import import_module as _import_module

#: Every public name, by the module (under ``cpkv``) that defines it.
_PUBLIC = {
    "DECODE_SPLITS": "runtime.batch",
    "PREFILL_SPLITS": "runtime.batch",
    "ForwardBatch": "runtime.batch",
    "ForwardPlan": "runtime.forward_plan",
    "Comm": "runtime.comm",
    "DistComm": "runtime.comm",
    "LocalComm": "runtime.comm",
    "run_threads": "runtime.comm",
    "RankContext": "runtime.group",
    "RankFailure": "runtime.group",
    "launch": "runtime.group",
    "CPRunner": "runtime.runner",
    "shm_segments": "runtime.shm",
    "GroupFootprint": "runtime.sizing",
    "GroupTooLarge": "runtime.sizing",
    "check_capacity": "runtime.sizing",
    "group_footprint": "runtime.sizing",
    "machine_capacity": "runtime.sizing",
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
