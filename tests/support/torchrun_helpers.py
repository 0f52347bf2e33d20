"""Starting torchrun from a test: ``python -m torch.distributed.run`` on this interpreter, this checkout first on
the path, its log in the test's folder; every wait bounded."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def start_torchrun(out: Path, launch_args: list[str], module: str, *args: str, log: str = "torchrun", **popen):
    """``torchrun LAUNCH_ARGS -m MODULE OUT ARGS...`` with ``PYTHONPATH=src:tests``; stderr to ``OUT/LOG.log``."""
    out.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", *launch_args, "-m", module, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(out / f"{log}.log", "w"), **popen)


def finish(p, out: Path, seconds: float, log: str = "torchrun") -> int:
    """torchrun's exit status; kills it and fails the test, with its log's end, past ``seconds``."""
    try:
        return p.wait(seconds)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"torchrun did not end within {seconds} s:\n{log_tail(out, log)}")


def log_tail(out: Path, log: str = "torchrun") -> str:
    """The last 3,000 characters of a torchrun's log."""
    return (out / f"{log}.log").read_text()[-3000:]


def two_nodes(out: Path, module: str, *args: str, prefill: int, decode: int) -> list:
    """Two torchrun agents on loopback joined by a c10d rendezvous, ``--role prefill`` with ``prefill`` ranks and
    ``--role decode`` with ``decode``; their processes, prefill first (logs ``prefill.log``, ``decode.log``).

    The decode agent starts first: the rendezvous orders nodes by agent process id, so the decode node usually
    gets global rank 0 although it is ``--node-rank 1``, and the runs meet the numbering a user will meet."""
    port = free_port()
    procs = {role: start_torchrun(out, ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", str(n),
                                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                        "--rdzv-id", f"cpkv-test-{port}", "--role", role],
                                  module, *args, log=role)
             for node_rank, role, n in [(1, "decode", decode), (0, "prefill", prefill)]}
    return [procs["prefill"], procs["decode"]]
