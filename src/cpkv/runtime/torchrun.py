"""Ranks that join a world torchrun made (``env://``), one CP group per node.

cpkv's own launcher (:func:`~cpkv.runtime.group.launch`) spawns its ranks.
Engines and their operators start ranks with ``torchrun`` (or a Kubernetes job
that sets the same environment); :func:`join` lets such a rank run a cpkv
target, ``target(ctx, *args)``, with a :class:`JoinedContext` that has the
interface of :class:`~cpkv.runtime.group.RankContext` (``rank``,
``world_size``, ``prefix``, ``distributed``, ``barrier``, ``all_gather_object``,
``shared``, ``close``) plus what a world of several nodes needs:

* **Nodes.** The ranks one torchrun agent started are a *node*
  (``GROUP_RANK``; without torchrun's extra variables, the host name). Shared
  segments exist per node: :meth:`JoinedContext.shared` is, by default,
  created by the node's local rank 0 and attached by the node's other ranks,
  and ``ctx.comm`` is the node's CP group. Nodes are numbered by their first
  global rank, so the numbering is the same on every rank.
* **Roles.** ``torchrun --role prefill`` sets ``ROLE_NAME`` in every rank of
  that agent; ``join(..., role=...)`` overrides it. Ranks of one role form
  ``ctx.role_group(role)``; disaggregation runs a prefill role on one node and a
  decode role on another (``--nnodes 2 --rdzv-backend c10d
  --rdzv-endpoint HOST:PORT``). The c10d rendezvous ignores ``--node-rank``
  and orders nodes as it pleases, so a node's job is told by its role, never
  by its node or global rank.

Nothing is left behind, however the run ends, and nothing that makes it so
needs a dying rank to run Python code (a rank blocked in C++ with the GIL held,
in the rendezvous or a collective, runs none). From the moment :func:`join`
starts, for as long as it runs:

* **What ends a rank.** ``PR_SET_PDEATHSIG`` = SIGKILL: the kernel ends the
  rank as its parent, torchrun's agent, ends (``kill -9`` included), in the
  rendezvous, in a collective, in a step. (The signal follows the parent
  *thread* that started the rank: torchrun's agent starts its ranks from its
  main thread. A launcher of its own that starts ranks from a thread that
  ends before them would end them with it.) ``SIGTERM``, ``SIGINT`` and
  ``SIGHUP`` keep their default action: the kernel ends the rank on them at
  once. torchrun starts each rank in a session of its own and stops them with
  ``SIGTERM`` to that session (after a rank failed, on Ctrl-C, or when its
  agent is told to stop); a SIGKILLed rank's peers see their collective fail
  (gloo closes the connection; a silent peer is bounded by the process group's
  ``timeout``) and exit.
* **What removes the node's names.** A name is unlinked as soon as every rank
  of the node has mapped it (:meth:`~cpkv.runtime.group.RankContext.shared`);
  a rank unlinks its node's prefix again when :func:`join` ends, raising or
  not. A rank that ends by a signal runs none of that: its reaper
  (:mod:`~cpkv.runtime.reaper`, a tiny process in a session of its own, so the
  agent's ``killpg`` spares it), which watches the node's prefix from before
  the rank can create a name under it, removes the names once the rank has
  ended. The rank that dies last so removes the last name, on a node of one
  rank too.

Before :func:`join` starts, while the rank imports: ``python -m cpkv`` (``torchrun
... -m cpkv run``) asks for the same ``PR_SET_PDEATHSIG`` on its first line, before it
imports torch or anything of cpkv (:mod:`cpkv.__main__`), so a rank whose agent dies
while it imports ends with it; only the interpreter's own start-up comes before. Another
script that calls :func:`join` is its own until then: a rank of it whose agent died
before the call ends when its rendezvous gives up (the agent's store is gone:
``timeout`` seconds for each of torch's connection attempts). cpkv's own launcher has
no such window (:data:`cpkv.runtime.group._BOOT` sets the signal before any import).

Backends: gloo on the CPU; ``device="cuda"`` as
:func:`~cpkv.runtime.device.plan_devices` plans for the node's ranks:
``cpu:gloo,cuda:nccl`` (CPU tensors on gloo, CUDA tensors on NCCL) with one GPU
per local rank, gloo when local ranks share a GPU; rank ``LOCAL_RANK`` runs on
``cuda:(LOCAL_RANK % GPUs)``, and ``ctx.comm`` fences on its device.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import shm as shm_mod
from .comm import DistComm
from . import reaper as reaper_mod
from .group import RankContext
from .lifetime import parent_death_signal, set_parent_death_signal

#: The variables torchrun (and any launcher speaking ``env://``) sets in every rank.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Signals that stop a joined rank (after unlinking its node's segments).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_DEFAULT_ROLE = "default"  # torchrun's ROLE_NAME when --role is not given
_NODE_GROUP = object()  # JoinedContext.shared's group when none is given: the node's (which may be the world, None)


@dataclass(frozen=True)
class TorchrunEnv:
    """One rank's place in the world, as its launcher's environment says.

    ``node`` names the ranks one agent started (``GROUP_RANK``, else the host
    name); ``role`` is ``ROLE_NAME`` (``"default"`` when torchrun had no
    ``--role``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node: str
    role: str


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's place in a world torchrun made; ``None`` when none of
    :data:`TORCHRUN_ENV` is set (the process was not started by torchrun).

    Raises ``ValueError`` naming the variable when only some are set, when one
    is not a number where a number belongs, or when ``RANK`` is not below
    ``WORLD_SIZE``, ``LOCAL_RANK`` not below ``LOCAL_WORLD_SIZE`` or
    ``LOCAL_WORLD_SIZE`` above ``WORLD_SIZE``. ``environ`` defaults to
    ``os.environ``."""
    env = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_ENV if env.get(k, "") != ""]
    if not present:
        return None
    missing = [k for k in TORCHRUN_ENV if k not in present]
    if missing:
        raise ValueError(f"a torchrun environment needs {', '.join(TORCHRUN_ENV)}; {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set (set: {', '.join(present)})")
    num = {}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        try:
            num[k] = int(env[k])
        except ValueError:
            raise ValueError(f"{k} must be an integer, got {env[k]!r}") from None
    if num["WORLD_SIZE"] < 1 or not 0 <= num["RANK"] < num["WORLD_SIZE"]:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE), got RANK={num['RANK']} WORLD_SIZE={num['WORLD_SIZE']}")
    if not 1 <= num["LOCAL_WORLD_SIZE"] <= num["WORLD_SIZE"]:
        raise ValueError(f"LOCAL_WORLD_SIZE must be in [1, WORLD_SIZE], got {num['LOCAL_WORLD_SIZE']} "
                         f"(WORLD_SIZE={num['WORLD_SIZE']})")
    if not 0 <= num["LOCAL_RANK"] < num["LOCAL_WORLD_SIZE"]:
        raise ValueError(f"LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE), got LOCAL_RANK={num['LOCAL_RANK']} "
                         f"LOCAL_WORLD_SIZE={num['LOCAL_WORLD_SIZE']}")
    node = env.get("GROUP_RANK") or socket.gethostname()
    return TorchrunEnv(num["RANK"], num["WORLD_SIZE"], num["LOCAL_RANK"], num["LOCAL_WORLD_SIZE"],
                       env["MASTER_ADDR"], num["MASTER_PORT"], node, env.get("ROLE_NAME") or _DEFAULT_ROLE)


@dataclass(frozen=True)
class WorldMap:
    """Who is where in a joined world, the same on every rank.

    ``nodes[i]`` holds node ``i``'s global ranks in local-rank order (so
    ``nodes[i][0]`` is its local rank 0, the creator of its segments); nodes are
    ordered by their lowest global rank. ``roles`` maps each role to its global
    ranks, ascending, roles in the order of their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]
    roles: dict[str, tuple[int, ...]]

    def node_of(self, rank: int) -> int:
        """Index in :attr:`nodes` of the node holding global ``rank``."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def role_of(self, rank: int) -> str:
        """The role of global ``rank``."""
        return next(r for r, ranks in self.roles.items() if rank in ranks)


def world_map(entries: Sequence[tuple[str, int, int, str]]) -> WorldMap:
    """Group the world by node and role from every rank's ``(node, local_rank,
    local_world_size, role)``, indexed by global rank (what each rank's
    :class:`TorchrunEnv` says, all-gathered).

    Raises ``ValueError`` naming the node when its ranks disagree on the local
    world size, do not hold local ranks ``0 .. L-1`` exactly once, or hold
    more than one role (a node is one CP group with one job)."""
    if not entries:
        raise ValueError("an empty world")
    by_node: dict[str, list[tuple[int, int, int, str]]] = {}
    for rank, (node, local_rank, local_size, role) in enumerate(entries):
        by_node.setdefault(node, []).append((rank, int(local_rank), int(local_size), role))
    nodes = []
    for node, members in by_node.items():
        sizes = {m[2] for m in members}
        locals_ = sorted(m[1] for m in members)
        if len(sizes) != 1 or locals_ != list(range(len(members))) or sizes != {len(members)}:
            raise ValueError(f"node {node!r}: its ranks {[m[0] for m in members]} must hold local ranks 0..L-1 "
                             f"exactly once with L = LOCAL_WORLD_SIZE; they hold {locals_} with LOCAL_WORLD_SIZE "
                             f"{sorted(sizes)}")
        roles = {m[3] for m in members}
        if len(roles) != 1:
            raise ValueError(f"node {node!r} holds several roles {sorted(roles)}; one node is one CP group with one "
                             f"role")
        nodes.append(tuple(m[0] for m in sorted(members, key=lambda m: m[1])))
    nodes.sort(key=min)
    roles: dict[str, list[int]] = {}
    for rank, entry in enumerate(entries):
        roles.setdefault(entry[3], []).append(rank)
    return WorldMap(tuple(nodes), {r: tuple(v) for r, v in roles.items()})


class JoinedContext(RankContext):
    """A :class:`~cpkv.runtime.group.RankContext` for a rank of a world torchrun
    made: global ``rank`` and ``world_size``, plus its node and its role.

    * ``local_rank``, ``local_world_size``, ``node`` (index in ``world.nodes``),
      ``node_ranks`` (the node's global ranks, local-rank order), ``node_group``;
    * ``role`` and ``world`` (:class:`WorldMap`); :meth:`role_group` gives any
      role's process group, :meth:`role_ranks` its ranks;
    * ``comm``: a :class:`~cpkv.runtime.comm.DistComm` on the node's group (the
      CP group this rank belongs to) with this rank's ``device``, ``world_comm``
      on the whole world (the CPU).

    Process groups equal to the whole world are the world's group (``None``)."""

    def __init__(self, env: TorchrunEnv, world: WorldMap, prefix: str, groups: dict,
                 device: torch.device | None = None):
        super().__init__(env.rank, env.world_size, prefix, device)
        self.local_rank, self.local_world_size = env.local_rank, env.local_world_size
        self.world = world
        self.node = world.node_of(env.rank)
        self.node_ranks = world.nodes[self.node]
        self.role = world.role_of(env.rank)
        self._groups = groups
        self.node_group = groups[("node", self.node)]
        self.comm = DistComm(self.node_group, self.node_ranks, device=self.device)
        self.world_comm = DistComm()

    def role_ranks(self, role: str) -> tuple[int, ...]:
        """Global ranks of ``role``; ``KeyError`` naming the roles there are."""
        if role not in self.world.roles:
            raise KeyError(f"no role {role!r} in this world; roles: {sorted(self.world.roles)}")
        return self.world.roles[role]

    def role_group(self, role: str):
        """Process group of the ranks of ``role`` (``None``: the whole world)."""
        self.role_ranks(role)
        return self._groups[("role", role)]

    def shared(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype, *, creator: int | None = None,
               group=_NODE_GROUP) -> torch.Tensor:
        """A zeroed tensor in shared memory, the same memory on every rank of
        this node: created by the node's local rank 0, attached by the others
        (collective over the node's group). ``creator`` (a global rank) and
        ``group`` choose another group of this node, as in
        :meth:`RankContext.shared`; a group that spans nodes cannot share
        memory."""
        if (creator is None) != (group is _NODE_GROUP):
            raise ValueError("give both creator and group, or neither (the node's local rank 0 and the node)")
        if creator is None:
            creator, group = self.node_ranks[0], self.node_group
        elif creator not in self.node_ranks:
            raise ValueError(f"creator {creator} is not on this rank's node {list(self.node_ranks)}: shared memory "
                             f"does not cross nodes")
        return super().shared(tag, shape, dtype, creator=creator, group=group)


