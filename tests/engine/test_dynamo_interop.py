"""A real router reads cpkv's caches: Dynamo's standalone KV indexer follows two ``cpkv run`` workers
through their KV events (vLLM 0.33's wire, with replay), and at several points of the runs its matched
tokens for every request's prompt equal what cpkv's own caches match, on the device and on the host.

Two workers (CP groups of 2 and of 3, both through cpkv's launcher) run traces that share a system prompt, with follow-up turns, evictions to
the host tier and loads back. They are registered as a deployment registers its workers, as their commands
start: worker 1 the moment its ``cpkv run`` is started, before it has bound its sockets (checked), worker 2
as soon as its sockets answer, while the command still imports (no batch sent yet, checked); ``cpkv run``
binds them before anything slow (:mod:`cpkv.tools.kv_events_start`), so the indexer's SUB, which retries an
unbound endpoint only with a growing delay, is connected long before the first batch. The worker that runs
first waits, stopped, from its first batch until the other runs. The runs are paused (SIGSTOP to
each whole process group, every process of it seen stopped in ``/proc``) when the test's own subscriber
has heard enough batches; then every request's prompt is asked of the indexer and compared with the
caches' matches after that batch, which the test recomputes by replaying the worker's scheduler with the
tokens its run generated (``--json``), the replay's events checked byte for byte against the run's. The
same content hashes alike in both CP groups: the system prompt's blocks are one prefix in the indexer for
both workers. [[RFC-0001:C-KV-EVENTS]]
"""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
from support.dynamo_indexer import WHY_NOT, Indexer, free_port  # noqa: E402
from support.vllm_kv_events import VLLM, BlockStored, doc_block_hash, doc_hashes  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]

import msgspec  # noqa: E402

from cpkv.consumers.kv_events_zmq import KVEventSubscriber  # noqa: E402
from cpkv.consumers.kv_wire import encode_batch  # noqa: E402
from cpkv.engine import EngineConfig  # noqa: E402
from cpkv.engine.engine import build_scheduler, connect_kv_events, run_engine_threads  # noqa: E402

S = 16
SYSTEM = [(11 * j + 3) % 256 for j in range(3 * S)]  # three pages every conversation starts with
WORKERS = {1: dict(cp=2, device_pages=6), 2: dict(cp=3, device_pages=4)}
LAG_BATCHES = 1  # how many batches behind the test's subscriber the indexer may be at a pause (see there)
PAUSE_AT = {1: (8, 12, 16), 2: (8, 14)}  # a pause when either worker has had this many batches heard


def trace(path: Path, worker: int) -> str:
    """Conversations on the shared system prompt: a question, then two follow-up turns each."""
    lines = []
    for c in range(6):
        q = [(37 * worker + 13 * c + 7 * j) % 256 for j in range(18 + 3 * c)]
        lines.append({"id": f"w{worker}c{c}", "arrival": 4 * c, "tokens": SYSTEM + q, "max_new_tokens": 6})
        for t in (1, 2):
            lines.append({"id": f"w{worker}c{c}t{t}", "arrival": 0, "after": lines[-1]["id"], "delay": 2,
                          "tokens": [(5 * t + 3 * c + j) % 256 for j in range(9)], "max_new_tokens": 4})
    p = path / f"worker{worker}.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(p)


def config(worker: int, workload: str) -> EngineConfig:
    w = WORKERS[worker]
    return EngineConfig(cp_size=w["cp"], page_size=S, device_pages=w["device_pages"], host_pages=48, chunk=40,
                        workload=workload)


class Recorder:
    """A publisher that keeps each batch's payload, as the wire carries it."""

    def __init__(self):
        self.payloads = []

    def publish(self, batch):
        self.payloads.append(encode_batch(batch))
        return len(self.payloads) - 1


