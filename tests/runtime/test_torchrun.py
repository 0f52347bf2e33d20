"""Ranks that join a world torchrun made (cpkv.runtime.torchrun): one node of N ranks, two "nodes" on loopback,
and the cleanup guarantees (a SIGKILLed rank, a killed torchrun, Ctrl-C). Multi-process tests run
``python -m torch.distributed.run ... -m support.torchrun_targets`` (tiny targets: a torch import per rank)."""

import glob
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from support.proc_helpers import gone, wait_until
from support.torchrun_helpers import finish, log_tail, start_torchrun, two_nodes
from cpkv.runtime.shm import shm_names
from cpkv.runtime.torchrun import TorchrunEnv, join, torchrun_env, world_map

ENV = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
       "MASTER_PORT": "29500"}


# -- the environment and the world's map (no process) ---------------------------------
def test_torchrun_env_reads_the_launcher_variables():
    assert torchrun_env({}) is None
    e = torchrun_env({**ENV, "GROUP_RANK": "0", "ROLE_NAME": "prefill"})
    assert e == TorchrunEnv(1, 3, 1, 2, "127.0.0.1", 29500, "0", "prefill")
    assert torchrun_env(ENV).role == "default" and torchrun_env(ENV).node == socket.gethostname()


@pytest.mark.parametrize("change, words", [
    ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
    ({"RANK": None, "LOCAL_RANK": None}, "RANK, LOCAL_RANK are not set"),
    ({"RANK": "one"}, "RANK must be an integer"),
    ({"RANK": "3"}, "RANK must be in [0, WORLD_SIZE)"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE)"),
    ({"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE must be in [1, WORLD_SIZE]"),
])
def test_torchrun_env_refuses_a_partial_or_inconsistent_environment(change, words):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        torchrun_env(env)
    assert words in str(e.value)


@st.composite
def worlds(draw):
    """Nodes of 1..4 ranks with a role each, global ranks dealt out in any order (as the c10d rendezvous does)."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    roles = draw(st.lists(st.sampled_from(["prefill", "decode", "default"]), min_size=len(sizes),
                          max_size=len(sizes)))
    slots = [(n, lr) for n, size in enumerate(sizes) for lr in range(size)]
    order = draw(st.permutations(range(len(slots))))
    entries = [(f"host{slots[i][0]}", slots[i][1], sizes[slots[i][0]], roles[slots[i][0]]) for i in order]
    return entries


@given(worlds())
def test_world_map_groups_ranks_by_node_and_role(entries):
    """[[RFC-0001:C-DIRECT-WRITE]]: one node, one set of segments created by its local rank 0."""
    w = world_map(entries)
    assert sorted(r for node in w.nodes for r in node) == list(range(len(entries)))
    assert [min(n) for n in w.nodes] == sorted(min(n) for n in w.nodes)
    for i, node in enumerate(w.nodes):
        assert len({entries[r][0] for r in node}) == 1
        assert [entries[r][1] for r in node] == list(range(len(node)))  # local-rank order: creator first
        assert all(w.node_of(r) == i for r in node)
    assert sorted(r for ranks in w.roles.values() for r in ranks) == list(range(len(entries)))
    for role, ranks in w.roles.items():
        assert list(ranks) == sorted(ranks) and all(entries[r][3] == role == w.role_of(r) for r in ranks)


@pytest.mark.parametrize("entries, words", [
    ([("a", 0, 2, "x"), ("a", 0, 2, "x")], "must hold local ranks 0..L-1"),
    ([("a", 0, 2, "x")], "must hold local ranks 0..L-1"),
    ([("a", 0, 1, "x"), ("a", 1, 2, "x")], "must hold local ranks 0..L-1"),
    ([("a", 0, 2, "x"), ("a", 1, 2, "y")], "holds several roles"),
    ([], "an empty world"),
])
def test_world_map_refuses_an_inconsistent_world(entries, words):
    with pytest.raises(ValueError) as e:
        world_map(entries)
    assert words in str(e.value)


def _handlers():
    return [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]


def test_join_refuses_misuse_before_touching_anything():
    before = _handlers()
    with pytest.raises(RuntimeError, match="needs a world made by torchrun"):
        join(print, environ={})
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        join(print, environ={k: v for k, v in ENV.items() if k != "MASTER_ADDR"})
    with pytest.raises(ValueError, match="device must be one of"):
        join(print, environ=ENV, device="tpu")
    if not torch.cuda.is_available():  # the launcher's refusal, word for word
        with pytest.raises(RuntimeError, match="--device cuda needs a CUDA GPU"):
            join(print, environ=ENV, device="cuda")
    with pytest.raises(ValueError, match="timeout must be"):
        join(print, environ=ENV, timeout=0)
    with pytest.raises(ValueError, match="role must be a non-empty string"):
        join(print, environ=ENV, role="")
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, join, print, environ=ENV)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0].value)
    assert _handlers() == before and not dist.is_initialized()


# -- python -m cpkv: the parent-death signal before the imports ----------------------------
#: Installed in the rank (``sitecustomize`` on its path): importing ``cpkv.tools`` (the first import
#: ``python -m cpkv`` makes after its first lines) marks the moment, then blocks in Python for an hour.
_SLOW_IMPORT = """
import os, sys, time
class _Pause:
    def find_spec(self, name, path=None, target=None):
        if name == "cpkv.tools":
            with open(os.environ["CPKV_TEST_MARK"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
sys.meta_path.insert(0, _Pause())
"""
_AGENT = "import subprocess, sys, time; print(subprocess.Popen(sys.argv[1:]).pid, flush=True); time.sleep(3600)"
_DEATH_SIGNAL = ("import ctypes; got = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0); "
                 "print(got.value)")  # PR_GET_PDEATHSIG


def _with_path(*folders) -> dict:
    return {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")])}


def test_python_m_cpkv_under_torchrun_ends_with_its_agent_while_it_imports(tmp_path):
    """torchrun's agent (a process that started the rank from its main thread) dies while the rank is still in
    ``python -m cpkv``'s imports: the kernel ends the rank with it (``PR_SET_PDEATHSIG``, asked for on the first line
    of ``cpkv/__main__.py``), where without it the rank would live until its rendezvous gave up."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_SLOW_IMPORT)
    mark = tmp_path / "importing"
    env = {**_with_path(tmp_path, Path(__file__).resolve().parents[2] / "src"), "CPKV_TEST_MARK": str(mark)}
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, sys.executable, "-m", "cpkv", "run"], env=env,
                             stdout=subprocess.PIPE, text=True)
    rank = int(agent.stdout.readline())
    try:
        assert wait_until(mark.exists, 60), "the rank never reached its imports"
        agent.kill()
        agent.wait()
        assert wait_until(lambda: gone(rank), 10), "the rank outlived its agent"
    finally:
        for pid in (rank, agent.pid):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        agent.stdout.close()


