"""SGLang's own unit-test files, unmodified, run with cpkv's classes in SGLang's place.

The files (``SOURCES.md`` beside this file: origin, commit, SHA-256, Apache-2.0) are read from ``files/`` here
or the folder ``$CPKV_SGLANG_TESTS`` names. Each is loaded as a module of its own once per CP size, and the names
below are rebound in that module's globals before its tests run; nothing else in a file changes:

=============================  ==================================================  =====================  ========
file                           SGLang's name -> cpkv's                             test classes run       CP sizes
=============================  ==================================================  =====================  ========
test_allocator_cpu.py          ``PagedTokenToKVPoolAllocator`` ->                  TestPagedAllocatorCPU, 1 2 4 8
                               ``SGLangAllocator(..., cp_size=N)``                 TestPagedAllocator...
                                                                                   DebugModeCPU
test_radix_cache_unit.py       ``RadixCache`` -> ``SGLangPrefixCache`` (its tests  TestRadixCache         1
                               build caches of values they choose, no allocator
                               of cpkv's: lanes do not enter)
test_page_interleave_shard.py  ``PageInterleavePoolAllocator`` ->                  TestClassedAllocator,  2 4 8
                               ``SGLangKVShardAllocator``; the file's shard size   TestEvictUntil...
                               ``N`` (and ``GS = N * PS``) -> the CP size          Allocatable
=============================  ==================================================  =====================  ========

The files' other classes test SGLang's own parts (its token allocator, ``RadixKey``, ``TreeNode``, placement,
pools, unified tree) and are not run. Every test of the classes run passes, or is listed here:

* :data:`DIFFERENCES`: a difference docs/sglang.md states; the entry names the row (its first cell) and a phrase
  of it, which :func:`test_every_difference_is_a_doc_row` finds there. Marked xfail, strict: a change that makes
  one pass fails the suite until the entry goes.
* :data:`SGLANG_FAILS`: SGLang 0.5.23's own class fails it too (the file's version is older than 0.5.23, a test
  written for shard size 4, CUDA). Marked xfail, strict; :func:`test_sglang_fails_too` runs each on SGLang's own
  class and checks that it fails there.

Anything else that fails fails the suite. Without SGLang 0.5.23 (``make test`` installs it) or without the files,
these tests skip with the reason. [[RFC-0001:C-OWNER-LANE]] [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-FAIL-FAST]]
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import os
import re
import unittest
from pathlib import Path

import pytest
import torch

from support.sglang_classes import sglang_classes

HERE = Path(__file__).resolve().parent
FILES = Path(os.environ.get("CPKV_SGLANG_TESTS") or HERE / "files")
DOC = HERE.parents[2] / "docs" / "sglang.md"

#: File -> its SHA-256 (SOURCES.md): the text run is SGLang's, unchanged.
SHA256 = {
    "test_allocator_cpu": "30d7223e0d8a3394f69675245beed1910003991f029f3d9517cd308ba354f008",
    "test_radix_cache_unit": "ab669d20bc7cb94af780fe240bc64081491d78e3e95f90d15e0c7fef562b39f5",
    "test_page_interleave_shard": "9d5b4293f25e0e4fab38a4ed32a53c6faff583296e523b5f5f86e52b454fc35d",
}
#: File -> (the test classes run, the CP sizes).
RUNS = {
    "test_allocator_cpu": (("TestPagedAllocatorCPU", "TestPagedAllocatorDebugModeCPU"), (1, 2, 4, 8)),
    "test_radix_cache_unit": (("TestRadixCache",), (1,)),
    "test_page_interleave_shard": (("TestClassedAllocator", "TestEvictUntilAllocatable"), (2, 4, 8)),
}
ALL = (1, 2, 4, 8)
ANY = object()  # every CP size of the file

#: (file, class, test) -> {CP size or ANY: (docs/sglang.md row: its first cell's call, a phrase of the row)}.
DIFFERENCES = {
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_over_capacity_returns_none"): {
        ANY: ("alloc(need_size)", "more than the whole pool is refused (`exceeds-capacity`)")},
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_alloc_need_sort_oom"): {
        ANY: ("alloc(need_size)", "more than the whole pool is refused (`exceeds-capacity`)")},
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_get_cpu_copy_delegates"): {
        ANY: ("get_cpu_copy(indices)", "cpkv's allocator holds no KV")},
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_load_cpu_copy_delegates"): {
        ANY: ("get_cpu_copy(indices)", "cpkv's allocator holds no KV")},
    ("test_allocator_cpu", "TestPagedAllocatorDebugModeCPU", "test_alloc_unaligned_size_raises"): {
        ANY: ("alloc(need_size)", "`UnsupportedPagePlan` `unaligned-need`, in every mode")},
    ("test_allocator_cpu", "TestPagedAllocatorDebugModeCPU", "test_free_duplicate_pages_raises"): {
        ANY: ("free(free_index)", "`InvalidFree`, in every mode")},
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_alloc_reduces_available_size"): {
        4: ("available_size()", "the kv-shard allocator's min-class floor"),
        8: ("available_size()", "the kv-shard allocator's min-class floor")},
    ("test_allocator_cpu", "TestPagedAllocatorCPU", "test_free_group_batches_until_end"): {
        4: ("available_size()", "the kv-shard allocator's min-class floor"),
        8: ("available_size()", "the kv-shard allocator's min-class floor")},
    ("test_radix_cache_unit", "TestRadixCache", "test_hash_value_storage"): {
        ANY: ("TreeNode", "no `children`, `value` or `hash_value`")},
    ("test_radix_cache_unit", "TestRadixCache", "test_hash_value_split"): {
        ANY: ("TreeNode", "no `children`, `value` or `hash_value`")},
    ("test_page_interleave_shard", "TestClassedAllocator", "test_chain_rotation_run_property"): {
        ANY: ("alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, "
              "num_new_pages=None, rotation_bases=None)", "a continuation needs its `last_loc`")},
    ("test_page_interleave_shard", "TestClassedAllocator", "test_batch_alloc_per_request_rotation"): {
        4: ("alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, "
            "num_new_pages=None, rotation_bases=None)", "a continuation needs its `last_loc`")},
    ("test_page_interleave_shard", "TestClassedAllocator", "test_unsupported_paths_fail_loud"): {
        ANY: ("SGLangKVShardAllocator(size, physical_page_size, shard_size, dtype, device, kvcache, need_sort)",
              "`alloc` and `alloc_decode` allocate")},
}

_FOR_N4 = "the test was written for shard size 4 (its expected counts are 4 lanes')"
#: (file, class, test) -> {CP size or ANY: why SGLang 0.5.23's own class fails it too}.
SGLANG_FAILS = {
    ("test_radix_cache_unit", "TestRadixCache", "test_kv_cache_events"): {
        ANY: "0.5.23 joins a chain's pages into one BlockStored; the test wants one event per page"},
    ("test_radix_cache_unit", "TestRadixCache", "test_hash_value_repeating_tokens"): {
        ANY: "0.5.23 joins a chain's pages into one BlockStored; the test wants one event per page"},
    **({("test_radix_cache_unit", "TestRadixCache", "test_memory_allocated"): {ANY: "it needs CUDA"}}
       if not torch.cuda.is_available() else {}),
    **{("test_page_interleave_shard", "TestClassedAllocator", t): {2: _FOR_N4, 8: _FOR_N4}
       for t in ("test_rotation_worked_example_zero_stranding", "test_min_class_admission_accounting",
                 "test_least_full_root_seeding", "test_free_splits_by_owner_class",
                 "test_batch_alloc_per_request_rotation")},
    ("test_page_interleave_shard", "TestClassedAllocator", "test_batch_alloc_defers_whole_when_a_class_is_short"): {
        8: _FOR_N4},
}


def _entry(table: dict, case: tuple, cp: int):
    row = table.get(case, {})
    return row.get(cp, row.get(ANY))


def _tests_of(stem: str) -> list[tuple[str, str]]:
    """(class, test) of the classes run, read from the file's syntax (nothing imported)."""
    classes, _ = RUNS[stem]
    tree = ast.parse((FILES / f"{stem}.py").read_text(encoding="utf-8"))
    return [(c.name, f.name) for c in tree.body if isinstance(c, ast.ClassDef) and c.name in classes
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]


