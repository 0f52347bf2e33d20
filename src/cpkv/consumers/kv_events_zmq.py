"""The transport of KV events: vLLM's ZMQ wire protocol, as vLLM 0.33 speaks it ([[RFC-0001:C-KV-EVENTS]]).

* Live stream: a PUB socket sends each batch as a three-frame message
  ``(topic, seq, payload)``: ``topic`` the UTF-8 topic (empty by default),
  ``seq`` an 8-byte big-endian sequence number (0, 1, 2, ... per publisher),
  ``payload`` the msgpack :class:`~cpkv.consumers.kv_wire.KVEventBatch`
  (:func:`~cpkv.consumers.kv_wire.encode_batch`).
* Replay: a ROUTER socket takes a request whose last frame is an 8-byte
  big-endian start sequence number (after the envelope a REQ or DEALER peer
  sends: identity, empty frame) and answers with one ``(topic, seq, payload)``
  message per buffered batch whose ``seq >= start``, in order, the same three
  frames as the live stream (vLLM #45177), then the end marker
  ``(b"", -1 as 8 signed big-endian bytes, b"")``. A start older than the
  buffer gets what the buffer still holds: the first seq replayed tells the
  peer what it lost.

  A REQ socket keeps only the first reply of a request (libzmq's REQ state
  machine), so a subscriber that wants the whole replay uses a DEALER that
  sends ``[b"", start]``, as :class:`KVEventSubscriber` does. It reads replies
  with or without the topic frame (vLLM before #45177 sent ``(seq, payload)``),
  and payloads of either event form (:func:`~cpkv.consumers.kv_wire.decode_batch`).

:class:`KVEventPublisher` binds both sockets; the engine's ``publish`` only
appends to a bounded queue (the oldest batch is dropped when it is full) and a
background thread encodes, sends and serves replays, so neither a slow nor an
absent subscriber ever blocks the engine. With ``relay=True`` it also takes
batches from other processes: a :class:`KVEventRelay` there (``cpkv run``'s
rank 0) hands each batch to the process that bound the sockets (``cpkv run``'s
launcher, which binds them before anything slow, so a router that registers
as the command starts is served), which numbers, sends and buffers it as its
own. :class:`KVEventSubscriber` connects, hands batches out in sequence order
and recovers a gap through the replay socket. The module imports neither
torch nor numpy: a launcher binds before it imports them.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections import deque
from typing import Iterator

from .kv_wire import KVEventBatch, decode_batch, encode_batch

try:
    import zmq
except ImportError as e:  # the one line a bare install says
    raise ImportError("cpkv's KV events need msgspec and pyzmq: pip install 'cpkv[events]'") from e

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay (its topic and payload frames are empty)."""