def test_a_library_import_of_cpkv_asks_for_no_signal():
    """Importing cpkv, or ``cpkv.__main__`` as a module, under torchrun's environment, leaves the parent-death
    signal alone (0); ``python -m cpkv`` reads the same variables :func:`torchrun_env` reads."""
    import subprocess
    import sys

    import cpkv.__main__ as main_module
    from cpkv.runtime.torchrun import TORCHRUN_ENV

    assert main_module.TORCHRUN_ENV == TORCHRUN_ENV and main_module.under_torchrun(ENV)
    assert not main_module.under_torchrun({}) and not main_module.under_torchrun({"RANK": ""})
    code = "import cpkv, cpkv.__main__; " + _DEATH_SIGNAL
    r = subprocess.run([sys.executable, "-c", code], env=_with_path(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["0"], r.stderr[-2000:]


# -- under torchrun ----------------------------------------------------------------------
def _torchrun(out: Path, launch_args: list[str], mode: str, *args: str, **popen):
    return start_torchrun(out, launch_args, "support.torchrun_targets", mode, str(out), *args, **popen)


def _ranks(out: Path) -> list[dict]:
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(out / "pid*")))]


def _nothing_left(ranks: list[dict]) -> None:
    """No rank process and, soon after (a rank ended by a signal leaves its names to its reaper), no segment name of
    the run's nodes."""
    assert wait_until(lambda: all(gone(r["pid"]) for r in ranks), 10), "a rank outlived the run"
    names = lambda: set().union(*(shm_names(r["prefix"]) for r in ranks))  # noqa: E731
    assert wait_until(lambda: not names(), 5), f"a segment name outlived the run: {sorted(names())}"


@pytest.mark.multiproc
@pytest.mark.parametrize("n", [1, 2, 3])
def test_one_node_of_n_ranks_shares_its_segments(tmp_path, n):
    """[[RFC-0001:C-DIRECT-WRITE]]: each rank writes its own row of the node's segment; every rank reads all rows."""
    p = _torchrun(tmp_path, ["--standalone", "--nproc-per-node", str(n)], "share")
    assert finish(p, tmp_path, 120) == 0, log_tail(tmp_path)
    res = json.loads((tmp_path / "result.json").read_text())
    assert [r["rank"] for r in res] == list(range(n)) and [r["local_rank"] for r in res] == list(range(n))
    assert all(r["exact"] and r["node_ranks"] == list(range(n)) for r in res)
    assert res[0]["rows"] == [[100 * k + j for j in range(4)] for k in range(n)]
    assert all(r["names_left"] == [] for r in res), "a name stayed after every rank mapped it"
    assert all(r["world"] == n and r["cp"] == n for r in res)
    assert all(r["misuse"][:2] == ["give both creator and group, or neither (the node's local rank 0 and the node)"] * 2
               for r in res)
    _nothing_left(_ranks(tmp_path))


