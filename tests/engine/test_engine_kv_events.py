"""The engine publishes its prefix cache as KV events (``RunConfig.kv_events``,
``cpkv run --kv-events``): a subscriber written from vLLM's schema
(:mod:`support.vllm_kv_events`, never cpkv's classes) rebuilds, from the events
alone, exactly the blocks the device cache (``GPU``) and the host tier
(``CPU``) hold, after a run with evictions, host backups and restores; a
subscriber that never reads does not hold the engine up.
[[RFC-0001:C-KV-EVENTS]] [[RFC-0001:C-HICACHE]] [[RFC-0001:C-PREFIX-CACHE]]"""

import socket
import threading
import time

import pytest
import torch

torch.set_num_threads(1)

zmq = pytest.importorskip("zmq")

from zmq.utils.monitor import recv_monitor_message  # noqa: E402

from cpkv.engine import EngineConfig, engine as engine_module, run_engine_threads  # noqa: E402
from cpkv.engine.scheduler import Scheduler  # noqa: E402
from support.vllm_kv_events import VLLM, apply, doc_hashes  # noqa: E402

S = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cached_blocks(sched) -> dict:
    """(medium, hash) -> (parent hash, tokens) of every full page the caches hold, by their own trees."""
    out = {}
    tiers = [(sched.cache.tree, "GPU")] + ([(sched.host.index.tree, "CPU")] if sched.host is not None else [])
    for tree, medium in tiers:
        for n in tree.nodes():
            toks = tree.prefix_tokens(n)
            start, full = (len(toks) - len(n.key)) // S, len(n.key) // S
            hs = doc_hashes(list(toks), S, key=n.ns or None)
            for i in range(start, start + full):
                out[(medium, hs[i])] = (hs[i - 1] if i else None, tuple(toks[i * S:(i + 1) * S]))
    return out


class Listener:
    """A SUB socket connected before the engine binds, reading in a thread; and
    optionally a second one that never reads (a stalled router)."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RECONNECT_IVL, 5)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.connected = threading.Event()
        self.sub.connect(endpoint)
        self.stalled = self.ctx.socket(zmq.SUB)
        self.stalled.setsockopt(zmq.SUBSCRIBE, b"")
        self.stalled.setsockopt(zmq.RCVHWM, 1)
        self.stalled.setsockopt(zmq.RCVBUF, 1024)
        self.stalled.connect(endpoint)
        self.frames: dict[int, bytes] = {}
        self.last = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            if not self.connected.is_set() and self.monitor.poll(0):
                recv_monitor_message(self.monitor)
                self.connected.set()
            if self.sub.poll(20):
                topic, seq, payload = self.sub.recv_multipart()
                assert len(seq) == 8
                self.frames[int.from_bytes(seq, "big")] = payload
                self.last = time.monotonic()

    def close(self, idle_s: float = 0.5, timeout_s: float = 10.0):
        end = time.monotonic() + timeout_s
        while time.monotonic() - self.last < idle_s and time.monotonic() < end:
            time.sleep(0.05)
        self.stop.set()
        self.thread.join(5)
        self.sub.disable_monitor()
        self.monitor.close(0)
        self.sub.close(0)
        self.stalled.close(0)
        self.ctx.term()


def test_a_vllm_subscriber_rebuilds_the_caches_blocks_after_evictions_backups_and_restores(llama, monkeypatch):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    at_end = {}
    drain = Scheduler.drain

    def record_then_drain(self):  # the trace is done and every step flushed; the caches still hold their blocks
        if self.cache.events is not None:
            at_end.update(seq=self.cache.events.last_seq, blocks=cached_blocks(self))
        drain(self)

    monkeypatch.setattr(Scheduler, "drain", record_then_drain)
    listener = Listener(endpoint)
    connect = engine_module.connect_kv_events

    def connect_once_subscribed(sched, pub):  # a PUB drops what it sends before a subscriber joins (slow joiner)
        assert listener.connected.wait(20), "the subscriber never connected"
        time.sleep(0.1)  # the subscription travels after the handshake
        return connect(sched, pub)

    monkeypatch.setattr(engine_module, "connect_kv_events", connect_once_subscribed)
    try:
        t0 = time.perf_counter()
        r = run_engine_threads(EngineConfig(cp_size=2, page_size=S, device_pages=6, host_pages=48, requests=5,
                                            scale=0.08, chunk=40, kv_events=endpoint), llama)
        seconds = time.perf_counter() - t0
    finally:
        listener.close()
    assert r["evicted_pages"] > 0 and r["backup_pages"] > 0 and r["load_pages"] > 0, "the trace must exercise both tiers"
    frames = listener.frames
    assert sorted(frames) == list(range(len(frames))), "a batch was lost (or the stream began late)"
    assert at_end["seq"] is not None and at_end["seq"] < len(frames) - 1
    state, media = {}, set()
    for seq in sorted(frames):
        batch = VLLM.decode(frames[seq])
        assert batch.data_parallel_rank == 0
        apply(state, batch)
        media |= {m for m, _ in state}
        if seq == at_end["seq"]:
            assert state == at_end["blocks"], "the events' blocks differ from the caches' own at the end of the trace"
    assert media == {"GPU", "CPU"}
    assert state == {}, "the drained caches hold nothing, and the events say so"
    assert seconds < 120


def test_without_kv_events_the_caches_have_no_sink(llama, monkeypatch):
    seen = []
    drain = Scheduler.drain

    def spy(self):
        seen.append((self.cache.events, self.host.index.events if self.host is not None else None))
        drain(self)

    monkeypatch.setattr(Scheduler, "drain", spy)
    run_engine_threads(EngineConfig(cp_size=2, page_size=S, device_pages=6, host_pages=48, requests=2,
                                    scale=0.05, chunk=24), llama)
    assert seen and all(s == (None, None) for s in seen)