def _cases() -> list:
    out = []
    for stem, (_, cps) in RUNS.items():
        if not (FILES / f"{stem}.py").is_file():
            out.append(pytest.param(stem, None, None, None, id=f"{stem}-absent",
                                    marks=pytest.mark.skip(reason=f"{stem}.py is not in {FILES}: SOURCES.md says "
                                                                  "where it comes from")))
            continue
        for cls, test in _tests_of(stem):
            for cp in cps:
                diff, fails = _entry(DIFFERENCES, (stem, cls, test), cp), _entry(SGLANG_FAILS, (stem, cls, test), cp)
                marks = ([pytest.mark.xfail(strict=True, reason=f"docs/sglang.md `{diff[0]}`: {diff[1]}")] if diff
                         else [pytest.mark.xfail(strict=True, reason=f"SGLang 0.5.23 fails it too: {fails}")]
                         if fails else [])
                out.append(pytest.param(stem, cls, test, cp, id=f"{stem}::{cls}::{test}::cp{cp}", marks=marks))
    return out


def _sglang():
    """SGLang's modules these files import (skips with the reason without SGLang 0.5.23)."""
    return sglang_classes("allocator", "page_interleave", "radix_cache", "base", "memory_pool", "test_utils")


def _cpkv_names(stem: str, module, cp: int) -> dict:
    """The names rebound in a file's module to put cpkv in SGLang's place at CP size ``cp``."""
    from cpkv.consumers.sglang_cache import SGLangPrefixCache
    from cpkv.contract.sglang import SGLangAllocator, SGLangKVShardAllocator

    if stem == "test_allocator_cpu":
        return {"PagedTokenToKVPoolAllocator": functools.partial(SGLangAllocator, cp_size=cp)}
    if stem == "test_radix_cache_unit":
        return {"RadixCache": SGLangPrefixCache}
    return {"PageInterleavePoolAllocator": SGLangKVShardAllocator, **_shard_size(module, cp)}


