"""Tiny targets run under torchrun: ``python -m torch.distributed.run ... -m support.torchrun_targets MODE OUT [ARG]``
(with ``PYTHONPATH=src:tests``). Every rank writes ``OUT/pid<rank>`` (its pid and its node's segment prefix) once
it has joined; global rank 0 writes ``OUT/result.json``: every rank's report.

Modes:

* ``share``: every rank writes its row of a node-shared tensor and reads every row back;
* ``kill VICTIM``: the node's creator leaves a name not yet unlinked (as while creating), then global rank
  VICTIM writes ``OUT/killed`` (the time) and SIGKILLs itself while its peers wait in a barrier;
* ``hang``: loop through barriers forever (the test kills torchrun or sends Ctrl-C);
* ``disagg``: every node's creator holds a name, then the ``prefill`` role's ranks send a tensor to the ``decode``
  role's ranks, point to point.
"""

import json
import os
import signal
import sys
import time

import torch

from cpkv.runtime import shm
from cpkv.runtime.p2p import DistP2P
from cpkv.runtime.reorder import ReorderedComm, ReorderedP2P
from cpkv.runtime.torchrun import join
from support import moments


def _mark(ctx, out):
    path = os.path.join(out, f"pid{ctx.rank}")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "prefix": ctx.prefix, "node": ctx.node, "role": ctx.role}, f)
    os.replace(path + ".tmp", path)


def _rows(ctx):
    """Every local rank writes its row of a node-shared tensor; returns what this rank reads back."""
    t = ctx.shared("rows", (ctx.local_world_size, 4), torch.int64)
    t[ctx.local_rank] = ctx.rank * 100 + torch.arange(4)
    ctx.comm.barrier()
    return t.clone(), sorted(shm.shm_names(ctx.prefix))  # unlinked once every local rank mapped it


def _report(ctx, mine):
    got = ctx.all_gather_object(mine)
    return got if ctx.rank == 0 else None


def _misuse(ctx):
    """Wrong calls of ``ctx.shared`` (each must raise ``ValueError`` before any collective): their messages."""
    other = [r for r in range(ctx.world_size) if r not in ctx.node_ranks]
    calls = [lambda: ctx.shared("x", (1,), torch.int8, creator=ctx.node_ranks[0]),
             lambda: ctx.shared("x", (1,), torch.int8, group=ctx.node_group)]
    if other:
        calls.append(lambda: ctx.shared("x", (1,), torch.int8, creator=other[0], group=ctx.node_group))
    out = []
    for call in calls:
        try:
            call()
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def share(ctx, out):
    _mark(ctx, out)
    seen, left = _rows(ctx)
    expected = torch.tensor(ctx.node_ranks).unsqueeze(1) * 100 + torch.arange(4)
    return _report(ctx, {"rank": ctx.rank, "local_rank": ctx.local_rank, "node_ranks": list(ctx.node_ranks),
                         "rows": seen.tolist(), "exact": bool(torch.equal(seen, expected)), "names_left": left,
                         "world": ctx.world_comm.size, "cp": ctx.comm.size, "misuse": _misuse(ctx)})


def kill(ctx, out, victim):
    ctx.shared("buf", (16,), torch.float32)
    if ctx.local_rank == 0:
        shm.create(ctx.prefix + "pending", 64)  # a name not yet unlinked, as while creating a segment
    _mark(ctx, out)
    ctx.barrier()
    if ctx.rank == int(victim):
        with open(os.path.join(out, "killed"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        ctx.barrier()


def hang(ctx, out):
    ctx.shared("buf", (16,), torch.float32)
    if ctx.local_rank == 0:
        shm.create(ctx.prefix + "pending", 64)
    _mark(ctx, out)
    while True:
        ctx.barrier()
        time.sleep(0.05)


def disagg(ctx, out):
    """Numbered prefill first (cpkv's disaggregation numbering), prefill rank i sends a [3, 5] tensor to decode
    rank i % D, and every decode rank receives from the prefill ranks assigned to it; roles' groups and nodes'
    shared segments are exercised on the way."""
    _mark(ctx, out)
    if ctx.local_rank == 0:  # every node's creator holds a name at once: the nodes' names must differ
        shm.create(ctx.prefix + "pending", 64)
    ctx.barrier()
    seen, left = _rows(ctx)
    left = [n for n in left if not n.endswith("pending")]  # join unlinks it at the end
    pre, dec = ctx.role_ranks("prefill"), ctx.role_ranks("decode")
    role_members = ctx.all_gather_object(ctx.role)  # whole world, then a role collective
    role_comm_size = torch.distributed.get_world_size(ctx.role_group(ctx.role))
    # cpkv's disaggregation numbering (prefill first), whatever order the rendezvous gave
    world = ReorderedComm(ctx.world_comm, pre + dec)
    p2p = ReorderedP2P(DistP2P(timeout=60), pre + dec)
    P, D = len(pre), len(dec)
    rows = world.all_gather(torch.full((world.rank + 1, 2), world.rank))
    gathered = [r.tolist() for r in rows]

    def payload(src):
        return torch.arange(15, dtype=torch.float32).view(3, 5) * (src + 1) + 0.25

    got = {}
    if ctx.role == "prefill":  # prefill i sends to decode i % D, i.e. reordered rank P + i % D
        p2p.post([(P + world.rank % D, payload(world.rank))], []).wait()
    else:
        j = world.rank - P
        bufs = [(i, torch.empty(3, 5)) for i in range(P) if i % D == j]
        p2p.post([], bufs).wait()
        got = {i: bool(torch.equal(b, payload(i))) for i, b in bufs}
    return _report(ctx, {"rank": ctx.rank, "role": ctx.role, "node": ctx.node, "node_ranks": list(ctx.node_ranks),
                         "role_size": role_comm_size,
                         "rows_exact": bool(torch.equal(seen, torch.tensor(ctx.node_ranks).unsqueeze(1) * 100
                                                        + torch.arange(4))),
                         "names_left": left, "received": got, "roles": role_members,
                         "reordered": {"rank": world.rank, "roles": world.all_gather_object(ctx.role),
                                       "rows": gathered},
                         "misuse": _misuse(ctx)})


def main(argv):
    mode, out, *rest = argv
    moments.pause_rendezvous()  # a test may pause a rank there (CPKV_TEST_PAUSE=rendezvous:<rank>)
    result = join(globals()[mode], out, *rest, timeout=60)
    if result is not None:
        with open(os.path.join(out, "result.json.tmp"), "w") as f:
            json.dump(result, f)
        os.replace(os.path.join(out, "result.json.tmp"), os.path.join(out, "result.json"))


if __name__ == "__main__":
    main(sys.argv[1:])
