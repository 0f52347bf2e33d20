"""Shared test settings (hypothesis profiles sized for a 2-core CI machine) and fixtures."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CPKV_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def llama():
    """The tiny seeded Llama (:class:`cpkv.models.TinyLlama` defaults) behind its
    adapter, built once per test process and shared by the engine tests."""
    from cpkv.models import LlamaAdapter, TinyLlama

    return LlamaAdapter(TinyLlama().build())


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device; tests marked ``slow``
    (past the suite's time budget, each with its measured cost in its docstring) unless
    ``CPKV_SLOW_TESTS=1``."""
    import pytest
    import torch

    if os.environ.get("CPKV_SLOW_TESTS") != "1":
        slow = pytest.mark.skip(reason="slow (past the suite's time budget): CPKV_SLOW_TESTS=1 runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu): on a machine with one, python3 -m pytest -m gpu "
                                   "tests (tools/gpu_check.py runs the same checks in its prepared run)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
