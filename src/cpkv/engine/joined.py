"""cpkv's engine and its disaggregation in a world torchrun made (the entry ``cpkv run`` calls under torchrun).

``cpkv run`` spawns its own CP group (:func:`cpkv.engine.engine.run_engine`). Started by torchrun instead (the
environment holds :data:`~cpkv.runtime.torchrun.TORCHRUN_ENV`; :func:`~cpkv.runtime.torchrun.torchrun_env` is not
``None``), every rank runs the command, and the command joins the world torchrun made:

    torchrun --standalone --nproc-per-node 4 -m cpkv run --cp 4 --check

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --role prefill \\
             --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN -m cpkv run --disagg 2:1 --check
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 1 --role decode \\
             --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN -m cpkv run --disagg 2:1 --check

* :func:`run_engine_joined`: one node, its ranks the CP group (``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = ``cp_size``);
* :func:`run_disagg_joined`: the prefill group on the node(s) started with ``--role prefill``, the decode group
  on the one started with ``--role decode``; each group on one node (its cache is shared memory). The c10d
  rendezvous ignores ``--node-rank``: the role, not the rank, says which group a node is.

Each returns the run's report on the one rank that makes it (world rank 0 for the engine, the first prefill rank
for disaggregation) and ``None`` on every other rank: print it where it is not ``None``. Each rank sizes its
configuration at launch (:meth:`~cpkv.engine.config.RunConfig.sized`), then every rank takes the first rank's
sizes.
"""

from __future__ import annotations

from typing import Mapping

from ..models import build_adapter
from ..runtime.p2p import DistP2P
from ..runtime.reorder import ReorderedComm, ReorderedP2P
from ..runtime.torchrun import TORCHRUN_ENV, JoinedContext, TorchrunEnv, join, torchrun_env
from .config import DisaggConfig, EngineConfig
from .disagg.control import DisaggControl
from .disagg.driver import SIDES, disagg_rank
from .engine import build_scheduler, engine_rank, gpu_engine_rank


#: Why ``--disagg`` with ``--device cuda`` is refused, with or without torchrun.
DISAGG_ON_GPU = "--device cuda runs one CP group; --disagg on GPUs is not built"


def _env(environ: Mapping[str, str] | None) -> TorchrunEnv:
    env = torchrun_env(environ)
    if env is None:
        raise RuntimeError(f"not started by torchrun: none of {', '.join(TORCHRUN_ENV)} is set")
    return env


def _agree_on_cache(comm, cfg) -> None:
    """Every rank takes rank 0's device cache sizes: a default sized from
    memory (``MemAvailable``, read by each rank when it sized its
    configuration at launch) may differ between ranks, and the schedulers
    must be identical."""
    names = [n for n in ("device_pages", "decode_pages") if hasattr(cfg, n)]
    first = comm.all_gather_object({n: getattr(cfg, n) for n in names})[0]
    for n in names:
        setattr(cfg, n, first[n])


def _engine_target(ctx: JoinedContext, cfg: EngineConfig) -> dict | None:
    _agree_on_cache(ctx.comm, cfg)
    if cfg.device == "cuda":  # the model, the KV segments and the fence on this rank's GPU
        return gpu_engine_rank(ctx, ctx.comm, cfg)
    return engine_rank(ctx.shared, ctx.comm, cfg, build_adapter(cfg.model))


