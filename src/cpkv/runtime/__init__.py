"""The CP group at run time: processes, shared memory, one rank's forward.

* :mod:`~cpkv.runtime.group` - process lifetime: :func:`launch`, :class:`RankFailure`
* :mod:`~cpkv.runtime.shm` - shared-memory segment lifetime
* :mod:`~cpkv.runtime.runner` - one rank's forward on the shared cache: :class:`CPRunner`
* :mod:`~cpkv.runtime.scenario` - the fixed end-to-end scenario: :func:`run_scenario`
"""

from .group import RankContext, RankFailure, launch
from .runner import CPRunner
from .scenario import RunConfig, run_scenario
from .shm import shm_segments

__all__ = ["CPRunner", "RankContext", "RankFailure", "RunConfig", "launch", "run_scenario", "shm_segments"]
