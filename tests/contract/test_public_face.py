"""``cpkv``'s public face: the cache's names, each from the module that
defines it, and nothing it says raises a warning."""

import warnings

import pytest

import cpkv
from cpkv import OwnerLaneAllocator


def test_the_public_face_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from cpkv import *", {})
        for name in cpkv.__all__:
            getattr(cpkv, name)
        a = OwnerLaneAllocator(256, 4, 2)
        a.allocate_extend([0, 0], [6, 3], [-1, -1])


def test_the_public_face_is_the_cache():
    """The cache's names, and the three an engine integrating it needs beside the cache itself."""
    assert {"PageTable", "Family", "HostTier", "SharedKVLayout", "OwnerLaneAllocator", "PrefixCache",
            "SharedKVPool", "plan_transfer", "KVFormat", "UnsupportedPagePlan"} <= set(cpkv.__all__)
    assert set(cpkv.__all__) <= set(dir(cpkv)) and "engine" in dir(cpkv)
    assert cpkv.PageTable.__module__ == "cpkv.consumers.page_table" and cpkv.engine.__name__ == "cpkv.engine"
    with pytest.raises(AttributeError, match="no attribute 'run_engines'"):
        cpkv.run_engines  # noqa: B018
