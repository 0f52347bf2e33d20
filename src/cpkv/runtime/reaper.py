"""The reaper: a tiny process that removes what a run left once every process of the run is gone.

A rank killed by a signal runs no Python code, and neither does a launcher killed by ``SIGKILL``: whatever
removes their shared-memory names and folders must live elsewhere and must learn of their end from the
kernel. :func:`reaper` starts, once per process (again in a forked child), a small ``python -I -S``
process that holds the read end of a pipe. The process that started it holds the write end, and every
process it starts with :attr:`Reaper.fd` among its inherited descriptors (cpkv's ranks) holds a copy. The
kernel closes a process's descriptors when it ends, however it ends, so the reaper reads end of file
exactly when the starter and all those processes are gone. It then removes every name prefix and folder
still registered (:meth:`Reaper.watch`, not yet :meth:`Reaper.forget`), and exits.

While the processes live, a run removes its own names and folders and calls :meth:`Reaper.forget`; the
reaper only acts for a run whose processes died first. It never outlives the last of its processes:
it ends at that end of file, after the removals (milliseconds). It is started in a session of its own,
so neither a terminal's Ctrl-C nor a ``killpg`` of its starter's group (torchrun's agent stops its
workers that way) ends it before it has cleaned up.

The reaper imports nothing but ``os``, ``shutil`` and ``sys``, and runs no code of the run: what it
removes is only what was registered, by prefix under ``/dev/shm`` and by folder path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid

from . import shm as shm_mod

_CODE = """\
import os, shutil, sys
fd, shm_dir, held, buf = int(sys.argv[1]), sys.argv[2], set(), b""
while True:
    chunk = os.read(fd, 65536)
    if not chunk:
        break
    *lines, buf = (buf + chunk).split(b"\\n")
    for line in lines:
        op, kind, arg = line[:1], line[1:4], os.fsdecode(line[5:])
        (held.add if op == b"+" else held.discard)((kind, arg))
for kind, arg in sorted(held):
    if kind == b"shm":
        for name in os.listdir(shm_dir):
            if name.startswith(arg):
                try:
                    os.unlink(os.path.join(shm_dir, name))
                except OSError:
                    pass
    else:
        shutil.rmtree(arg, ignore_errors=True)
"""


class Reaper:
    """This process's reaper (see the module docstring); get it with :func:`reaper`.

    ``fd`` is the write end of the reaper's pipe: pass it (``pass_fds``) to every process whose end the
    cleanup must wait for; ``pid`` is the reaper process's."""

    def __init__(self):
        r, w = os.pipe()  # both ends close-on-exec: only the reaper (and whom fd is passed to) inherits one
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CODE, str(r), shm_mod.SHM_DIR],
                                          pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self.fd, self.pid, self._owner = w, self._proc.pid, os.getpid()
        self._lock = threading.Lock()

    def watch(self, *, prefix: str | None = None, path: str | None = None) -> None:
        """Remove, once this process and every holder of :attr:`fd` are gone, the ``/dev/shm`` names
        starting with ``prefix`` (one of cpkv's: ``cpkv_...``) and the folder ``path`` (absolute). Give them
        before the first name or the folder exists: nothing is left in between. ``ValueError``, and nothing
        registered, for neither, another prefix, a relative path or a newline."""
        self._send(_lines(b"+", prefix, path))

    def forget(self, *, prefix: str | None = None, path: str | None = None) -> None:
        """Undo :meth:`watch` (the run removed them itself); refuses as it does."""
        self._send(_lines(b"-", prefix, path))

    def folder(self, kind: str) -> str:
        """A new private folder ``<tmp>/<kind>_<pid>_<id>``, watched before it exists; :meth:`remove` it."""
        path = os.path.join(os.path.abspath(tempfile.gettempdir()), f"{kind}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self.watch(path=path)
        os.mkdir(path, 0o700)
        return path

    def remove(self, *, prefix: str | None = None, path: str | None = None) -> None:
        """Remove now what :meth:`watch` registered (the names starting with ``prefix``, the folder
        ``path``), then forget it; refuses, removing nothing, as :meth:`watch` does."""
        data = _lines(b"-", prefix, path)
        if prefix is not None:
            shm_mod.unlink_prefix(prefix)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        self._send(data)

    def _send(self, data: bytes) -> None:
        with self._lock:  # one line is one write (< PIPE_BUF: atomic), but keep a message's lines together
            os.write(self.fd, data)


def _lines(op: bytes, prefix: str | None, path: str | None) -> bytes:
    """The reaper's lines for ``op`` (``+`` watch, ``-`` forget); ``ValueError`` for a bad name."""
    items = [(b"shm", prefix)] * (prefix is not None) + [(b"dir", path)] * (path is not None)
    bad = (not items or any("\n" in a for _, a in items)
           or (prefix is not None and (not prefix.startswith(shm_mod.SHM_PREFIX) or "/" in prefix))
           or (path is not None and not os.path.isabs(path)))
    if bad:
        raise ValueError(f"give a prefix of cpkv's ({shm_mod.SHM_PREFIX}...) or an absolute path, without a newline; "
                         f"got prefix={prefix!r} path={path!r}")
    return b"".join(op + kind + b" " + os.fsencode(a) + b"\n" for kind, a in items)


_reaper: Reaper | None = None
_reaper_lock = threading.Lock()


def reaper() -> Reaper:
    """This process's reaper, started on first use (and again in a child forked after it)."""
    global _reaper
    with _reaper_lock:
        if _reaper is None or _reaper._owner != os.getpid() or _reaper._proc.poll() is not None:
            _reaper = Reaper()
        return _reaper


def _after_fork_in_child() -> None:
    """A forked child drops its parent's reaper: holding its pipe would make the parent's cleanup wait
    for the child."""
    global _reaper, _reaper_lock
    _reaper_lock = threading.Lock()
    if _reaper is not None and _reaper._owner != os.getpid():
        with contextlib.suppress(OSError):
            os.close(_reaper.fd)
        _reaper = None


os.register_at_fork(after_in_child=_after_fork_in_child)
