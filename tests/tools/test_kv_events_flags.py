"""``--kv-events`` with ``--kv-events-replay`` on the command line: the publisher and its replay socket
are bound before the first step, and a subscriber that connects while the run is under way (missing its
first batches) still hands out every batch, from seq 0, through replay; the batches rebuild, from the
events alone, the caches the simulator ends with (drained: nothing). [[RFC-0001:C-KV-EVENTS]]"""

import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import cpkv.consumers.kv_events_zmq as zmq_mod  # noqa: E402
import cpkv.tools.simulate as simulate_mod  # noqa: E402
from cpkv.consumers.kv_events_zmq import KVEventSubscriber  # noqa: E402
from cpkv.tools.cli import main  # noqa: E402
from support.vllm_kv_events import VLLM, apply  # noqa: E402
from support.ports import free_port  # noqa: E402


def test_a_late_subscriber_sees_every_batch_of_cpkv_simulate_through_replay(monkeypatch, capsys):
    ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    published, bound, done = [], threading.Event(), threading.Event()
    publish, init, execute = zmq_mod.KVEventPublisher.publish, zmq_mod.KVEventPublisher.__init__, \
        simulate_mod.null_execute

    def counting(self, batch):
        published.append(batch)
        return publish(self, batch)

    def binding(self, *a, **kw):
        init(self, *a, **kw)
        assert (self.endpoint, self.replay_endpoint) == (ep, replay_ep)  # bound where asked, before any step
        bound.set()

    def slow(plan):  # a few ms a step, so the run is under way when the subscriber connects
        assert bound.is_set()
        time.sleep(0.004)
        return execute(plan)

    monkeypatch.setattr(zmq_mod.KVEventPublisher, "publish", counting)
    monkeypatch.setattr(zmq_mod.KVEventPublisher, "__init__", binding)
    monkeypatch.setattr(simulate_mod, "null_execute", slow)
    argv = ["simulate", "--workload", "longdoc", "--policies", "least_full", "--lane-pages", "300",
            "--host-pages", "3000", "--no-progress", "--json", "--kv-events", ep, "--kv-events-replay", replay_ep,
            "--kv-events-buffer", "100000"]
    codes = []
    t = threading.Thread(target=lambda: (codes.append(main(argv)), done.set()))
    t.start()
    try:
        assert bound.wait(60)
        while len(published) < 20 and not done.is_set():
            time.sleep(0.01)
        assert not done.is_set(), "the run ended before the subscriber connected"
        got = {}
        with KVEventSubscriber(ep, replay_ep, from_seq=0) as sub:
            while True:
                r = sub.recv(0.05 if not done.is_set() else 0.5)
                if r is not None:
                    got[r[0]] = r[1]
                elif done.is_set():
                    break
            lost, replays = sub.lost, sub.replays
    finally:
        t.join(60)
    assert codes == [0]
    first_live = min(got)
    assert replays >= 1  # the batches sent before it connected came through the replay socket
    assert first_live == 0 and sorted(got) == list(range(len(published))) and lost == 0
    state, media = {}, set()
    for seq in sorted(got):
        from cpkv.consumers.kv_wire import encode_batch

        apply(state, VLLM.decode(encode_batch(got[seq])))
        media |= {m for m, _ in state}
    assert media == {"GPU", "CPU"} and state == {}