def _shard_size(module, cp: int) -> dict:
    return {"N": cp, "GS": cp * module.PS}


@functools.cache
def _module(stem: str, cp: int, cpkv: bool):
    """The file loaded as its own module, its names rebound for cpkv (``cpkv``) or, for SGLang's own classes,
    only its shard size."""
    _sglang()
    name = f"sglang_upstream.{stem}.{'cpkv' if cpkv else 'sglang'}_cp{cp}"
    spec = importlib.util.spec_from_file_location(name, FILES / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = _cpkv_names(stem, module, cp) if cpkv else _shard_size(module, cp) if stem.endswith("shard") else {}
    for key, value in names.items():
        setattr(module, key, value)
    return module


def _run(stem: str, cls: str, test: str, cp: int, cpkv: bool) -> unittest.TestResult:
    """One of the file's tests, as unittest runs it (class fixtures included), on a fresh result."""
    result = unittest.TestResult()
    unittest.TestSuite([getattr(_module(stem, cp, cpkv), cls)(test)]).run(result)
    return result


@pytest.fixture(autouse=True)
def _no_retry(monkeypatch):
    """SGLang's ``CustomTestCase`` retries a failed test once (two seconds later) on CI: not here."""
    monkeypatch.setenv("SGLANG_TEST_MAX_RETRY", "0")


@pytest.mark.parametrize("stem, cls, test, cp", _cases())
def test_upstream(stem, cls, test, cp):
    """One test of SGLang's, cpkv inside at CP size ``cp``: it passes, or its entry says why not."""
    result = _run(stem, cls, test, cp, cpkv=True)
    if result.skipped and not (result.failures or result.errors):
        pytest.skip(result.skipped[0][1])
    if result.failures or result.errors:
        pytest.fail("\n".join(text for _, text in result.failures + result.errors), pytrace=False)


@pytest.mark.parametrize("stem, cls, test, cp", [
    pytest.param(stem, cls, test, cp, id=f"{stem}::{cls}::{test}::cp{cp}")
    for (stem, cls, test), cps in SGLANG_FAILS.items() for cp in (RUNS[stem][1] if ANY in cps else cps)])
def test_sglang_fails_too(stem, cls, test, cp):
    """What :data:`SGLANG_FAILS` says: SGLang 0.5.23's own class fails the test as well."""
    if not (FILES / f"{stem}.py").is_file():
        pytest.skip(f"{stem}.py is not in {FILES}")
    result = _run(stem, cls, test, cp, cpkv=False)
    assert result.failures or result.errors, f"SGLang's own class passes {cls}.{test} at N {cp}: drop the entry"


def test_files_are_sglangs():
    """Each file present is SGLang's text, unchanged (its SHA-256 is the one SOURCES.md gives)."""
    present = [stem for stem in SHA256 if (FILES / f"{stem}.py").is_file()]
    if not present:
        pytest.skip(f"no SGLang test file in {FILES}: SOURCES.md says where they come from")
    for stem in present:
        assert hashlib.sha256((FILES / f"{stem}.py").read_bytes()).hexdigest() == SHA256[stem], stem
    assert SHA256.keys() == RUNS.keys()
    assert {row.split("|")[1].strip(" `") for row in (HERE / "SOURCES.md").read_text().splitlines()
            if row.startswith("| `test_")} == {f"{stem}.py" for stem in SHA256}


def test_every_difference_is_a_doc_row():
    """Each :data:`DIFFERENCES` entry names a row of docs/sglang.md (its first cell) that says the phrase."""
    rows = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("| `"):
            cells = line.split(" | ")
            for call in re.findall(r"`([^`]+)`", cells[0]):
                rows.setdefault(call, []).append(line)
    for case, by_cp in DIFFERENCES.items():
        for call, phrase in by_cp.values():
            assert call in rows, (case, call)
            assert any(phrase in line for line in rows[call]), (case, call, phrase)
    assert not set(DIFFERENCES) & set(SGLANG_FAILS) or all(
        not set(DIFFERENCES[k]) & set(SGLANG_FAILS[k]) for k in set(DIFFERENCES) & set(SGLANG_FAILS))
