"""KV events in vLLM's format ([[RFC-0001:C-KV-EVENTS]]).

The consumer here is written from vLLM 0.33's published schema (tagged maps in a
positional batch, in :mod:`support.vllm_kv_events`), never from cpkv's classes, and the block hash is recomputed from its documented
definition with ``struct`` and ``hashlib``. Every socket is on 127.0.0.1 with a
port the OS picks; every wait has a deadline of a few seconds."""

import hashlib
import struct
import threading
import time

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from hypothesis import given, strategies as st  # noqa: E402

from cpkv.consumers import kv_events as ke, kv_wire as kw  # noqa: E402
from cpkv.consumers.kv_events_zmq import KVEventPublisher, KVEventSubscriber  # noqa: E402
from support import vllm_kv_events as vllm  # noqa: E402
from support.vllm_kv_events import VLLM, apply, as_old, doc_hashes  # noqa: E402

# a publisher thread that dies of an exception fails the test it dies in
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")

LOCAL = "tcp://127.0.0.1:*"
S = 4


def model(state: dict, op) -> None:
    """What the blocks should be after ``op``, from the documented hash alone."""
    kind, chain, first, n, medium = op
    if kind == "clear":
        state.clear()
        return
    hs = doc_hashes(chain, S)
    for i in range(first, first + n):
        if kind == "store":
            state[(medium, hs[i])] = (hs[i - 1] if i else None, tuple(chain[i * S:(i + 1) * S]))
        else:
            state.pop((medium, hs[i]), None)


def run_op(sink, op) -> None:
    kind, chain, first, n, medium = op
    if kind == "clear":
        sink.cleared()
    else:
        getattr(sink, "stored" if kind == "store" else "removed")(chain, first, n, medium=medium)


class Collect:
    """A publisher that keeps what it is handed, encoded as the wire carries it."""

    def __init__(self):
        self.payloads = []

    def publish(self, batch):
        self.payloads.append(msgspec.msgpack.encode(batch))


def deadline_loop(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        yield
    raise AssertionError(f"not done within {seconds} s")


# -- the hash ----------------------------------------------------------------------------
@given(st.lists(st.integers(0, 2**40), max_size=40), st.integers(1, 8),
       st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5), st.integers(-5, 10**12)))