class _StopGuard:
    """What ends a joined rank, and what cleans up after it, for the time of :func:`join`.

    ``PR_SET_PDEATHSIG`` = SIGKILL (the kernel ends the rank with its agent), :data:`STOP_SIGNALS` at
    their default action (the kernel ends the rank on them, even while its main thread holds the GIL in
    a collective), and this process's reaper (:mod:`~cpkv.runtime.reaper`, out of the agent's process
    group) watching the node's name prefix once it is known (:meth:`watch`), so that the names this
    rank may hold are removed once it has ended, however. ``uninstall`` restores the previous
    handlers and parent-death signal and forgets the prefix (the rank removed it)."""

    def __init__(self):
        self.prefix: str | None = None
        self._reaper = reaper_mod.reaper()
        self._saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._saved_death = parent_death_signal()
        set_parent_death_signal(signal.SIGKILL)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    def watch(self, prefix: str) -> None:
        self._reaper.watch(prefix=prefix)
        self.prefix = prefix

    def uninstall(self) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        set_parent_death_signal(self._saved_death)
        if self.prefix:
            self._reaper.remove(prefix=self.prefix)


def _make_groups(world: WorldMap, world_size: int) -> dict:
    """Every node's and every role's group, made by every rank in the same order."""
    everyone = tuple(range(world_size))
    groups = {}
    for key, ranks in ([(("node", i), r) for i, r in enumerate(world.nodes)]
                       + [(("role", name), r) for name, r in world.roles.items()]):
        groups[key] = None if tuple(sorted(ranks)) == everyone else dist.new_group(sorted(ranks))
    return groups


