"""A bare install (``pip install cpkv``: torch, numpy and tqdm only) imports and runs the contract, the
pool, the prefix cache and the host tier; every optional package is imported where it is used, and its
absence is one line naming the extra. The optional packages are hidden in a fresh interpreter
(``sys.modules[m] = None``, so importing them raises ``ImportError``) rather than uninstalled.

A fresh virtual environment with the wheel and no extras tests the same thing from the outside
(:func:`test_the_wheel_without_extras_in_a_fresh_venv`); installing torch into it takes minutes, past the
suite's budget, so it is marked ``slow`` and runs with ``CPKV_SLOW_TESTS=1``."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

OPTIONAL = ("msgspec", "zmq", "transformers", "triton", "matplotlib")
HIDE = f"import sys\nfor m in {OPTIONAL!r}:\n    sys.modules[m] = None\n"


def run_bare(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


#: What ``cpkv``, the cache, never imports: the engine's side and every optional package.
NOT_THE_CACHE = ("cpkv.engine", "cpkv.runtime", "cpkv.kernels", "cpkv.models", "cpkv.tools") + OPTIONAL


def test_import_and_a_small_allocation_need_no_extra():
    """``import cpkv`` imports nothing heavy (torch neither) and sets no environment variable; every public name
    of it then imports torch and numpy, and none of :data:`NOT_THE_CACHE`."""
    r = run_bare("""
        import os
        environ = dict(os.environ)
        import cpkv
        assert "torch" not in sys.modules and "numpy" not in sys.modules, "import cpkv imported torch"
        names = [getattr(cpkv, n) for n in cpkv.__all__]
        assert dict(os.environ) == environ, "importing cpkv changed the environment"
        wrong = sorted(m for m in sys.modules if m.startswith(%r) and sys.modules[m] is not None)
        assert not wrong, f"the cache imported {wrong}"
        import torch
        from cpkv import Family, HostTier, OwnerLaneAllocator, PrefixCache, SharedKVLayout, SharedKVPool
        from cpkv.consumers.kv_events import block_hashes

        S, N, pages = 4, 2, 8
        layout = SharedKVLayout(N, S, pages)
        cache = PrefixCache(OwnerLaneAllocator.for_layout(layout))
        m = cache.allocate(cache.lookup(list(range(10))))
        a = cache.allocate_extend(torch.tensor([0]), torch.tensor([10]), torch.tensor([-1]))
        assert a is not None and a.out_cache_loc.numel() == 10
        fam = Family("k", (2,), (0,))
        pool = SharedKVPool(layout, 0, [fam], {"k": torch.zeros(fam.buffer_shape(layout))})
        assert pool.bytes_held() == 0 and pool.page_bytes == S * 2 * 4
        host = HostTier(4, S)
        assert len(block_hashes(list(range(10)), S)) == 2
        loaded = sorted(k for k in sys.modules if k.split(".")[0] in %r and sys.modules[k] is not None)
        print("ok", loaded)
    """ % (NOT_THE_CACHE, OPTIONAL))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ok", "[]"], r.stdout


COMMANDS = (
    (["run"], "cpkv run: error: cpkv run (its models are transformers' own) needs transformers: "
              "pip install 'cpkv[model]' (see cpkv run --help)"),
    (["simulate", "--workload", "longdoc", "--policies", "lane0", "--kv-events", "tcp://127.0.0.1:5557"],
     "cpkv simulate: error: --kv-events needs zmq: pip install 'cpkv[events]' (see cpkv simulate --help)"),
    (["simulate", "--plot", "x.png"],
     "cpkv simulate: error: --plot needs matplotlib: pip install 'cpkv[plot]' (see cpkv simulate --help)"),
    (["bench", "plan"], "cpkv bench: error: bench plan (its models are transformers' own) needs transformers: "
                        "pip install 'cpkv[model]' (see cpkv bench --help)"),
)


def test_each_optional_module_says_its_extra_in_one_line():
    """The KV event modules and a sink, then the command's flags that need an extra: one line each."""
    r = run_bare("""
        import contextlib, io, json
        from cpkv.consumers.kv_events import KVEventSink
        from cpkv.tools.cli import main
        out = []
        for what in ("import cpkv.consumers.kv_wire", "import cpkv.consumers.kv_events_zmq",
                     "KVEventSink(type('P', (), {'publish': lambda self, b: 0})(), 4)"):
            try:
                exec(what)
                out.append("imported")
            except ImportError as e:
                out.append(str(e))
        for argv in %r:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            out.append([code, err.getvalue().splitlines()])
        print(json.dumps(out))
    """ % ([a for a, _ in COMMANDS],))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got[:3] == ["cpkv's KV events need msgspec and pyzmq: pip install 'cpkv[events]'"] * 3
    assert got[3:] == [[2, [line]] for _, line in COMMANDS]


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_without_extras_in_a_fresh_venv(tmp_path):
    """``pip install cpkv`` as a user does it: the wheel built from this checkout (no dependencies),
    installed with its own requirements only into a fresh venv (torch from wherever pip finds torch==2.13.0:
    a local wheel where one is configured), then ``import cpkv`` and a small allocation there, with no
    optional package installed. Measured on a 2-core machine shared with other jobs: 2 min 44 s by hand (33 CPU
    seconds, nearly all of it pip installing torch) and 6 min 6 s as a test under a load of 35, past the
    suite's budget: marked ``slow``."""
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    pip = dict(capture_output=True, text=True, timeout=1200)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheels), str(REPO)], **pip)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("cpkv-*.whl")
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], **pip)
    assert r.returncode == 0, r.stderr[-3000:]
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "torch==2.13.0", str(wheel)],
                       **pip)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([py, "-c", textwrap.dedent("""
        import importlib.util, sys
        import torch
        import cpkv
        from cpkv import OwnerLaneAllocator, PrefixCache, SharedKVLayout
        from cpkv.consumers.hicache import HostTier

        S, N, pages = 4, 2, 8
        layout = SharedKVLayout(N, S, pages)
        cache = PrefixCache(OwnerLaneAllocator((layout.num_pages - 1) * S, S, N, layout=layout))
        a = cache.allocate_extend(torch.tensor([0]), torch.tensor([10]), torch.tensor([-1]))
        assert a is not None and a.out_cache_loc.numel() == 10
        HostTier(4, S)
        print(cpkv.__file__.startswith(sys.prefix), [m for m in %r if importlib.util.find_spec(m)])
    """ % (OPTIONAL,))], cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **pip)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "[]"], r.stdout  # the installed cpkv, and no optional package there
