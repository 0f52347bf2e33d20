"""Every public name that went or moved in 0.2 still works for that release,
with a ``DeprecationWarning`` naming what replaces it (CHANGELOG.md); the
public face itself warns about nothing."""

import warnings
from pathlib import Path

import pytest
import torch

import cpkv
from cpkv import Allocation, OwnerLaneAllocator, SGLangAllocator
from cpkv.contract import allocation, allocator
from cpkv.contract.sglang import MOVED


def _alloc():
    a = OwnerLaneAllocator(256, 4, 2)
    return a, a.allocate_extend([0, 0], [6, 3], [-1, -1])


def test_the_public_face_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from cpkv import *", {})
        for name in cpkv.__all__:
            getattr(cpkv, name)
        _alloc()


CHANGELOG = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
MOVED_TO_ENGINE = ("run_engine", "EngineConfig", "RunConfig", "DisaggConfig", "run_disagg", "format_disagg",
                   "DisaggFailure", "TransferAborted", "TraceError", "RankFailure", "GroupTooLarge")


@pytest.mark.parametrize("name", MOVED_TO_ENGINE)
def test_the_engine_names_left_cpkv_for_cpkv_engine_and_still_work_with_a_warning(name):
    import cpkv.engine

    assert name not in cpkv.__all__ and name in cpkv.engine.__all__ and f"`cpkv.{name}`" in CHANGELOG
    with pytest.warns(DeprecationWarning, match=rf"cpkv\.{name} is deprecated .* use cpkv\.engine\.{name}"):
        got = getattr(cpkv, name)
    assert got is getattr(cpkv.engine, name)
    with pytest.warns(DeprecationWarning, match=rf"cpkv\.{name}"):
        exec(f"from cpkv import {name}", {})


def test_the_public_face_is_the_cache():
    """The cache's names, and the three an engine integrating it needs beside the cache itself."""
    assert {"PageTable", "Family", "HostTier", "SharedKVLayout", "OwnerLaneAllocator", "PrefixCache",
            "SharedKVPool", "plan_transfer", "KVFormat", "UnsupportedPagePlan"} <= set(cpkv.__all__)
    assert set(cpkv.__all__) <= set(dir(cpkv)) and "engine" in dir(cpkv)
    assert cpkv.PageTable.__module__ == "cpkv.consumers.page_table" and cpkv.engine.__name__ == "cpkv.engine"
    with pytest.raises(AttributeError, match="no attribute 'run_engines'"):
        cpkv.run_engines  # noqa: B018


@pytest.mark.parametrize("module,name", [(cpkv, "ExtendAllocation"), (allocation, "ExtendAllocation"),
                                         (allocator, "ExtendAllocation")])
def test_extend_allocation_is_allocation_with_a_warning(module, name):
    with pytest.warns(DeprecationWarning, match="use Allocation|use cpkv.Allocation"):
        assert getattr(module, name) is Allocation
    with pytest.raises(AttributeError):
        module.NoSuchName  # noqa: B018


def test_the_second_split_api_still_splits_with_a_warning():
    a, r = _alloc()
    with pytest.warns(DeprecationWarning, match="rank_token_indices"):
        split = r.rank_split(1)
    assert torch.equal(split.token_indices, r.rank_token_indices(1))
    assert split.query_lens.sum() == split.token_indices.numel()
    with pytest.warns(DeprecationWarning, match="cpkv.split_page"):
        page = cpkv.split_page(r.token_owners, r.request_of_token, r.positions, r.batch_size, 1)
    assert torch.equal(page.token_indices, split.token_indices)
    with pytest.warns(DeprecationWarning, match="cpkv.RankSplit"):
        assert isinstance(page, cpkv.RankSplit)
    with pytest.warns(DeprecationWarning, match="interleave_ranks"):
        inter = cpkv.split_interleave(r.request_of_token, r.positions, r.batch_size, 1, 2)
    assert (inter.token_indices % 2 == 1).all() and inter.query_lens.sum() == inter.token_indices.numel()


@pytest.mark.parametrize("name", MOVED)
def test_moved_sglang_calls_still_work_on_the_core_with_a_warning(name):
    """Each call that moved to :class:`SGLangAllocator` gives, on the core, what
    the adapter gives on a twin allocator, and warns (naming the adapter)."""
    t = torch.tensor
    args = {
        "alloc_extend": (t([0]), t([0]), t([5]), t([5]), t([-1]), 5),
        "alloc_decode": (t([7]), t([7]), None),
        "alloc": (8,),
        "get_num_new_pages": (t([9]), 4, t([3])),
        "free_segment": (None,),
        "free_segments": (None,),
        "available_size": (),
        "get_cpu_copy": (None,),
        "load_cpu_copy": (None, None),
    }[name]
    results = []
    for moved in (True, False):
        a, r = _alloc()
        row = r.out_cache_loc[:6]
        filled = tuple({"alloc_decode": r.out_cache_loc[5:6], "free_segments": [(row, 0)]}.get(name, row)
                       if x is None else x for x in args)
        if name == "load_cpu_copy":
            filled = (SGLangAllocator.over(a).get_cpu_copy(row), row)
        if name == "free_segment":
            kw = {"start_pos": 0}
        else:
            kw = {}
        if moved:
            with pytest.warns(DeprecationWarning, match=f"SGLangAllocator.over\\(allocator\\).{name}"):
                out = getattr(a, name)(*filled, **kw)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = getattr(SGLangAllocator.over(a), name)(*filled, **kw)
        results.append((out.tolist() if isinstance(out, torch.Tensor) else out, a.snapshot()))
    assert results[0] == results[1]


def test_last_allocation_on_the_core_is_the_deprecated_calls_plan():
    """``alloc.alloc_extend(...)`` then ``alloc.last_allocation`` (the former
    SGLang shape on the core) still gives the plan, with warnings; the core's
    own verbs return theirs and leave it alone."""
    a = OwnerLaneAllocator(256, 4, 2)
    t = torch.tensor
    with pytest.warns(DeprecationWarning):
        out = a.alloc_extend(t([0]), t([0]), t([5]), t([5]), t([-1]), 5)
    a.allocate_extend([0], [3], [-1])
    with pytest.warns(DeprecationWarning, match="last_allocation"):
        assert torch.equal(a.last_allocation.out_cache_loc, out)
