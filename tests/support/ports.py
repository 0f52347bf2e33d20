"""A free loopback port, for a test's endpoints (a c10d rendezvous, a ZMQ socket, an indexer's HTTP port)."""

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before the caller binds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
