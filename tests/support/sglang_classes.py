"""SGLang's own classes for the drop-in tests (tests/sglang), from the released wheel.

`make test` installs ``sglang==0.5.23`` with ``--no-deps`` and the small packages of
``tests/support/sglang-requirements.txt``. Its allocator, radix cache, request-to-token pool and allocation
helpers then import on the CPU with TWO stand-ins, named here and nowhere else:

* ``torchvision``: SGLang's model-config package imports it (image transforms of multimodal configs: InternVL,
  DeepSeek-OCR) on the way to the memory pool; nothing under test calls it. Its PyPI wheel cannot load beside
  the CPU torch (and would replace torch), so a module whose every name is a stand-in that refuses to be called
  takes its place, put in ``sys.modules`` only after transformers has decided that torchvision is absent (so
  transformers' own image code does not try it).
* ``datasets``: SGLang's test utilities (``sglang.test.test_utils``, whose ``CustomTestCase`` its own unit-test
  files subclass: tests/sglang/upstream) import it for their benchmark loaders; nothing under test calls it,
  and the package is large. A stand-in likewise, unless a real one is installed.

:func:`sglang_classes` returns the modules asked for, or skips the test with the reason when SGLang is not installed.
"""

from __future__ import annotations

import importlib
import sys
import types
from types import SimpleNamespace

SGLANG_VERSION = "0.5.23"
STAND_INS = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
             "torchvision.transforms.v2", "datasets")

_loaded: dict[str, types.ModuleType] = {}


class _StandIn:
    """A name of a stand-in module: refuses to be called, so a test that reached it would fail loudly."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a test stand-in (tests/support/sglang_classes.py)")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}")


def _stand_in(name: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so its submodules import

    def names(attr: str, name=name):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{name}.{attr}")

    module.__getattr__ = names
    sys.modules[name] = module


MODULES = {"allocator": "sglang.srt.mem_cache.allocator",
           "page_interleave": "sglang.srt.mem_cache.allocator.page_interleave",
           "memory_pool": "sglang.srt.mem_cache.memory_pool",
           "base": "sglang.srt.mem_cache.base_prefix_cache",
           "radix_cache": "sglang.srt.mem_cache.radix_cache",
           "common": "sglang.srt.mem_cache.common",
           "allocation": "sglang.srt.mem_cache.allocation",
           "test_utils": "sglang.test.test_utils"}
ALLOCATOR = ("allocator", "page_interleave")  # what the allocator tests need: no model configs, no torchvision


def sglang_classes(*names: str) -> SimpleNamespace:
    """SGLang's modules under test, by short name (:data:`MODULES`; all of them when none is named), each
    imported once per process; skips with the reason when sglang is missing, another version, or a module does
    not import. The allocator alone (:data:`ALLOCATOR`) needs no stand-in and imports in a fraction of the time
    the memory pool and radix cache take (they reach SGLang's model configs and quantization layers)."""
    import pytest

    try:
        from importlib.metadata import version

        found = version("sglang")
    except Exception:
        pytest.skip(f"sglang=={SGLANG_VERSION} is not installed (make test installs it: Makefile, sglang-deps)")
    if found != SGLANG_VERSION:
        pytest.skip(f"sglang {found} installed; these tests pin {SGLANG_VERSION}")
    names = names or tuple(MODULES)
    unknown = set(names) - set(MODULES)
    if unknown:
        raise ValueError(f"unknown SGLang modules {sorted(unknown)}; known: {sorted(MODULES)}")
    if set(names) - set(ALLOCATOR) and not all(n in sys.modules for n in STAND_INS):
        import transformers.utils.import_utils as hf

        if hf.is_torchvision_available():
            pytest.skip("a real torchvision is installed: the stand-in would shadow it")
        real_datasets = hf.is_datasets_available()
        for name in STAND_INS:
            if name not in sys.modules and not (name == "datasets" and real_datasets):
                _stand_in(name)
    for short in names:
        if short not in _loaded:
            try:
                _loaded[short] = importlib.import_module(MODULES[short])
            except ImportError as e:  # a dependency missing: say which
                pytest.skip(f"{MODULES[short]} does not import ({e}); install tests/support/sglang-requirements.txt")
    return SimpleNamespace(**{short: _loaded[short] for short in names})
