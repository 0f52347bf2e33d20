"""``cpkv run --kv-events``: the publisher bound as the command starts.

A router registers a worker as the worker's command starts. Dynamo's KV
indexer (ai-dynamo-runtime 1.6.1) connects its SUB then; while the endpoint is
not bound it retries with a growing delay, and it learns of the batches it
missed only from a later live one (then replays them): a worker that binds
once its ranks are up (seconds in: torch, the model, the processes) loses the
batches sent before the indexer's next try, and all of them if its run ends
first. So :func:`cpkv.tools.cli.main` calls :func:`bind_at_start` first,
before it builds its parser (which imports torch): the PUB socket, the replay
socket and a loopback relay are bound a few tenths of a second after the
process starts, long before the first batch, and rank 0 hands its batches to
this process (``RunConfig.kv_events_relay``), which numbers, sends and buffers
them. A router that connects at any moment after the command starts hears
every batch, live or by replay. [[RFC-0001:C-KV-EVENTS]]
"""

from __future__ import annotations

import argparse
import os

from .flags import add_kv_events_flags, refuse_unless_kv_events_bind


def binds_here() -> bool:
    """Whether this process binds ``cpkv run``'s KV event sockets: the command's
    own process, or under torchrun its global rank 0 (the rank that holds
    the report; torchrun's ``RANK``)."""
    return os.environ.get("RANK", "") in ("", "0")


def bind_at_start(argv: list[str]):
    """For ``cpkv run ... --kv-events X [--kv-events-replay Y]
    [--kv-events-buffer B]``: a bound
    :class:`~cpkv.consumers.kv_events_zmq.KVEventPublisher` with a relay, or
    ``None`` (another command, no ``--kv-events``, not this process's job, or
    a flag or bind the full parse refuses: :func:`refuse_unless_bound` then
    says why in one line). Reads only these flags of ``argv`` and imports
    neither torch nor numpy."""
    if not argv or argv[0] != "run" or not binds_here():
        return None
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_kv_events_flags(p, "")
    try:
        args, _ = p.parse_known_args(argv[1:])
    except (argparse.ArgumentError, SystemExit):
        return None
    if args.kv_events is None or args.kv_events_replay == args.kv_events:
        return None
    try:
        from ..consumers.kv_events_zmq import KVEventPublisher

        return KVEventPublisher(args.kv_events, args.kv_events_replay, buffer_steps=args.kv_events_buffer,
                                relay=True)
    except (ImportError, ValueError):
        return None


def refuse_unless_bound(parser: argparse.ArgumentParser, args) -> None:
    """``cpkv run``'s check of the KV event flags: nothing more to do when
    :func:`bind_at_start` bound them (``args.kv_publisher``) or another rank
    binds them; else :func:`~cpkv.tools.flags.refuse_unless_kv_events_bind`
    says in one line why they cannot be bound."""
    if getattr(args, "kv_publisher", None) is not None or not binds_here():
        return
    refuse_unless_kv_events_bind(parser, args)