def test_block_hashes_follow_the_documented_definition(tokens, page_size, key):
    got = ke.block_hashes(tokens, page_size, key)
    assert got == doc_hashes(tokens, page_size, key)
    assert len(got) == len(tokens) // page_size and all(0 <= h < 2**63 for h in got)
    # a block's hash names its whole prefix: a shorter chain shares the head
    assert ke.block_hashes(tokens[: len(tokens) // 2], page_size, key) == got[: len(tokens) // 2 // page_size]


def test_block_hash_pinned_value():
    """One value written down from the definition, so that a change of the definition shows."""
    msg = struct.pack(">I", 2) + b"m1" + struct.pack(">Q", 0) + struct.pack(">4Q", 1, 2, 3, 4)
    want = int.from_bytes(hashlib.sha256(msg).digest()[:8], "big") & (2**63 - 1)
    assert ke.block_hashes([1, 2, 3, 4, 5], 4, "m1") == [want]
    assert ke.block_hashes([1, 2, 3, 4], 4) != [want]  # the key is hashed in


@pytest.mark.parametrize("call, err", [
    (lambda: ke.block_hashes([1, 2], 0), ValueError),
    (lambda: ke.block_hashes([1, 2], 2.0), TypeError),
    (lambda: ke.block_hashes([1, -2], 2), ValueError),
    (lambda: ke.block_hashes([1.0, 2.0], 2), TypeError),
    (lambda: ke.block_hashes([1, 2], 2, key=3.5), TypeError),
    (lambda: ke.block_hashes([1, 2], 2, key=True), TypeError),
])
def test_block_hashes_refuses_bad_input(call, err):
    with pytest.raises(err):
        call()


# -- the schema, without a network -----------------------------------------------------------
ops = st.lists(st.tuples(
    st.sampled_from(["store", "store", "remove", "clear"]),
    st.lists(st.integers(0, 3), min_size=S, max_size=5 * S),
    st.integers(0, 4), st.integers(0, 4),
    st.sampled_from([ke.MEDIUM_DEVICE, ke.MEDIUM_HOST]),
).map(lambda o: (o[0], o[1], min(o[2], len(o[1]) // S), min(o[3], len(o[1]) // S - min(o[2], len(o[1]) // S)), o[4])),
    max_size=12)


def without_group(batch):
    return msgspec.structs.replace(batch, events=[
        msgspec.structs.replace(e, group_idx=None) if hasattr(e, "group_idx") else e for e in batch.events])


@given(ops, st.booleans())
def test_vllm_consumer_rebuilds_the_blocks(script, auto_flush):
    """Any script of stored/removed/cleared calls, decoded with vLLM's schema,
    leaves a router with exactly the blocks the documented hash predicts."""
    pub = Collect()
    sink = ke.KVEventSink(pub, S, auto_flush=auto_flush)
    want, got = {}, {}
    for op in script:
        run_op(sink, op)
        model(want, op)
    sink.flush()
    assert sink.pending == [] and sink.flush() == 0
    for p in pub.payloads:
        batch = VLLM.decode(p)
        apply(got, batch)
        raw = msgspec.msgpack.decode(p)  # the shape itself: a positional batch of tagged maps
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] is None
        assert all(isinstance(e, dict) and e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
                   for e in raw[1])
        assert all(e.get("group_idx", 0) == 0 and {"lora_id", "medium", "lora_name"} <= e.keys()
                   for e in raw[1] if e["type"] == "BlockStored")
        # cpkv reads the old form alike (which has no group_idx)
        assert kw.decode_batch(as_old(batch)) == without_group(kw.decode_batch(p))
    assert got == want


def test_sink_refuses_bad_calls_and_queues_nothing():
    sink = ke.KVEventSink(Collect(), S)
    chain = list(range(10))  # two full pages and a partial one
    for bad, err in [
        (lambda: sink.stored(chain, 2, 1), ValueError),       # page 2 is partial
        (lambda: sink.stored(chain, -1, 1), ValueError),
        (lambda: sink.removed(chain, 0, 3), ValueError),
        (lambda: sink.stored(chain, 0, 1, medium=""), TypeError),
        (lambda: sink.stored(chain, 0, 1, medium=None), TypeError),
        (lambda: sink.stored([0.5] * 8, 0, 1), TypeError),
        (lambda: sink.stored(chain, 0, 1, key=1.5), TypeError),
    ]:
        with pytest.raises(err):
            bad()
    assert sink.pending == []
    with pytest.raises(TypeError):
        ke.KVEventSink(object(), S)
    with pytest.raises(ValueError):
        ke.KVEventSink(Collect(), 0)
    assert sink.stored(chain, 2) == [] and sink.pending == []  # no full page named: no event


# -- the wire ------------------------------------------------------------------------------
def replay_raw(endpoint, start, timeout_s=2.0):
    """vLLM's replay protocol from scratch: a DEALER (a REQ keeps only the first reply)."""
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = {}
    try:
        for _ in deadline_loop(timeout_s):
            if d.poll(100):
                empty, topic, seq, payload = d.recv_multipart()  # the live stream's three frames (vLLM #45177)
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    assert topic == payload == b""
                    return out
                out[int.from_bytes(seq, "big")] = (topic, payload)
    finally:
        d.close(0)
        ctx.term()


SCRIPT = [
    ("store", list(range(12)), 0, 3, ke.MEDIUM_DEVICE),
    ("store", list(range(8)) + [7, 7, 7, 7, 1], 2, 1, ke.MEDIUM_DEVICE),  # a branch off the first chain
    ("store", list(range(12)), 1, 2, ke.MEDIUM_HOST),                     # backed up to the host
    ("remove", list(range(12)), 1, 2, ke.MEDIUM_DEVICE),                  # then evicted from the device
    ("clear", None, 0, 0, None),
    ("store", [5] * 9, 0, 2, ke.MEDIUM_HOST),
    ("store", list(range(12)), 0, 1, ke.MEDIUM_DEVICE),
]


def test_vllm_subscriber_over_zmq_rebuilds_the_blocks():
    """cpkv's payloads on the wire, read by a subscriber written from vLLM's
    schema: frames (topic, 8-byte seq, payload), seq 0.. in order, replay to the
    end marker, and the rebuilt blocks are exactly the script's."""
    with KVEventPublisher(LOCAL, LOCAL, topic="kv") as pub:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        sink = ke.KVEventSink(pub, S, auto_flush=True)
        want = {}
        for op in SCRIPT:
            run_op(sink, op)
            model(want, op)
        live = {}
        try:
            for _ in deadline_loop(3):
                if len(live) == len(SCRIPT) or not sub.poll(300):
                    break
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                live[int.from_bytes(seq, "big")] = payload
        finally:
            sub.close(0)
            ctx.term()
        replayed = replay_raw(pub.replay_endpoint, 0)
        tail = replay_raw(pub.replay_endpoint, 4)
    assert sorted(replayed) == list(range(len(SCRIPT)))  # the whole stream, in order, then the end
    assert sorted(tail) == list(range(4, len(SCRIPT))) and all(tail[s] == replayed[s] for s in tail)
    assert all(replayed[s] == (b"kv", p) for s, p in live.items())  # live and replay carry the same frames
    got = {}
    for s in sorted(replayed):
        batch = VLLM.decode(replayed[s][1])
        assert batch.data_parallel_rank == 0
        apply(got, batch)
    assert got == want
    assert {m for m, _ in got} == {ke.MEDIUM_HOST, ke.MEDIUM_DEVICE}


def batch_of(i):
    return kw.KVEventBatch(ts=float(i), events=[kw.AllBlocksCleared()])


def test_late_subscriber_recovers_the_gap_through_replay():
    with KVEventPublisher(LOCAL, LOCAL) as pub:
        for i in range(5):
            pub.publish(batch_of(i))
        for _ in deadline_loop(3):  # sent before anyone listens (publish only queues): the subscriber must replay
            if pub.sent == 5:
                break
            time.sleep(0.01)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=0) as sub:
            got = []
            for _ in deadline_loop(3):  # a live batch at a time until the subscriber hears one
                pub.publish(batch_of(len(got) + 100))
                if (r := sub.recv(0.05)) is not None:
                    got.append(r)
                    break
            got += list(sub.batches(0.3))
            assert [s for s, _ in got] == list(range(len(got)))
            assert [b.ts for _, b in got[:5]] == [0.0, 1.0, 2.0, 3.0, 4.0]
            assert sub.lost == 0 and sub.replays >= 1


def test_catch_up_then_live_hands_each_seq_out_once():
    """A batch both replayed by catch_up and heard live is handed out once."""
    with KVEventPublisher(LOCAL, LOCAL) as pub:
        pub.publish(batch_of(0))
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            time.sleep(0.3)  # the SUB is connected: what follows is also heard live
            for i in range(1, 6):
                pub.publish(batch_of(i))
            for _ in deadline_loop(3):
                if pub.sent == 6:
                    break
                time.sleep(0.01)
            assert sub.catch_up() == 6
            got = list(sub.batches(0.3))
            pub.publish(batch_of(6))
            got += list(sub.batches(0.3))
            assert [s for s, _ in got] == list(range(7)) and [b.ts for _, b in got] == list(map(float, range(7)))
            assert sub.lost == 0


def test_dropped_message_is_recovered_through_replay():
    """A proxy between publisher and subscriber drops every seq = 3 mod 7 on the
    live stream; the subscriber still hands out every batch, in order, once."""
    with KVEventPublisher(LOCAL, LOCAL) as pub:
        ctx = zmq.Context()
        up, down = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        up.setsockopt(zmq.SUBSCRIBE, b"")
        up.connect(pub.endpoint)
        down.bind("tcp://127.0.0.1:*")
        dropped, stop = [], threading.Event()

        def proxy():
            while not stop.is_set():
                if up.poll(20):
                    frames = up.recv_multipart()
                    seq = int.from_bytes(frames[1], "big")
                    if seq % 7 == 3:
                        dropped.append(seq)
                    else:
                        down.send_multipart(frames)

        t = threading.Thread(target=proxy)
        t.start()
        try:
            with KVEventSubscriber(down.getsockopt_string(zmq.LAST_ENDPOINT), pub.replay_endpoint) as sub:
                got = []
                for _ in deadline_loop(4):
                    pub.publish(batch_of(0))
                    got += [r for r in iter(lambda: sub.recv(0.02), None)]
                    if got and got[-1][0] >= 30:
                        break
                assert [s for s, _ in got] == list(range(len(got)))
                assert sub.lost == 0
                live_from = got[0][0]
                assert any(d > live_from for d in dropped)  # a gap was on the live stream
        finally:
            stop.set()
            t.join(2)
            up.close(0)
            down.close(0)
            ctx.term()


class StalledPublisher(KVEventPublisher):
    """The sending thread waits for ``go``: every publish meets a busy thread."""

    def __init__(self, *a, **kw):
        self.go = threading.Event()
        super().__init__(*a, **kw)

    def _run(self):
        self.go.wait(5)
        super()._run()


def test_slow_or_stalled_side_never_blocks_the_engine_and_memory_stays_bounded():
    n, q = 10_000, 100
    with StalledPublisher(LOCAL, LOCAL, max_queue=q, buffer_steps=q) as pub:
        ctx = zmq.Context()
        deaf = ctx.socket(zmq.SUB)  # a subscriber that never reads
        deaf.setsockopt(zmq.SUBSCRIBE, b"")
        deaf.connect(pub.endpoint)
        batch = kw.KVEventBatch(ts=0.0, events=[kw.BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=list(range(S)), block_size=S,
            lora_id=None, medium=ke.MEDIUM_DEVICE, lora_name=None)])
        t0 = time.perf_counter()
        for i in range(n):
            assert pub.publish(batch) == i
            assert len(pub._queue) <= q
        elapsed = time.perf_counter() - t0
        assert elapsed < 2.0, elapsed
        assert pub.dropped == n - q
        pub.go.set()
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            for _ in deadline_loop(3):
                if pub.sent == q:
                    break
                time.sleep(0.01)
            assert sub.catch_up() == q  # what survived: the newest q, in order
            got = list(sub.batches(0.1))
            assert [s for s, _ in got] == list(range(n - q, n))
            assert sub.lost == n - q and sub.lost_ranges == [(0, n - q)]
        # a deaf subscriber does not block the running thread either
        t0 = time.perf_counter()
        for _ in range(n):
            pub.publish(batch)
        assert time.perf_counter() - t0 < 2.0
        for _ in deadline_loop(3):
            if pub.sent + pub.dropped == 2 * n:
                break
            time.sleep(0.01)
        assert len(pub._buffer) <= q
        deaf.close(0)
        ctx.term()


def test_close_leaves_no_thread_and_frees_the_ports():
    before = set(threading.enumerate())
    pub = KVEventPublisher(LOCAL, LOCAL)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    pub.publish(batch_of(0))
    sub.catch_up()
    ends = pub.endpoint, pub.replay_endpoint
    sub.close()
    pub.close()
    pub.close()
    sub.close()  # idempotent
    assert set(threading.enumerate()) == before
    with pytest.raises(RuntimeError):
        pub.publish(batch_of(1))
    again = KVEventPublisher(*ends)  # the same ports bind again: the sockets are gone
    assert (again.endpoint, again.replay_endpoint) == ends
    again.close()
    assert set(threading.enumerate()) == before


def test_publisher_refuses_bad_arguments_and_leaks_nothing():
    before = set(threading.enumerate())
    with KVEventPublisher(LOCAL) as pub:
        with pytest.raises(ValueError):
            KVEventPublisher(pub.endpoint)  # port taken
        with pytest.raises(TypeError):
            pub.publish([])
        assert pub.replay_endpoint is None
    for bad, err in [(lambda: KVEventPublisher("localhost:1"), ValueError),
                     (lambda: KVEventPublisher(LOCAL, "nope"), ValueError),
                     (lambda: KVEventPublisher(LOCAL, max_queue=0), ValueError),
                     (lambda: KVEventPublisher(LOCAL, topic=1), TypeError)]:
        with pytest.raises(err):
            bad()
    with pytest.raises(ValueError):
        KVEventSubscriber("nope")
    with pytest.raises(ValueError):
        KVEventSubscriber(LOCAL.replace("*", "1"), from_seq=-1)
    assert set(threading.enumerate()) == before


# -- older publishers, replay from anywhere ----------------------------------------------------
class OldPublisher:
    """A publisher of vLLM before #42892 and #45177, written with raw sockets:
    positional events, replay replies ``(seq, payload)`` without the topic frame."""

    def __init__(self, payloads):
        self.payloads = payloads
        self.ctx = zmq.Context()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind(LOCAL)
        self.router.bind(LOCAL)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            if self.router.poll(20):
                ident, empty, start = self.router.recv_multipart()
                for seq, p in enumerate(self.payloads):
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart([ident, empty, seq.to_bytes(8, "big"), p])
                self.router.send_multipart([ident, empty, (-1).to_bytes(8, "big", signed=True), b""])

    def send(self, seq):
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.payloads[seq]])

    def close(self):
        self.stop.set()
        self.thread.join(2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def test_cpkv_subscriber_reads_an_old_form_publisher_live_and_through_replay():
    """Batches of vLLM before #42892 (positional events) and replay replies
    before #45177 (no topic frame) are read by cpkv's subscriber, equal to the
    same batches in the current form."""
    hs = doc_hashes(list(range(8)), S)
    batches = [vllm.KVEventBatch(0.0, [vllm.AllBlocksCleared()], 0),
               vllm.KVEventBatch(1.0, [vllm.BlockStored(hs, None, list(range(8)), S, None, "GPU", None)], 0),
               vllm.KVEventBatch(2.0, [vllm.BlockRemoved(hs[1:], "GPU")], 0),
               vllm.KVEventBatch(3.0, [vllm.BlockStored(hs[:1], None, list(range(4)), S, None, "CPU", None)], 0)]
    old = OldPublisher([as_old(b) for b in batches])
    try:
        with KVEventSubscriber(old.endpoint, old.replay_endpoint) as sub:
            got = []
            for _ in deadline_loop(3):  # the late joiner hears seq 3 live and replays 0..2
                old.send(3)
                if (r := sub.recv(0.05)) is not None:
                    got = [r, *sub.batches(0.2)]
                    break
    finally:
        old.close()
    assert [s for s, _ in got] == [0, 1, 2, 3] and sub.lost == 0
    for (_, b), want in zip(got, batches):
        assert kw.encode_batch(b) == msgspec.msgpack.encode(want)  # the same batch, now in the current form


@pytest.mark.parametrize("start", [0, 3, 7, 9])
def test_replay_from_any_seq_and_past_the_buffer_reports_the_loss(start):
    """A buffer of 5 out of 10 batches: a subscriber starting at ``start``
    gets every batch from max(start, 5) on, in order, and counts the ones the
    buffer no longer holds as lost, with their range."""
    with KVEventPublisher(LOCAL, LOCAL, buffer_steps=5) as pub:
        for i in range(10):
            pub.publish(batch_of(i))
        for _ in deadline_loop(3):
            if pub.sent == 10:
                break
            time.sleep(0.01)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, from_seq=start) as sub:
            sub.catch_up()
            got = list(sub.batches(0.1))
    first = max(start, 5)
    assert [s for s, _ in got] == list(range(first, 10)) and [b.ts for _, b in got] == list(map(float, range(first, 10)))
    assert sub.lost == first - start and sub.lost_ranges == ([(start, 5)] if start < 5 else [])