def _int(x, name: str) -> int:
    """An integer argument as an ``int`` (a bool is refused: ``TypeError``), as
    :func:`cpkv.contract.inputs.int_scalar` takes one; written here so that
    this module imports no array library."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    return int(x)


def _positive(x, name: str) -> int:
    v = _int(x, name)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def _endpoint(x, name: str) -> str:
    if not isinstance(x, str) or "://" not in x:
        raise ValueError(f"{name} must be a ZMQ endpoint such as 'tcp://127.0.0.1:5557', got {x!r}")
    return x


class KVEventPublisher:
    """Publishes :class:`KVEventBatch` es on ``endpoint`` (bound; ``tcp://host:*``
    picks a free port, see :attr:`endpoint`) and serves replays on
    ``replay_endpoint`` (bound, optional).

    Memory is bounded: at most ``max_queue`` batches wait for the thread (the
    oldest is dropped and counted in :attr:`dropped` when a new one arrives at a
    full queue: its sequence number is then missing for good), ``buffer_steps``
    encoded batches are kept for replay, and each subscriber's socket queue holds
    at most ``hwm`` messages (ZMQ drops past that; a replay peer's up to one
    whole replay). ``data_parallel_rank`` is
    stamped on every batch that has none, as vLLM's publisher does. With
    ``relay=True`` a third socket (a PULL on a free loopback port,
    :attr:`relay_endpoint`) takes the encoded batches of
    :class:`KVEventRelay` s in other processes; each is numbered after the
    ones before it and sent and buffered as a published one. A bind that
    fails raises ``ValueError`` and leaves no socket or thread behind.
    :meth:`close` (or leaving a ``with`` block) stops the thread and frees the
    sockets."""

    TICK_S = 0.005
    """How long the thread sleeps between looks at the replay and relay sockets when idle."""
    RELAY_QUIET_S = 0.25
    """At :meth:`close`, the relay is read until no batch came for this long (a relay's last batches are on
    their way over loopback when its process ends)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 data_parallel_rank: int | None = 0, max_queue: int = 10_000,
                 buffer_steps: int = 10_000, hwm: int = 10_000, relay: bool = False):
        _endpoint(endpoint, "endpoint")
        if replay_endpoint is not None:
            _endpoint(replay_endpoint, "replay_endpoint")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self.data_parallel_rank = None if data_parallel_rank is None else _int(
            data_parallel_rank, "data_parallel_rank")
        self.max_queue = _positive(max_queue, "max_queue")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=_positive(buffer_steps, "buffer_steps"))
        hwm = _positive(hwm, "hwm")
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._replay = self._relay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 200)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # a whole replay must fit the peer's queue, or the ROUTER drops its tail
                self._replay.setsockopt(zmq.SNDHWM, self._buffer.maxlen + 1)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
            if relay:
                self._relay = self._ctx.socket(zmq.PULL)
                self._relay.setsockopt(zmq.LINGER, 0)
                self._relay.bind("tcp://127.0.0.1:*")
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV event sockets ({endpoint}, {replay_endpoint}): {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound PUB address (the real port when ``endpoint`` asked for ``*``)."""
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.relay_endpoint = None if self._relay is None else self._relay.getsockopt_string(zmq.LAST_ENDPOINT)
        """Where a :class:`KVEventRelay` connects (``None`` without ``relay``)."""
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._cond = threading.Condition()
        self._next_seq = 0
        self._closing = False
        self.dropped = 0
        """Batches dropped from a full queue (never sent, never replayable)."""
        self.sent = 0
        """Batches sent on the PUB socket."""
        self._thread = threading.Thread(target=self._run, name="cpkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> int:
        """Queue ``batch`` and return its sequence number; never blocks on the
        network. Raises ``TypeError`` for anything but a :class:`KVEventBatch`
        and ``RuntimeError`` after :meth:`close` (nothing queued then)."""
        if not isinstance(batch, KVEventBatch):
            raise TypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
        if batch.data_parallel_rank is None and self.data_parallel_rank is not None:
            batch = KVEventBatch(ts=batch.ts, events=batch.events, data_parallel_rank=self.data_parallel_rank)
        with self._cond:
            if self._closing:
                raise RuntimeError("the KV event publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((seq, batch))
            self._cond.notify()
        return seq

    def _run(self) -> None:
        quiet_since = None  # when closing: since when the relay has been quiet
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(self.TICK_S)
            relayed = self._take_relayed()
            with self._cond:  # the relayed batches numbered after every batch queued so far
                items = [(seq, encode_batch, batch) for seq, batch in self._queue]
                self._queue.clear()
                items += [(self._next_seq + i, None, payload) for i, payload in enumerate(relayed)]
                self._next_seq += len(relayed)
                stop = self._closing
            for seq, encode, what in items:
                try:
                    self._send(seq, what if encode is None else encode(what))
                except Exception:  # a broken batch must not kill the stream
                    log.exception("KV event batch %d not sent", seq)
            while self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            if stop and not items:
                if self._relay is None or (quiet_since is not None
                                           and time.monotonic() - quiet_since >= self.RELAY_QUIET_S):
                    return
                quiet_since = quiet_since or time.monotonic()
                time.sleep(self.TICK_S)
            elif stop:
                quiet_since = time.monotonic()

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.sent += 1

    def _take_relayed(self) -> list[bytes]:
        """The encoded batches the relay holds now, in arrival order."""
        out = []
        while self._relay is not None and self._relay.poll(0):
            out.append(self._relay.recv())
        return out

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            log.warning("KV event replay request ignored: %d frames", len(frames))
            return
        start = int.from_bytes(frames[-1], "big")
        head = frames[:-1]  # the peer's identity and the empty delimiter
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((*head, self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*head, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay, self._relay):
            if s is not None:
                s.close()
        self._ctx.term()

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (and, with a relay, what reaches it until it has
        been quiet for :attr:`RELAY_QUIET_S`), stop the thread, close the
        sockets and the ZMQ context (PUB lingers at most 0.2 s). Idempotent."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # cannot happen: no call in the loop blocks
            raise RuntimeError("the KV event publisher thread did not stop")
        self._close_sockets()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVEventRelay:
    """Hands batches to a :class:`KVEventPublisher` of another process, the
    one that bound the sockets (its :attr:`~KVEventPublisher.relay_endpoint`):
    ``publish`` encodes the batch (``data_parallel_rank`` stamped where it has
    none) and queues it on a PUSH socket, never blocking on the network (the
    publisher numbers it: ``publish`` returns ``None``); at most ``hwm``
    batches wait for the connection (past that a batch is dropped and counted
    in :attr:`dropped`). :meth:`close` waits up to ``linger_s`` for the queued
    batches to leave. [[RFC-0001:C-KV-EVENTS]]"""

    def __init__(self, endpoint: str, data_parallel_rank: int | None = 0, hwm: int = 100_000,
                 linger_s: float = 10.0):
        _endpoint(endpoint, "endpoint")
        self.data_parallel_rank = None if data_parallel_rank is None else _int(
            data_parallel_rank, "data_parallel_rank")
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, _positive(hwm, "hwm"))
        self._push.setsockopt(zmq.LINGER, int(float(linger_s) * 1000))
        self._push.connect(endpoint)
        self.dropped = 0
        """Batches dropped because ``hwm`` of them waited already."""

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for the publisher (``TypeError`` for anything but a
        :class:`KVEventBatch`, ``RuntimeError`` after :meth:`close`)."""
        if not isinstance(batch, KVEventBatch):
            raise TypeError(f"batch must be a KVEventBatch, got {type(batch).__name__}")
        if self._ctx.closed:
            raise RuntimeError("the KV event relay is closed")
        if batch.data_parallel_rank is None and self.data_parallel_rank is not None:
            batch = KVEventBatch(ts=batch.ts, events=batch.events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._push.send(encode_batch(batch), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return None

    def close(self) -> None:
        """Let the queued batches leave (at most ``linger_s``), then close. Idempotent."""
        if not self._ctx.closed:
            self._push.close()
            self._ctx.term()

    def __enter__(self) -> "KVEventRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KVEventSubscriber:
    """Connects to a publisher and hands out ``(seq, KVEventBatch)`` in
    sequence order, each sequence number at most once.

    ``from_seq``: the first sequence number wanted (0: everything, so a late
    subscriber replays what it missed; ``None``: start at the first live one).
    A live message past the next expected number triggers a replay of the gap
    on ``replay_endpoint`` (waiting at most ``replay_timeout_s``); numbers the
    publisher no longer has are counted in :attr:`lost` and listed in
    :attr:`lost_ranges` (half-open) and skipped: a router should resync then.
    A payload that does not decode raises ``ValueError`` naming its seq."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 from_seq: int | None = 0, replay_timeout_s: float = 1.0):
        _endpoint(endpoint, "endpoint")
        if replay_endpoint is not None:
            _endpoint(replay_endpoint, "replay_endpoint")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        self.next_seq = None if from_seq is None else _int(from_seq, "from_seq")
        if self.next_seq is not None and self.next_seq < 0:
            raise ValueError(f"from_seq must be >= 0, got {self.next_seq}")
        self.replay_timeout_s = float(replay_timeout_s)
        self._replay_endpoint = replay_endpoint
        self._ready: deque[tuple[int, KVEventBatch]] = deque()
        self.replays = 0
        """Replay requests sent (one per gap seen, one per :meth:`catch_up`)."""
        self.lost = 0
        self.lost_ranges: list[tuple[int, int]] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._dealer = self._new_dealer()

    def _new_dealer(self):
        if self._replay_endpoint is None:
            return None
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self._replay_endpoint)
        return d

    def _decode(self, seq: int, payload: bytes) -> KVEventBatch:
        try:
            return decode_batch(payload)
        except ValueError as e:
            raise ValueError(f"KV event batch {seq} does not decode: {e}") from e

    def _replayed(self, start: int) -> list[tuple[int, bytes]]:
        """Everything the publisher still buffers from ``start`` on ([] on timeout)."""
        if self._dealer is None:
            return []
        self._dealer.send_multipart((b"", start.to_bytes(8, "big")))
        self.replays += 1
        out, deadline = [], time.monotonic() + self.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._dealer.poll(max(1, int(left * 1000))):
                self._dealer.close()  # a late answer must not reach the next request
                self._dealer = self._new_dealer()
                return out
            frames = self._dealer.recv_multipart()[1:]  # after the empty delimiter: [topic,] seq, payload
            if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                log.warning("KV event replay message ignored: %d frames", len(frames) + 1)
                continue
            if frames[-2] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[-2], "big"), frames[-1]))

    def _take(self, items, stop: int | None) -> None:
        """Queue replayed ``items`` in [next_seq, stop); count the holes as lost."""
        for seq, payload in items:
            if seq < self.next_seq or (stop is not None and seq >= stop):
                continue
            self._lose(seq)
            self._ready.append((seq, self._decode(seq, payload)))
            self.next_seq = seq + 1
        if stop is not None:
            self._lose(stop)

    def _lose(self, upto: int) -> None:
        if upto > self.next_seq:
            self.lost += upto - self.next_seq
            self.lost_ranges.append((self.next_seq, upto))
            self.next_seq = upto

    def catch_up(self) -> int:
        """Replay now everything the publisher buffers from :attr:`next_seq` on
        (a late subscriber's first call); returns how many batches it queued."""
        before = len(self._ready)
        self._take(self._replayed(self.next_seq or 0), None)
        return len(self._ready) - before

    def recv(self, timeout_s: float = 1.0) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)`` in order, or ``None`` if none came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sub.poll(max(1, int(left * 1000))):
                return None
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("KV event message ignored: %d frames", len(frames))
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                continue  # already handed out (through a replay)
            if seq > self.next_seq:
                self._take(self._replayed(self.next_seq), seq)
            self._ready.append((seq, self._decode(seq, frames[2])))
            self.next_seq = seq + 1
        return self._ready.popleft()

    def batches(self, idle_timeout_s: float = 1.0) -> Iterator[tuple[int, KVEventBatch]]:
        """Yield ``recv()`` results until none comes for ``idle_timeout_s``."""
        while (got := self.recv(idle_timeout_s)) is not None:
            yield got

    def close(self) -> None:
        """Close both sockets and the ZMQ context. Idempotent."""
        if self._ctx.closed:
            return
        for s in (self._sub, self._dealer):
            if s is not None:
                s.close()
        self._ctx.term()

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
