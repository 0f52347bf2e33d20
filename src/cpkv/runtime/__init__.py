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
"""

from .batch import DECODE_SPLITS, PREFILL_SPLITS, ForwardBatch
from .forward_plan import ForwardPlan
from .comm import Comm, DistComm, LocalComm, run_threads
from .group import RankContext, RankFailure, launch
from .runner import CPRunner
from .shm import shm_segments
from .sizing import GroupFootprint, GroupTooLarge, check_capacity, group_footprint, machine_capacity

__all__ = ["CPRunner", "Comm", "DECODE_SPLITS", "DistComm", "ForwardBatch", "ForwardPlan", "GroupFootprint",
           "GroupTooLarge", "LocalComm", "PREFILL_SPLITS", "RankContext", "RankFailure", "check_capacity", "group_footprint",
           "launch", "machine_capacity", "run_threads", "shm_segments"]
