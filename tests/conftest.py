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
    """The tiny random Llama of the engine tests, wrapped in its adapter (built once)."""
    from cpkv.models import LlamaAdapter, TinyLlama

    return LlamaAdapter(TinyLlama().build())