@pytest.mark.multiproc
@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_rank_ends_the_run_and_leaves_nothing(tmp_path, victim):
    """Rank 0 (the creator, holding a name not yet unlinked) or rank 2 is SIGKILLed while its peers wait in a
    barrier: torchrun ends within 30 s, no name of the node and no rank is left."""
    p = _torchrun(tmp_path, ["--standalone", "--nproc-per-node", "3"], "kill", str(victim))
    assert finish(p, tmp_path, 120) != 0
    ended = time.time()
    killed_at = float((tmp_path / "killed").read_text())
    assert ended - killed_at < 30
    ranks = _ranks(tmp_path)
    assert len(ranks) == 3
    _nothing_left(ranks)


@pytest.mark.multiproc
def test_ctrl_c_to_torchrun_leaves_nothing(tmp_path):
    """SIGINT to torchrun's process group, as a terminal's Ctrl-C does, while the ranks loop through barriers holding
    a name not yet unlinked: the agent stops its ranks (SIGTERM to each rank's session, which ends a rank at once),
    and their reapers remove the name. (A SIGKILLed agent: test_launcher_death.py.)"""
    p = _torchrun(tmp_path, ["--standalone", "--nproc-per-node", "2"], "hang", start_new_session=True)
    if not wait_until(lambda: len(glob.glob(str(tmp_path / "pid*"))) == 2, 90):
        p.kill()
        pytest.fail(log_tail(tmp_path))
    ranks = _ranks(tmp_path)
    assert shm_names(ranks[0]["prefix"]) == {ranks[0]["prefix"] + "pending"}
    os.killpg(p.pid, signal.SIGINT)
    finish(p, tmp_path, 30)
    _nothing_left(ranks)


@pytest.mark.multiproc
@pytest.mark.parametrize("prefill, decode", [(2, 1), (1, 2)])
def test_two_nodes_on_loopback_form_role_groups_and_move_a_tensor_between_them(tmp_path, prefill, decode):
    """[[RFC-0001:C-DISAGG]]: two torchrun agents joined by the c10d rendezvous, one per role; each node shares
    its own segments, and every prefill rank's tensor reaches its decode rank intact, point to point."""
    procs = two_nodes(tmp_path, "support.torchrun_targets", "disagg", str(tmp_path), prefill=prefill, decode=decode)
    for p, role in zip(procs, ["prefill", "decode"]):
        assert finish(p, tmp_path, 180, log=role) == 0, log_tail(tmp_path, role)
    res = json.loads((tmp_path / "result.json").read_text())
    by_role = {role: [r for r in res if r["role"] == role] for role in ("prefill", "decode")}
    assert [len(by_role["prefill"]), len(by_role["decode"])] == [prefill, decode]
    for role, members in by_role.items():
        ranks = [r["rank"] for r in members]
        assert all(r["node_ranks"] == ranks and r["role_size"] == len(ranks) for r in members)
        assert len({r["node"] for r in members}) == 1
    assert all(r["rows_exact"] and r["names_left"] == [] for r in res)
    order = [r["rank"] for r in by_role["prefill"] + by_role["decode"]]  # prefill first
    for r in res:
        new = order.index(r["rank"])
        assert r["reordered"]["rank"] == new
        assert r["reordered"]["roles"] == ["prefill"] * prefill + ["decode"] * decode
        assert r["reordered"]["rows"] == [[[i, i]] * (i + 1) for i in range(prefill + decode)]
    received = {int(src): ok for r in by_role["decode"] for src, ok in r["received"].items()}
    assert received == {i: True for i in range(prefill)}  # reordered prefill ranks
    assert all(r["roles"] == [x["role"] for x in res] for r in res)
    assert all(r["misuse"][2].startswith("creator ") and "does not cross nodes" in r["misuse"][2] for r in res)
    ranks = _ranks(tmp_path)
    prefixes = {r["node"]: r["prefix"] for r in ranks}
    assert all(prefixes[r["node"]] == r["prefix"] for r in ranks) and len(set(prefixes.values())) == 2
    _nothing_left(ranks)
