"""Sizing a CP group before it starts: what it takes from the machine and whether the machine has it.

:func:`group_footprint` describes a group (its ranks' private memory, its
shared segments); :func:`machine_capacity` reads what this machine can give
now (memory, cores, cgroup limits included); :func:`check_capacity` refuses,
before any process starts, a group (or several, e.g. a prefill and a decode
group) that this machine cannot hold or that would certainly not start within
its timeout. Nothing here starts or stops a process (that is
:mod:`cpkv.runtime.group`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

#: Private memory of one spawned rank with torch and transformers imported and a
#: tiny model built: 255 MB measured (anonymous pages, ``/proc/self/smaps_rollup``)
#: on this project's machine (torch 2.13 CPU); the margin covers gloo buffers.
RANK_BASELINE_BYTES = 300 * 2**20
#: CPU seconds one rank needs at least before its first collective (interpreter,
#: torch and transformers imports): 5.0 s measured for the imports alone; a whole
#: rank of ``cpkv run`` measured 7.4-8.5 s. A lower bound: refusals made with it
#: are certain.
RANK_START_CPU_S = 5.0
#: Most ranks per core. Measured on 2 cores: ``cpkv run`` at cp 4 / 8 / 16 spent
#: 0.4 / 1.1 / 4.3 s computing (every fence waits for each rank to be scheduled,
#: so the cost grows about with N^2) after 30 / 38 / 135 s starting; cp 64 ran
#: past its 300 s timeout with 17.5 GB in use. 16 per core (32 ranks on 2 cores,
#: about 150 s) is where the default timeout still holds.
MAX_RANKS_PER_CORE = 16
#: Share of the available memory a launch may plan to use; the rest is left to
#: the launcher, the page cache and whatever else runs.
MEMORY_RESERVE = 0.1


class GroupTooLarge(ValueError):
    """This machine cannot hold the group(s) asked for; the message says why."""


@dataclass(frozen=True)
class GroupFootprint:
    """What one CP group takes from the machine: ``world_size`` processes of
    ``per_rank_bytes`` private memory each, plus ``shared_bytes`` of shared
    segments counted once."""

    world_size: int
    per_rank_bytes: int
    shared_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Private memory of every rank plus the shared segments."""
        return self.world_size * self.per_rank_bytes + self.shared_bytes


def group_footprint(world_size: int, *, model_bytes: int = 0, private_bytes: int = 0, shared_bytes: int = 0,
                    baseline_bytes: int = RANK_BASELINE_BYTES) -> GroupFootprint:
    """The footprint of a group of ``world_size`` ranks, each holding its own
    copy of the model (``model_bytes``) and ``private_bytes`` of its own
    tensors on top of the process baseline; ``shared_bytes`` (the KV cache
    segments) are shared by the group. Raises ``ValueError`` on a world size
    below 1 or negative bytes."""
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    sizes = {"model_bytes": model_bytes, "private_bytes": private_bytes, "shared_bytes": shared_bytes,
             "baseline_bytes": baseline_bytes}
    bad = {k: v for k, v in sizes.items() if v < 0}
    if bad:
        raise ValueError(f"byte counts must be >= 0, got {bad}")
    return GroupFootprint(int(world_size), int(baseline_bytes + model_bytes + private_bytes), int(shared_bytes))