def join(target: Callable, *args: Any, timeout: float = 300.0, device: str = "cpu", role: str | None = None,
         environ: Mapping[str, str] | None = None) -> Any:
    """Run ``target(ctx, *args)`` in this rank of a world torchrun made, with
    ``ctx`` a :class:`JoinedContext`; return what the target returned on this
    rank (cpkv's targets return their report on one rank and ``None`` on the
    others: world rank 0, or for disaggregation the first prefill rank, which
    torchrun may have numbered otherwise).

    Collective: every rank of the world calls it, from its main thread.
    Initialises ``torch.distributed`` from ``env://`` (gloo; ``device="cuda"``:
    the backend and this rank's GPU that
    :func:`~cpkv.runtime.device.plan_devices` plans for the node's local ranks) with
    ``timeout`` seconds for any collective, agrees on a run id (global rank 0's)
    and on the node and role of every rank, makes every node's and role's group,
    runs the target, waits at a barrier for every rank to finish it, and tears
    the process group down. ``role`` overrides ``ROLE_NAME`` for this rank.
    ``environ`` (default ``os.environ``) is the environment checked and read
    for this rank's place; ``env://`` itself always reads ``os.environ``.

    Raises ``RuntimeError`` when this process was not started by torchrun (see
    :func:`torchrun_env`) or not from the main thread, or a ``device="cuda"``
    that :func:`~cpkv.runtime.device.plan_devices` refuses (the reason, as
    ``cpkv run`` gives it), ``ValueError`` on a bad
    environment, ``timeout`` or ``device``; whatever ``target`` raises
    propagates after this rank unlinked its node's segments (so the process
    exits non-zero and torchrun stops the others). Implements the run-time side
    of [[RFC-0001:C-DIRECT-WRITE]] (one segment per node, each rank writing its
    own part) and, across nodes, of [[RFC-0001:C-DISAGG]] (the groups the
    transfer's point-to-point messages run between)."""
    env = torchrun_env(environ)
    if env is None:
        raise RuntimeError(f"join() needs a world made by torchrun; none of {', '.join(TORCHRUN_ENV)} is set")
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("join() must run in the main thread (it installs signal handlers)")
    if not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    from .device import plan_devices

    plan = plan_devices(device, env.local_world_size)
    if role is not None and (not isinstance(role, str) or not role):
        raise ValueError(f"role must be a non-empty string, got {role!r}")
    if role is not None:
        env = TorchrunEnv(**{**env.__dict__, "role": role})
    guard = _StopGuard()
    ctx, ok = None, False
    try:
        torch.set_num_threads(1)
        rank_device = plan.rank_device(env.local_rank)
        dist.init_process_group(plan.backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout))
        mine = (env.node, env.local_rank, env.local_world_size, env.role, os.getpid(), uuid.uuid4().hex[:8])
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
        world = world_map([e[:4] for e in everyone])
        node = world.node_of(env.rank)
        creator_pid, run_id = everyone[world.nodes[node][0]][4], everyone[0][5]
        prefix = shm_mod.run_prefix(f"{run_id}_n{node}", pid=creator_pid)
        guard.watch(prefix)  # before this rank can create a name under it
        ctx = JoinedContext(env, world, prefix, _make_groups(world, env.world_size), rank_device)
        result = target(ctx, *args)
        dist.barrier()  # every rank is done with every segment before any prefix is unlinked
        ok = True
        return result
    finally:
        if ctx is not None:
            ctx.close()
        if dist.is_initialized():
            if ok:
                dist.destroy_process_group()
            # after a failure a peer may be gone: tearing down could wait on it, and the process is ending
        guard.uninstall()
