"""The reaper (cpkv.runtime.reaper): what a run registered is removed once its owner and every process holding the
reaper's descriptor are gone, not before, and only what is still registered; a forked child has its own."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from support.proc_helpers import fork_launcher, gone, wait_until
from cpkv.runtime import reaper, shm


def _owner(info):
    """In a forked child: register a prefix and two folders (forgetting one), create them, give the reaper's
    descriptor to a sleeping process, say who is who, and die by SIGKILL."""
    r = reaper.reaper()
    prefix = f"{shm.SHM_PREFIX}{os.getpid()}_reapertest_"
    r.watch(prefix=prefix)
    seg = shm.create(prefix + "x", 64)
    shm.close(seg)
    folder, kept = r.folder("cpkv_rt"), r.folder("cpkv_rt_kept")
    r.forget(path=kept)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], pass_fds=(r.fd,))
    with open(info + ".tmp", "w") as f:
        json.dump({"reaper": r.pid, "holder": holder.pid, "prefix": prefix, "folder": folder, "kept": kept}, f)
    os.replace(info + ".tmp", info)
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_reaper_removes_what_is_registered_once_its_owner_and_every_holder_are_gone(tmp_path):
    info = tmp_path / "info"
    owner = fork_launcher(tmp_path, {}, lambda: _owner(str(info)))
    got = {}
    try:
        assert os.waitpid(owner, 0)[1] == signal.SIGKILL
        got = json.loads(info.read_text())
        time.sleep(0.5)  # the owner is gone, the holder lives: nothing is removed yet
        assert not gone(got["reaper"]) and os.path.isdir(got["folder"]) and shm.shm_names(got["prefix"])
        os.kill(got["holder"], signal.SIGKILL)
        assert wait_until(lambda: gone(got["reaper"]), 5)
        assert not os.path.exists(got["folder"]) and not shm.shm_names(got["prefix"])
        assert os.path.isdir(got["kept"])  # forgotten: the reaper leaves it
    finally:
        with contextlib.suppress(KeyError, ProcessLookupError):
            os.kill(got["holder"], signal.SIGKILL)
        if got:
            shm.unlink_prefix(got["prefix"])


def test_a_forked_child_has_its_own_reaper(tmp_path):
    mine, out = reaper.reaper(), tmp_path / "child"

    def child():
        r = reaper.reaper()
        out.write_text(json.dumps([r.pid, r.pid != mine.pid, reaper.reaper() is r]))

    pid = fork_launcher(tmp_path, {}, child)
    assert os.waitpid(pid, 0)[1] == 0
    theirs, differs, same = json.loads(out.read_text())
    assert differs and same
    assert wait_until(lambda: gone(theirs), 5)  # it ended with its owner
    assert reaper.reaper() is mine and not gone(mine.pid)  # the fork took nothing from this process's reaper


@pytest.mark.parametrize("kw", [{}, {"path": "/tmp/a\nb"}, {"path": "relative"}, {"prefix": ""},
                                {"prefix": "psm_"}, {"prefix": "cpkv_x\n", "path": "/tmp/y"}])
def test_watch_forget_and_remove_refuse_a_bad_name_and_touch_nothing(kw, tmp_path):
    """A prefix that is not cpkv's (the empty one would be every name in /dev/shm), a relative path or a newline
    (the reaper reads lines) is refused before anything is registered or removed."""
    r, guard = reaper.reaper(), f"{shm.SHM_PREFIX}{os.getpid()}_reapertest_guard"
    kw = {k: (v if v != "/tmp/y" else str(tmp_path)) for k, v in kw.items()}
    shm.close(shm.create(guard, 64))
    try:
        for call in (r.watch, r.forget, r.remove):
            with pytest.raises(ValueError, match="give a prefix of cpkv's"):
                call(**kw)
        assert tmp_path.is_dir() and shm.shm_names(guard) == {guard}
    finally:
        shm.unlink(guard)