def final_prompts(cfg: EngineConfig, generated: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every request's whole prompt: a follow-up's is its parent's prompt and replies, then its own tokens."""
    out = {}
    for spec in cfg.trace():
        out[spec.id] = list(spec.tokens) if spec.after is None else \
            out[spec.after] + generated[spec.after] + list(spec.tokens)
    return out


def replay(cfg: EngineConfig, generated: dict[str, list[int]], prompts: dict[str, list[int]]):
    """The worker's scheduler replayed with its run's tokens, flushed once a step as the engine does:
    the payload of every batch, and after each batch the caches' matches of every prompt, in whole pages
    as a router counts blocks: seq -> {id: (device tokens, device-or-host tokens)}. Also the run's figures
    of the tiers (evicted, backed up, loaded pages)."""
    sched = build_scheduler(cfg, cfg.trace())
    rec = Recorder()
    sink = connect_kv_events(sched, rec)
    truth = {}

    def matches():
        out = {}
        for rid, prompt in prompts.items():
            dev = sched.cache.lookup(prompt, max_length=len(prompt)).length // S * S
            host = sched.host.index.lookup(prompt, max_length=len(prompt)).length // S * S
            out[rid] = (dev, max(dev, host))
        return out

    while not sched.done:
        sched.skip_idle()
        plan = sched.plan()
        sched.complete(plan, [[generated[r.spec.id][len(r.generated)] if s else 0
                               for r, s in zip(b.requests, b.sample)] for b in plan.forwards()])
        if sink.flush():
            truth[len(rec.payloads) - 1] = matches()
    st = sched.stats
    tiers = dict(evicted=st.evicted_pages, backed_up=st.backup_pages, loaded=st.host_hit_tokens // S)
    sched.drain()
    if sink.flush():
        truth[len(rec.payloads) - 1] = matches()
    return truth, rec.payloads, tiers


def start_worker(w: int, workload: str, ep: str, replay_ep: str, out_path: Path) -> subprocess.Popen:
    """``cpkv run`` for worker ``w`` through cpkv's own launcher, its ranks spawned, in its own process group
    (so a pause stops every rank of it). Both workers are CP groups of several ranks: a group of one runs its
    whole trace in about 0.1 s, faster than a pause can find it in the middle of its run or the indexer can
    replay it once registered."""
    c = WORKERS[w]
    argv = [sys.executable, "-m", "cpkv", "run", "--cp", str(c["cp"]), "--page", str(S), "--device-pages",
            str(c["device_pages"]), "--host-pages", "48", "--chunk", "40", "--workload", workload, "--json",
            "--timeout", "120", "--kv-events", ep, "--kv-events-replay", replay_ep]
    env = dict(os.environ)
    return subprocess.Popen(argv, stdout=open(out_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)


def group_pids(procs) -> list[int]:
    """Every living process of the workers' process groups (the launcher, its ranks, their helpers)."""
    groups, out = {p.pid for p in procs}, []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in groups and fields[0] != "Z":
                out.append(int(d))
    return out


def signal_group(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def pause(procs, timeout_s: float = 10.0) -> None:
    """SIGSTOP to every worker's process group, returning once each of their processes is stopped (polled in
    ``/proc``): from then on no batch is published until :func:`signal_group` sends SIGCONT."""
    signal_group(procs, signal.SIGSTOP)
    end = time.monotonic() + timeout_s
    while True:
        running = []
        for pid in group_pids(procs):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in "Tt":
                        running.append(pid)
            except OSError:
                pass
        if not running:
            return
        assert time.monotonic() < end, f"processes {running} did not stop"
        time.sleep(0.005)


def accepts(endpoint: str) -> bool:
    """Whether something is bound on ``endpoint`` (``tcp://127.0.0.1:PORT``) now: a TCP connect succeeds."""
    try:
        socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), timeout=0.05).close()
        return True
    except OSError:
        return False


def wait_equal(indexer, prompts, truth_of, timeout_s: float = 5.0):
    """Ask every prompt until the indexer's answers equal ``truth_of`` (the indexer applies events on its
    own time) or the deadline passes; returns the last answers and the truths."""
    end = time.monotonic() + timeout_s
    while True:
        got, want = {}, {}
        for w, ps in prompts.items():
            for rid, prompt in ps.items():
                got[w, rid] = indexer.matched(prompt).get(w, (0, 0))
                want[w, rid] = truth_of[w][rid]
        if got == want or time.monotonic() > end:
            return got, want
        time.sleep(0.02)


def test_dynamo_indexer_matches_cpkvs_caches_through_cpkv_run(tmp_path, llama):
    t0 = time.perf_counter()
    workloads = {w: trace(tmp_path, w) for w in WORKERS}
    # each worker's generated tokens, from the same engine with its ranks as threads: every prompt known
    generated = {w: {o["id"]: o["generated"] for o in run_engine_threads(config(w, workloads[w]), llama)["outputs"]}
                 for w in WORKERS}
    prompts, truth, payloads = {}, {}, {}
    for w in WORKERS:
        prompts[w] = final_prompts(config(w, workloads[w]), generated[w])
        truth[w], payloads[w], tiers = replay(config(w, workloads[w]), generated[w], prompts[w])
        assert min(tiers.values()) > 0, f"worker {w} must evict to the host and load back: {tiers}"
    # every block's hash is the documented function of (parent hash, its page's tokens, the key): the system
    # prompt's blocks are the same blocks in the CP group of 2 and in the CP group of 3
    for w in WORKERS:
        stored = {}
        for p in payloads[w]:
            for ev in VLLM.decode(p).events:
                if isinstance(ev, BlockStored):
                    assert ev.block_size == S
                    parent = ev.parent_block_hash
                    for j, h in enumerate(ev.block_hashes):
                        page = ev.token_ids[j * S:(j + 1) * S]
                        assert h == doc_block_hash(parent, page), (w, h)
                        stored[h], parent = page, h
        assert set(doc_hashes(SYSTEM, S)) <= set(stored), f"worker {w} never announced the system prompt's blocks"
    assert all(len(payloads[w]) > PAUSE_AT[w][-1] + 2 for w in WORKERS), "a trace is too short for its pauses"

    eps = {w: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for w in WORKERS}
    procs, heard, checks = {}, {w: {} for w in WORKERS}, []
    with Indexer(tmp_path / "indexer.log") as indexer:
        subs = {w: KVEventSubscriber(*eps[w], from_seq=0) for w in WORKERS}
        try:
            pauses, hold = {w: list(PAUSE_AT[w]) for w in WORKERS}, {}
            procs[1] = start_worker(1, workloads[1], *eps[1], tmp_path / "worker1.out")
            assert not accepts(eps[1][0]), "worker 1's sockets were bound before it could be registered first"
            indexer.register(1, *eps[1], block_size=S)  # the command just started: nothing bound yet
            procs[2] = start_worker(2, workloads[2], *eps[2], tmp_path / "worker2.out")
            end = time.monotonic() + 60
            while not accepts(eps[2][0]):  # worker 2's sockets answer: its command is still importing
                assert procs[2].poll() is None and time.monotonic() < end, (tmp_path / "worker2.out").read_text()
                time.sleep(0.002)
            indexer.register(2, *eps[2], block_size=S)
            t_reg = time.perf_counter()

            def hear(quiet_s, until=None):
                """Take what the subscribers have until none came for ``quiet_s`` (or ``until()`` holds)."""
                last = time.monotonic()
                while True:
                    for w, sub in subs.items():
                        while (got := sub.recv(0.002)) is not None:
                            heard[w][got[0]] = got[1]
                            last = time.monotonic()
                    if (until and until()) or time.monotonic() - last >= quiet_s:
                        return

            deadline = time.monotonic() + 240
            while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
                for w, sub in subs.items():  # one batch a worker at a time: the decisions below come in time
                    if (got := sub.recv(0.005)) is not None:
                        heard[w][got[0]] = got[1]
                        if w == 2 and len(heard[2]) == 1:  # a run binds at its start, not just before its first batch
                            assert time.perf_counter() - t_reg > 0.2, "worker 2 bound its sockets only as it ran"
                # the worker that runs first waits, stopped, from its first batch until the other runs, so that the
                # pauses find both in the middle of their runs
                for w, other in ((1, 2), (2, 1)):
                    if hold.get(w) is None and heard[w] and not heard[other]:
                        signal_group([procs[w]], signal.SIGSTOP)
                        hold[w] = "held"
                    elif hold.get(w) == "held" and heard[other]:
                        signal_group([procs[w]], signal.SIGCONT)
                        hold[w] = "released"
                ready = "held" not in hold.values() and all(heard[w] for w in WORKERS)  # both under way
                due = [w for w in WORKERS if pauses[w] and heard[w] and max(heard[w]) >= pauses[w][0]]
                if ready and due:
                    for w in WORKERS:
                        while pauses[w] and heard[w] and max(heard[w]) >= pauses[w][0]:
                            pauses[w].pop(0)
                    try:
                        pause(procs.values())
                        hear(0.1)  # everything the paused publishers had sent
                        last = {w: max(heard[w]) for w in WORKERS}
                        # SIGSTOP may stop a publisher's I/O thread between its sockets, so the newest batch the
                        # test's subscriber heard can still wait there for the indexer's: the indexer must hold
                        # cpkv's caches exactly as they were after one of the last LAG_BATCHES batches (the end,
                        # below, after every batch arrived, is checked at the last batch exactly)
                        at, got, want = None, None, None
                        end = time.monotonic() + 5
                        while at is None and time.monotonic() < end:
                            for back in itertools.product(range(LAG_BATCHES + 1), repeat=len(WORKERS)):
                                b = {w: max(last[w] - k, 0) for w, k in zip(WORKERS, back)}
                                got, want = wait_equal(indexer, prompts, {w: truth[w][b[w]] for w in WORKERS},
                                                       timeout_s=0.2)
                                if got == want:
                                    at = b
                                    break
                        checks.append((last, at is not None))
                        assert at is not None, (last, {k: (got[k], want[k]) for k in got if got[k] != want[k]})
                    finally:
                        signal_group(procs.values(), signal.SIGCONT)
            for w, p in procs.items():
                assert p.wait(60) == 0, (tmp_path / f"worker{w}.out").read_text()[-3000:]
            # the publishers have closed: every batch they sent comes (the test fails below if one is missing)
            hear(5, until=lambda: all(len(heard[w]) >= len(payloads[w]) for w in WORKERS))
            last = {w: max(heard[w]) for w in WORKERS}
            got, want = wait_equal(indexer, prompts, {w: truth[w][last[w]] for w in WORKERS})
            checks.append((last, got == want))
            assert got == want  # drained: nothing is cached anywhere, and the indexer says so
            log = indexer.log()
        finally:
            signal_group(procs.values(), signal.SIGCONT)
            signal_group(procs.values(), signal.SIGKILL)
            for p in procs.values():
                p.wait(10)
            for sub in subs.values():
                sub.close()
        end = time.monotonic() + 10  # a killed rank is gone a moment after its launcher
        while (left := group_pids(procs.values())) and time.monotonic() < end:
            time.sleep(0.01)
        assert not left, f"processes {left} of the workers outlived the test"
    assert indexer.proc.poll() is not None, "the indexer outlived the test"
    assert len(checks) >= 4, checks  # three pauses or more, and the end
    for w in WORKERS:
        text = (tmp_path / f"worker{w}.out").read_text()
        out = json.loads(text[text.index("{"):text.rindex("}") + 1])
        assert {o["id"]: o["generated"] for o in out["outputs"]} == generated[w]  # the run the truth replayed
        assert sorted(heard[w]) == list(range(len(payloads[w])))  # every batch, in order, none lost
        body = lambda payload: msgspec.msgpack.decode(payload)[1]  # noqa: E731  (the events, as the wire has them)
        assert [body(encode_batch(heard[w][i])) for i in sorted(heard[w])] == [body(p) for p in payloads[w]]
    assert "Failed to find parent block" not in log and "ERROR" not in log, log[-3000:]
    assert "decode" not in log.lower(), log[-3000:]  # no batch the indexer could not read
    print(f"interop: {len(checks)} checks at batches {[c[0] for c in checks]} of {[len(payloads[w]) for w in WORKERS]}, "
          f"{time.perf_counter() - t0:.1f} s")