@dataclass(frozen=True)
class MachineCapacity:
    """Memory a launch may use now and the cores it may run on."""

    available_bytes: int
    cores: int


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_memory_left() -> int | None:
    """Bytes left under this process's cgroup memory limit, if it has one (v2, then v1)."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, use = _read(limit), _read(usage)
        if lim and use and lim.isdigit() and use.isdigit() and int(lim) < 2**60:
            return max(int(lim) - int(use), 0)
    return None


def _cgroup_cores() -> float | None:
    """Cores allowed by a cgroup v2 CPU quota (``cpu.max``), if one is set."""
    text = _read("/sys/fs/cgroup/cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not quota.isdigit() or not period.isdigit() or int(period) == 0:
        return None
    return int(quota) / int(period)


def machine_capacity() -> MachineCapacity:
    """This machine as a launch sees it: ``MemAvailable`` from ``/proc/meminfo``
    (capped by a cgroup memory limit) and the cores this process may run on
    (affinity, capped by a cgroup CPU quota)."""
    avail = None
    meminfo = _read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            avail = int(line.split()[1]) * 1024
    if avail is None:  # not Linux: total physical memory is the best we know
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            avail = 2**63
    left = _cgroup_memory_left()
    if left is not None:
        avail = min(avail, left)
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:
        cores = float(os.cpu_count() or 1)
    quota = _cgroup_cores()
    if quota is not None:
        cores = min(cores, quota)
    return MachineCapacity(int(avail), max(int(cores), 1))


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_capacity(*groups: GroupFootprint, timeout: float, capacity: MachineCapacity | None = None,
                   reserve: float = MEMORY_RESERVE, max_ranks_per_core: int = MAX_RANKS_PER_CORE,
                   rank_start_cpu_s: float = RANK_START_CPU_S) -> None:
    """Refuse, before any process starts, groups that run together on this machine
    but that it cannot hold; returns ``None`` when they fit.

    Raises :class:`GroupTooLarge` naming the first rule broken:

    * memory: every group's :attr:`GroupFootprint.total_bytes` together must fit
      in ``(1 - reserve)`` of ``capacity.available_bytes``;
    * cores: at most ``max_ranks_per_core`` ranks per core (see
      :data:`MAX_RANKS_PER_CORE` for the measurements behind 16);
    * time: starting every rank takes at least ``rank_start_cpu_s`` CPU seconds
      each, spread over the cores; that alone must fit in ``timeout``.

    ``capacity`` defaults to :func:`machine_capacity` now.
    """
    if not groups:
        raise ValueError("check_capacity needs at least one GroupFootprint")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    cap = capacity or machine_capacity()
    ranks = sum(g.world_size for g in groups)
    what = (f"{ranks} ranks" if len(groups) == 1
            else f"{len(groups)} groups of {' + '.join(str(g.world_size) for g in groups)} = {ranks} ranks")
    need = sum(g.total_bytes for g in groups)
    usable = int(cap.available_bytes * (1 - reserve))
    if need > usable:
        per = ", ".join(f"{g.world_size} x {_gib(g.per_rank_bytes)} + {_gib(g.shared_bytes)} shared" for g in groups)
        raise GroupTooLarge(
            f"{what} need about {_gib(need)} of memory ({per}), more than this machine can give: "
            f"{_gib(cap.available_bytes)} available, {int(reserve * 100)}% of it kept free")
    if ranks > max_ranks_per_core * cap.cores:
        raise GroupTooLarge(
            f"{what} on {cap.cores} core{'s' if cap.cores > 1 else ''}: more than {max_ranks_per_core} per core; every "
            f"fence waits for each rank to be scheduled and such a group runs past any practical timeout "
            f"(at most {max_ranks_per_core * cap.cores} ranks here)")
    start = ranks * rank_start_cpu_s / cap.cores
    if start > timeout:
        raise GroupTooLarge(
            f"{what} need at least {start:.0f} s to start on {cap.cores} core{'s' if cap.cores > 1 else ''} "
            f"({rank_start_cpu_s:g} CPU seconds each), more than the timeout of {timeout:g} s")


def pages_for_memory(kv_bytes: int, page_bytes: int, *, replicated: bool = False, cp_size: int = 1) -> int:
    """Device KV pages one rank's ``kv_bytes`` hold, ``page_bytes`` a page of
    every cache family together: ``kv_bytes // page_bytes``, the same for the
    shared cache (the rank's lane) and for a ``replicated`` one (the rank's
    full copy), so both modes compare at equal memory; the group holds
    :func:`group_pages` of them. Raises ``ValueError`` for sizes below 1, a
    ``cp_size`` below 1 or a budget that holds no page."""
    for name, v in (("kv_bytes", kv_bytes), ("page_bytes", page_bytes), ("cp_size", cp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    pages = kv_bytes // page_bytes
    if pages < 1:
        raise ValueError(f"kv_bytes {kv_bytes} per rank hold no page of {page_bytes} bytes")
    return pages


def group_pages(pages_per_rank: int, *, replicated: bool = False, cp_size: int = 1) -> int:
    """Distinct pages a CP group of ``cp_size`` ranks holds with ``pages_per_rank``
    pages of memory each (page 0, reserved, included): ``cp_size`` times them
    when shared (each page on its owner only), once when ``replicated`` (every
    page on every rank)."""
    return pages_per_rank * (1 if replicated else cp_size)
