"""Shared-memory names of a run (cpkv.runtime.shm): a stop that races a
creation in another thread leaves no name behind, and refuses later ones."""

import threading
import time
import uuid

import pytest

from cpkv.runtime import shm


def _prefix() -> str:
    return shm.run_prefix(f"t{uuid.uuid4().hex[:8]}")


def test_a_creation_racing_stop_creating_leaves_no_name():
    """A thread creates one new name after another; ``stop_creating`` from
    another thread unlinks what exists, and the creator is refused from then on
    (it does not create for the 1 s it would otherwise go on)."""
    prefix, made, refused = _prefix(), [], []

    def creator():
        end, i = time.monotonic() + 1.0, 0
        while time.monotonic() < end:
            try:
                shm.close(shm.create(f"{prefix}{i}", 4096))
                made.append(i)
            except RuntimeError as e:
                refused.append(str(e))
                return
            i += 1

    t = threading.Thread(target=creator)
    try:
        t.start()
        while len(made) < 20 and t.is_alive():
            time.sleep(0.001)
        gone = shm.stop_creating(prefix)
        t.join()
        assert len(gone) >= 20 and refused and "its run is stopping" in refused[0]
        assert not shm.shm_names(prefix)
    finally:
        t.join()
        shm.unlink_prefix(prefix)


def test_create_after_stop_creating_is_refused_and_creates_nothing():
    prefix, other = _prefix(), _prefix()
    shm.stop_creating(prefix)
    with pytest.raises(RuntimeError, match=r"shared segment .*_x' refused: its run is stopping"):
        shm.create(prefix + "x", 64)
    assert not shm.shm_names(prefix)
    seg = shm.create(other + "x", 64)  # another run's prefix is untouched
    try:
        assert shm.shm_names(other) == {other + "x"}
    finally:
        shm.close(seg)
        shm.unlink_prefix(other)
