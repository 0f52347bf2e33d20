"""``cpkv run --kv-events``: the sockets bound as the command starts, before it imports torch, and rank 0's
batches relayed through the process that bound them, numbered, sent and buffered there: a subscriber hears
every batch in order, live or by replay. (Dynamo's indexer registered before the bind and during the imports:
tests/engine/test_dynamo_interop.py.) [[RFC-0001:C-KV-EVENTS]]"""

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from cpkv.consumers.kv_events_zmq import KVEventPublisher, KVEventRelay, KVEventSubscriber  # noqa: E402
from cpkv.consumers.kv_wire import AllBlocksCleared, BlockRemoved, KVEventBatch  # noqa: E402
from cpkv.tools.kv_events_start import bind_at_start  # noqa: E402
from support.ports import free_port  # noqa: E402


def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_run_binds_before_torch_is_imported():
    """In a fresh process ``bind_at_start`` binds both sockets and a relay, torch and numpy not yet imported."""
    ep, rep = endpoints()
    code = ("import sys\nfrom cpkv.tools.kv_events_start import bind_at_start\n"
            f"p = bind_at_start(['run', '--cp', '2', '--kv-events', '{ep}', '--kv-events-replay', '{rep}'])\n"
            "print(p.endpoint, p.replay_endpoint, p.relay_endpoint is not None, 'torch' in sys.modules, "
            "'numpy' in sys.modules)\np.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [ep, rep, "True", "False", "False"]


def test_bind_at_start_leaves_the_rest_to_the_command():
    """Another command, no ``--kv-events``, a malformed flag, one endpoint twice or a busy port: nothing bound
    here (the command's own check refuses the wrong ones in one line)."""
    ep, rep = endpoints()
    with KVEventPublisher(ep) as busy:
        for argv in (["simulate", "--kv-events", rep], ["run", "--cp", "2"], ["run", "--kv-events", "nope"],
                     ["run", "--kv-events", rep, "--kv-events-replay", rep], ["run", "--kv-events", busy.endpoint],
                     []):
            assert bind_at_start(argv) is None, argv
    pub = bind_at_start(["run", "--kv-events", rep, "--kv-events-buffer", "7"])
    try:
        assert pub.endpoint == rep and pub.replay_endpoint is None and pub._buffer.maxlen == 7
    finally:
        pub.close()


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="GPU")])


def test_relayed_batches_are_numbered_sent_and_replayed_in_order():
    """A relay's batches, and the publisher's own, get one sequence in arrival order, the relay's stamped with
    ``data_parallel_rank``; a subscriber that connects late replays them from seq 0; ``close`` waits for what
    the relay sent just before it closed."""
    ep, rep = endpoints()
    pub = KVEventPublisher(ep, rep, relay=True)
    relay = KVEventRelay(pub.relay_endpoint)
    assert pub.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()])) == 0
    time.sleep(0.05)
    for i in range(1, 30):
        assert relay.publish(_batch(i)) is None
    with KVEventSubscriber(ep, rep, from_seq=0) as sub:
        deadline = time.monotonic() + 10
        while pub.sent < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sub.catch_up() == 30
        got = [sub.recv(1.0) for _ in range(30)]
        assert [seq for seq, _ in got] == list(range(30))
        assert [b.events[0].block_hashes for _, b in got[1:]] == [[i] for i in range(1, 30)]
        assert all(b.data_parallel_rank == 0 for _, b in got)
        def last_batches():  # still coming when the publisher is asked to close: it takes them until quiet
            for i in range(30, 40):
                relay.publish(_batch(i))
                time.sleep(0.02)
            relay.close()

        t = threading.Thread(target=last_batches)
        t.start()
        pub.close()
        t.join()
        assert pub.sent == 40 and [sub.recv(1.0)[0] for _ in range(10)] == list(range(30, 40))
    with pytest.raises(RuntimeError):
        relay.publish(_batch(0))
    with KVEventRelay(ep) as other, pytest.raises(TypeError):
        other.publish("not a batch")