def run_engine_joined(cfg: EngineConfig, environ: Mapping[str, str] | None = None) -> dict | None:
    """Run this rank of the engine in a one-node world torchrun made; the report on world rank 0, ``None`` on
    the others.

    Refuses, before joining (so every rank refuses alike and nothing starts), with ``RuntimeError`` outside
    torchrun or for a ``cfg.device`` the node cannot run (:func:`~cpkv.runtime.device.plan_devices`: the
    message ``cpkv run`` gives without torchrun), ``ValueError`` when the world is not one node of
    ``cfg.cp_size`` ranks, and whatever :func:`~cpkv.engine.engine.build_scheduler` refuses of the trace. The
    group's KV cache lives in the node's shared segments, or with ``device="cuda"`` one segment per rank on its
    GPU (device from ``LOCAL_RANK``, the fence on the device) [[RFC-0001:C-DIRECT-WRITE]]; cleanup as
    :func:`~cpkv.runtime.torchrun.join` guarantees."""
    from ..runtime.device import plan_devices

    env = _env(environ)
    cfg = cfg.sized()
    if env.world_size != cfg.cp_size or env.local_world_size != cfg.cp_size:
        raise ValueError(f"the engine's CP group of {cfg.cp_size} ranks is one node: start torchrun with "
                         f"--nnodes 1 --nproc-per-node {cfg.cp_size} (this world has WORLD_SIZE={env.world_size}, "
                         f"LOCAL_WORLD_SIZE={env.local_world_size})")
    plan_devices(cfg.device, env.local_world_size)
    cfg.model.config()
    build_scheduler(cfg, cfg.trace())  # refuse a trace that cannot run before joining
    return join(_engine_target, cfg, timeout=cfg.timeout, device=cfg.device, environ=environ)


def _disagg_target(ctx: JoinedContext, cfg: DisaggConfig) -> dict | None:
    roles = {r: len(ctx.world.roles.get(r, ())) for r in SIDES}
    if set(ctx.world.roles) != set(SIDES) or (roles["prefill"], roles["decode"]) != (cfg.prefill_size,
                                                                                     cfg.decode_size):
        raise ValueError(f"--disagg {cfg.prefill_size}:{cfg.decode_size} needs {cfg.prefill_size} ranks of role "
                         f"prefill and {cfg.decode_size} of role decode; this world has "
                         f"{ {r: len(v) for r, v in ctx.world.roles.items()} }")
    if ctx.node_ranks != ctx.role_ranks(ctx.role):
        raise ValueError(f"the {ctx.role} group must be one node (its cache is shared memory): its ranks "
                         f"{list(ctx.role_ranks(ctx.role))}, this node's {list(ctx.node_ranks)}")
    _agree_on_cache(ctx.world_comm, cfg)  # the first world rank's sizes, for both groups
    order = ctx.role_ranks("prefill") + ctx.role_ranks("decode")  # disagg_rank numbers the world prefill first
    return disagg_rank(ReorderedComm(ctx.world_comm, order), ctx.comm, ctx.role, ctx.shared,
                       ReorderedP2P(DistP2P(timeout=cfg.transfer_timeout), order), cfg, build_adapter(cfg.model))


def run_disagg_joined(cfg: DisaggConfig, environ: Mapping[str, str] | None = None) -> dict | None:
    """Run this rank of a disaggregated run in a world torchrun made, each group one node told by its role
    (``torchrun --role prefill|decode``); the report on the first prefill rank, ``None`` on the others.

    Refuses before joining, with ``RuntimeError`` outside torchrun and ``ValueError`` on a node without a role
    in ``("prefill", "decode")``, a world whose size is not ``M + N``, or a configuration or trace that cannot
    run; after joining (every rank alike), with ``ValueError`` when the roles' sizes are not ``M`` and ``N``
    or a role spans nodes. The KV moves point to point between the nodes [[RFC-0001:C-DISAGG]]."""
    env = _env(environ)
    if cfg.device != "cpu":
        raise RuntimeError(DISAGG_ON_GPU)
    if env.role not in SIDES:
        raise ValueError(f"this node's role is {env.role!r}: start each node's torchrun with --role prefill or "
                         f"--role decode")
    if env.world_size != cfg.world_size:
        raise ValueError(f"--disagg {cfg.prefill_size}:{cfg.decode_size} needs a world of {cfg.world_size} ranks; "
                         f"this one has WORLD_SIZE={env.world_size}")
    cfg.validate()
    cfg = cfg.sized()
    cfg.model.config()
    DisaggControl(cfg, cfg.trace())  # refuse a trace that cannot run before joining
    return join(_disagg_target, cfg, timeout=cfg.timeout, environ=environ)
