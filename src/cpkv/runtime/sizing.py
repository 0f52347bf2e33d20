"""Sizing a CP group before it starts: what it takes from the machine and whether the machine has it.

:func:`group_footprint` describes a group (its ranks' private memory, its
shared segments); :func:`machine_capacity` reads what this machine can give
now (memory, cores, cgroup limits included); :func:`check_capacity` refuses,
before any process starts, a group (or several, e.g. a prefill and a decode
group) that this machine cannot hold or that would certainly not start within
its timeout. The device KV cache is sized from memory here too:
:func:`parse_size` reads a ``--kv-memory`` value, :func:`default_kv_memory`
is the budget per rank when none is given (as SGLang's
``--mem-fraction-static`` and vLLM's ``--gpu-memory-utilization`` derive theirs
from the device's memory), and :func:`pages_for_memory` is the one conversion
from bytes to pages. Nothing here starts or stops a process (that is
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
#: Share of the memory left after the ranks' baselines that the default device
#: KV cache takes, all ranks together (the rest stays for models, activations,
#: the host tier, the reference check and whatever else runs).
KV_MEMORY_FRACTION = 0.25
#: Most bytes per rank the default device KV cache takes: 64 MiB holds 8192
#: pages of 16 tokens of the built-in Llama (512 bytes a token), 131072 tokens
#: per rank, and starts in well under a second (zeroing the segments); above
#: it a run asks with ``--kv-memory``.
KV_MEMORY_CAP = 64 * 2**20


#: Seconds one rank of ``cpkv run`` takes to start (interpreter, imports, model,
#: first collective): 7.4-8.5 s measured on this project's machine.
RANK_START_S = 8.0
#: Seconds of one engine step, the part that does not grow with the group:
#: fitted with :data:`STEP_FENCE_S` to one request decoding 400 tokens with the
#: built-in Llama on 2 loaded cores, 17 ms a step at cp 2 and 46 ms at cp 4
#: (3.4 ms at cp 1, with no collective at all).
STEP_BASE_S = 7.3e-3
#: Seconds of one engine step per rank squared per core: every fence and
#: all-gather waits for each rank to be scheduled (see :data:`MAX_RANKS_PER_CORE`).
STEP_FENCE_S = 4.8e-3


#: Where POSIX shared memory lives (the KV segments, :mod:`cpkv.runtime.shm`): its free space bounds the
#: device cache a CPU group can make.
SHM_DIR = "/dev/shm"


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
    #: free bytes of the shared-memory file system the KV segments live in (``None``: not known)
    shm_free_bytes: int | None = None


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
    (affinity, capped by a cgroup CPU quota), and the free space of the
    shared-memory file system."""
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
    try:
        st = os.statvfs(SHM_DIR)
        shm = st.f_bavail * st.f_frsize
    except (OSError, AttributeError):
        shm = None
    return MachineCapacity(int(avail), max(int(cores), 1), shm)


# -- the device KV cache, sized from memory ------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
          "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """A byte count from ``"64MiB"``, ``"2GiB"``, ``"1.5 GiB"``, ``"500MB"``,
    ``"1e9"`` or a plain integer (bytes): binary units ``KiB MiB GiB TiB``,
    decimal units ``kB MB GB TB`` (case does not matter), a number in
    scientific notation allowed. Returns an int >= 1. Raises ``ValueError``
    saying what is accepted for anything else (no number, an unknown unit,
    zero, a negative or a fractional count of bytes)."""
    import re
    from fractions import Fraction

    m = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not unit:
        raise ValueError(f"{text!r} is not a size: a number of bytes, or a number with a unit "
                         "(KiB, MiB, GiB, TiB, kB, MB, GB, TB), e.g. 64MiB or 2GiB")
    value = Fraction(m.group(1)) * unit  # exact: 1e12 is 10**12 bytes
    if value < 1 or (unit == 1 and value.denominator != 1):
        raise ValueError(f"{text!r}: a size must be a whole number of bytes >= 1")
    return int(value)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``"64.0 MiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def pages_for_memory(kv_bytes: int, page_bytes: int) -> int:
    """KV pages per rank that ``kv_bytes`` of memory per rank hold: the one
    conversion from a memory budget to ``pages_per_rank`` (``--kv-memory``
    and the default budget both go through it): ``kv_bytes // page_bytes``.

    ``page_bytes`` is one page of the device cache, every cache family
    together (``slot_bytes`` of each family times the page size). The count
    is the same for the shared cache (the rank's lane) and a replicated one
    (the rank's full copy), so both modes compare at equal memory; the group
    holds :func:`group_pages` of them. Raises ``ValueError`` for non-positive
    sizes or a budget that holds no page."""
    for name, v in (("kv_bytes", kv_bytes), ("page_bytes", page_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    pages = kv_bytes // page_bytes
    if pages < 1:
        raise ValueError(f"{format_size(kv_bytes)} per rank holds no page of {format_size(page_bytes)}")
    return pages


def default_kv_memory(world_size: int, *, other_bytes: int = 0, capacity: MachineCapacity | None = None,
                      fraction: float = KV_MEMORY_FRACTION, cap: int = KV_MEMORY_CAP,
                      reserve: float = MEMORY_RESERVE, baseline_bytes: int = RANK_BASELINE_BYTES) -> int:
    """The device KV budget per rank (bytes) when none is given: ``fraction``
    of the memory a launch may use (``(1 - reserve)`` of what is available)
    less every rank's baseline and ``other_bytes`` (models, host tier), split
    over ``world_size`` ranks; at most ``cap``, and at most half of the free
    shared memory split over the ranks (the segments live there). Can be 0 on
    a machine with nothing left (the caller then takes a floor and
    :func:`check_capacity` refuses what does not fit). ``capacity`` defaults to
    :func:`machine_capacity` now, so two calls can differ: compute it once,
    on one process, and hand the pages to every rank."""
    if int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not 0 < fraction <= 1 or cap < 1 or other_bytes < 0:
        raise ValueError(f"need 0 < fraction <= 1, cap >= 1, other_bytes >= 0; got {fraction}, {cap}, {other_bytes}")
    cap_ = capacity or machine_capacity()
    left = cap_.available_bytes * (1 - reserve) - world_size * baseline_bytes - other_bytes
    budget = min(cap, fraction * max(left, 0) / world_size)
    if cap_.shm_free_bytes is not None:
        budget = min(budget, cap_.shm_free_bytes / 2 / world_size)
    return int(budget)


def expected_run_seconds(world_size: int, steps: int, cores: int) -> float:
    """About how long a run of ``steps`` engine steps on ``world_size`` ranks
    takes on ``cores`` cores: the ranks' start (:data:`RANK_START_S` each,
    spread over the cores) plus each step's :data:`STEP_BASE_S` and
    :data:`STEP_FENCE_S` times ``world_size ** 2 / cores``. Measured rates of
    the built-in tiny models on the CPU: an estimate to tell a user how long
    to wait, not a limit. ``ValueError`` for a world or cores below 1 or
    negative steps."""
    if min(world_size, cores) < 1 or steps < 0:
        raise ValueError(f"need world_size >= 1, cores >= 1, steps >= 0; got {world_size}, {cores}, {steps}")
    start = RANK_START_S * max(world_size / cores, 1.0)
    return start + steps * (STEP_BASE_S + STEP_FENCE_S * world_size**2 / cores)


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


def group_pages(pages_per_rank: int, *, replicated: bool = False, cp_size: int = 1) -> int:
    """Distinct pages a CP group of ``cp_size`` ranks holds with ``pages_per_rank``
    pages of memory each (page 0, reserved, included): ``cp_size`` times them
    when shared (each page on its owner only), once when ``replicated`` (every
    page on every rank)."""
    return pages_per_rank * (1 if replicated else cp_size)
