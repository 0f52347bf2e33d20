"""cpkv's SGLangPrefixCache where SGLang's RadixCache stands, driven through SGLang's own classes and helpers.

Both sides run on SGLang 0.5.23's ``ReqToTokenPool`` (a request's row of slots) and allocate through SGLang's
helpers ``alloc_paged_token_slots_extend`` / ``alloc_paged_token_slots_decode`` (``mem_cache/allocation.py``),
which evict through the cache and call the allocator as SGLang's scheduler does, and ``get_last_loc_torch``.
SGLang's side is its ``RadixCache`` over its ``PagedTokenToKVPoolAllocator``; cpkv's is ``SGLangPrefixCache``
over ``SGLangAllocator``. A finished request on SGLang's side goes through what its ``checkpoint`` +
``release_kv_cache`` do (insert the page-aligned key, free the duplicates and the partial tail, unlock),
re-stated here with the radix cache's own verbs; cpkv's side calls ``cache_finished_req``.

The radix-cache unit cases re-stated from SGLang's ``test/registered/unit/mem_cache/test_radix_cache_unit.py``
(insert/match, sizes, page alignment, extra_key isolation, locks, eviction, reset) are the first tests; then the
differential: the same random admissions, decodes, finishes, aborts, unfinished checkpoints and evictions on
both at N 1 give the same hits, the same slots per request and the same sizes; at N 2, 4 cpkv's side keeps
every request on its owner lanes. [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]]
"""

import random
from array import array
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from cpkv.consumers.prefix_rules import PrefixCacheMisuse
from cpkv.consumers.sglang_cache import SGLangPrefixCache
from cpkv.contract.sglang import SGLangAllocator
from support.sglang_classes import sglang_classes

torch.set_num_threads(1)


class Side:
    """One engine's memory: a ReqToTokenPool, an allocator and a prefix cache, driven as SGLang's scheduler
    drives them."""

    def __init__(self, sg, which: str, size: int, S: int, N: int = 1):
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        self.sg, self.which, self.S = sg, which, S
        self.pool = sg.memory_pool.ReqToTokenPool(size=16, max_context_len=256, device="cpu",
                                                  enable_memory_saver=False)
        if which == "sglang":
            self.alloc = sg.allocator.PagedTokenToKVPoolAllocator(size, S, torch.int64, "cpu", MagicMock(), False)
            cls = sg.radix_cache.RadixCache
        else:
            self.alloc = SGLangAllocator(size, S, torch.int64, "cpu", MagicMock(), False, cp_size=N)
            cls = SGLangPrefixCache
        self.tree = cls(CacheInitParams(disable=False, req_to_token_pool=self.pool,
                                        token_to_kv_pool_allocator=self.alloc, page_size=S))

    def key(self, tokens, extra_key=None, limit=None):
        return self.sg.radix_cache.RadixKey(array("q", tokens), extra_key, limit=limit)

    def admit(self, tokens, extra_key=None):
        """Match (at most len - 1 tokens), lock, take a row, allocate the rest through SGLang's helper."""
        mr = self.tree.match_prefix(self.sg.base.MatchPrefixParams(key=self.key(tokens, extra_key, len(tokens) - 1)))
        n, node = mr.device_prefix_len, mr.last_device_node
        self.tree.inc_lock_ref(node)
        row = self.pool.alloc_rows(1)[0]
        prefix = self.tree.path_device_indices(node)[:n]
        self.pool.write((row, slice(0, n)), prefix.to(torch.int32))
        pre, seq = torch.tensor([n]), torch.tensor([len(tokens)])
        last = self.sg.allocation.get_last_loc_torch(self.pool.req_to_token, torch.tensor([row]), pre)
        out = self.sg.allocation.alloc_paged_token_slots_extend(self.tree, pre, pre, seq, seq, last, len(tokens) - n)
        self.pool.write((row, slice(n, len(tokens))), out.to(torch.int32))
        return SimpleNamespace(req_pool_idx=row, origin_input_ids=list(tokens), output_ids=[], fill_ids=list(tokens),
                               last_node=node, extra_key=extra_key, cache_protected_len=n, prefix_len=n, hit=n)

    def decode(self, reqs, new_tokens):
        idx = torch.tensor([r.req_pool_idx for r in reqs])
        seq = torch.tensor([len(r.fill_ids) for r in reqs])
        last = self.pool.req_to_token[idx, seq - 1].to(torch.int64)
        out = self.sg.allocation.alloc_paged_token_slots_decode(self.tree, seq + 1, seq + 1, last)
        self.pool.write((idx, seq), out.to(torch.int32))
        for r, t in zip(reqs, new_tokens):
            r.output_ids.append(t)
            r.fill_ids = r.fill_ids + [t]

    def row(self, r):
        return self.pool.req_to_token[r.req_pool_idx, : len(r.fill_ids)].tolist()

    def finish(self, r, insert=True):
        if self.which == "cpkv":
            self.tree.cache_finished_req(r, is_insert=insert)
        else:  # what SGLang's checkpoint + release_kv_cache do, with its radix cache's own verbs
            tokens = r.origin_input_ids + r.output_ids
            kv = self.pool.req_to_token[r.req_pool_idx, : len(tokens)].to(torch.int64)
            end = r.cache_protected_len
            if insert:
                key = self.key(tokens, r.extra_key).page_aligned(self.S)
                end = len(key)
                res = self.tree.insert(self.sg.base.InsertParams(key=key, value=kv[:end].clone()))
                self.alloc.free_segment(kv[r.cache_protected_len : res.prefix_len], start_pos=r.cache_protected_len)
            self.alloc.free(kv[end:])
            self.tree.dec_lock_ref(r.last_node)
        self.pool.free_rows([r.req_pool_idx])

    def checkpoint(self, r):
        """A running request's pages enter the cache (SGLang's ``checkpoint``: insert, free the duplicates,
        repoint the row, move the lock)."""
        if self.which == "cpkv":
            self.tree.cache_unfinished_req(r)
            return
        kv = self.pool.req_to_token[r.req_pool_idx, : len(r.fill_ids)].to(torch.int64)
        key = self.key(r.fill_ids, r.extra_key).page_aligned(self.S)
        res = self.tree.insert(self.sg.base.InsertParams(key=key, value=kv[: len(key)].clone()))
        self.alloc.free_segment(kv[r.cache_protected_len : res.prefix_len], start_pos=r.cache_protected_len)
        mr = self.tree.match_prefix(self.sg.base.MatchPrefixParams(key=key))
        new = self.tree.path_device_indices(mr.last_device_node)
        self.pool.write((r.req_pool_idx, slice(r.cache_protected_len, len(new))), new[r.cache_protected_len :].to(torch.int32))
        self.tree.dec_lock_ref(r.last_node)
        self.tree.inc_lock_ref(mr.last_device_node)
        r.last_node, r.cache_protected_len = mr.last_device_node, len(new)

    def sizes(self):
        return (self.alloc.available_size(), self.tree.evictable_size(), self.tree.protected_size(),
                self.tree.total_size())


@pytest.fixture(scope="module")
def sg():
    return sglang_classes()


@pytest.fixture(params=["sglang", "cpkv"])
def side(request, sg):
    return lambda size=256, S=4: Side(sg, request.param, size, S)


# -- SGLang's radix-cache unit cases, re-stated --------------------------------------------------------
def test_finish_then_match_whole_pages(side):
    s = side(256, 4)
    r = s.admit(list(range(1, 11)))  # 10 tokens: 2 whole pages cached, the partial third freed
    s.finish(r)
    assert s.tree.total_size() == 8 and s.tree.evictable_size() == 8 and s.tree.protected_size() == 0
    for q, want in (([1, 2, 3, 4, 5, 6, 7, 8, 9], 8), ([1, 2, 3, 4, 5, 6, 9], 4), ([1, 2, 3], 0), ([9, 9], 0)):
        assert s.tree.match_prefix(s.sg.base.MatchPrefixParams(key=s.key(q))).device_prefix_len == want
    assert s.alloc.available_size() == 256 - 8


def test_extra_key_isolates(side):
    s = side(256, 4)
    s.finish(s.admit(list(range(9)), extra_key="lora-a"))
    assert s.admit(list(range(9)), extra_key="lora-b").hit == 0
    assert s.admit(list(range(9)), extra_key="lora-a").hit == 8


def test_lock_protects_and_evict_counts_tokens(side):
    s = side(256, 4)
    s.finish(s.admit(list(range(1, 10))))
    s.finish(s.admit([50] + list(range(1, 9))))
    r = s.admit(list(range(1, 10)))  # locks the first chain
    assert s.tree.protected_size() == 8 and s.tree.evictable_size() == 8
    res = s.tree.evict(s.sg.base.EvictParams(num_tokens=1))
    assert res.num_tokens_evicted == 8 and s.tree.total_size() == 8  # only the unlocked chain went
    assert s.tree.evict(s.sg.base.EvictParams(num_tokens=100)).num_tokens_evicted == 0
    s.finish(r)
    assert s.tree.evict(s.sg.base.EvictParams(num_tokens=100)).num_tokens_evicted == 8
    assert s.tree.total_size() == 0 and s.alloc.available_size() == 256


def test_reset_and_pretty_print(side, capsys):
    s = side(256, 4)
    s.finish(s.admit(list(range(1, 10))))
    s.tree.pretty_print()
    assert "#tokens: 8" in capsys.readouterr().out
    s.tree.reset()
    assert s.tree.total_size() == 0 and s.tree.evictable_size() == 0 and s.tree.protected_size() == 0


def test_checkpoint_takes_the_trees_pages_frees_the_copies(side):
    """Two requests of the same prompt run at once (neither hits); the first is checkpointed, its 2 whole pages
    enter the tree; the second's checkpoint finds them there: its own copies are freed and its row points at
    the tree's pages, the lock moved (SGLang's cache_unfinished_req)."""
    s = side(256, 4)
    p = list(range(1, 11))
    r1, r2 = s.admit(p), s.admit(p)
    assert r1.hit == r2.hit == 0 and s.alloc.available_size() == 256 - 24
    s.checkpoint(r1)
    s.checkpoint(r2)
    assert s.alloc.available_size() == 256 - 16 and s.row(r2)[:8] == s.row(r1)[:8] != []
    assert s.tree.protected_size() == 8 and s.tree.total_size() == 8
    s.finish(r1)
    s.finish(r2)
    assert s.sizes() == (256 - 8, 8, 0, 8)


# -- the differential ---------------------------------------------------------------------------------
def _prompt(rnd, heads):
    """A prompt sharing a random head (so prefixes hit) and a random tail."""
    head = rnd.choice(heads)
    return head[: rnd.randint(0, len(head))] + [rnd.randint(100, 120) for _ in range(rnd.randint(1, 9))]


def _same_up_to_page_names(rows_a, rows_b, S) -> bool:
    """The live rows hold the same slots up to the names of pages: one bijection of pages maps every row of
    one side to its row of the other, offsets kept (so the same pages are shared by the same requests)."""
    a2b, b2a = {}, {}
    for ra, rb in zip(rows_a, rows_b):
        if len(ra) != len(rb):
            return False
        for x, y in zip(ra, rb):
            if x % S != y % S or a2b.setdefault(x // S, y // S) != y // S or b2a.setdefault(y // S, x // S) != x // S:
                return False
    return True


@pytest.mark.parametrize("seed", range(5))
def test_differential_n1_same_hits_slots_sizes(sg, seed):
    """The same random admissions, decodes, finishes (cached or aborted), checkpoints of running requests and
    evictions on SGLang's RadixCache + paged allocator and on cpkv's at N 1: the same hit for every request, the
    same sizes after every call, and the same slots in every request's row: equal until an eviction of several
    chains (both free the same pages, in their own LRU order: docs/sglang.md), the same up to page names
    after."""
    rnd = random.Random(seed)
    heads = [[rnd.randint(1, 30) for _ in range(14)] for _ in range(3)]
    a, b = Side(sg, "sglang", 1024, 4), Side(sg, "cpkv", 1024, 4)
    live, exact = [], 0
    for _ in range(45):
        op = rnd.choices(["admit", "decode", "finish", "abort", "checkpoint", "evict"], [4, 3, 3, 1, 1, 1])[0]
        if op == "admit" and len(live) < 8:
            p = _prompt(rnd, heads)
            ra, rb = a.admit(p), b.admit(p)
            assert ra.hit == rb.hit
            live.append((ra, rb))
        elif op == "decode" and live:
            batch = rnd.sample(live, rnd.randint(1, len(live)))
            toks = [rnd.randint(1, 30) for _ in batch]
            a.decode([x for x, _ in batch], toks)
            b.decode([y for _, y in batch], toks)
        elif op in ("finish", "abort") and live:
            ra, rb = live.pop(rnd.randrange(len(live)))
            a.finish(ra, insert=op == "finish")
            b.finish(rb, insert=op == "finish")
        elif op == "checkpoint" and live:
            ra, rb = rnd.choice(live)
            a.checkpoint(ra)
            b.checkpoint(rb)
        elif op == "evict":
            n = rnd.choice([10**6, 0])
            assert (a.tree.evict(sg.base.EvictParams(num_tokens=n)).num_tokens_evicted
                    == b.tree.evict(sg.base.EvictParams(num_tokens=n)).num_tokens_evicted)
        rows_a, rows_b = [a.row(x) for x, _ in live], [b.row(y) for _, y in live]
        exact += rows_a == rows_b
        assert _same_up_to_page_names(rows_a, rows_b, 4)
        assert a.sizes() == b.sizes()
    assert exact >= 10  # the rows were equal slot for slot for a good part of the run
    for ra, rb in live:
        a.finish(ra)
        b.finish(rb)
    assert a.sizes() == b.sizes()


@pytest.mark.parametrize("N", [2, 4])
def test_owner_lanes_through_sglang_helpers(sg, N):
    """At N 2 and 4, cpkv's side driven by SGLang's helpers: every request's row keeps its owner lanes (slot
    t on a page of lane (b + t // S) % N) after admissions that hit, decodes, checkpoints and finishes, and
    every page is free again at the end. [[RFC-0001:C-REQUEST-RELATIVE]]"""
    rnd, S = random.Random(N), 4
    heads = [[rnd.randint(1, 30) for _ in range(14)] for _ in range(2)]
    b = Side(sg, "cpkv", 2048, S, N)
    live, hits = [], 0
    for _ in range(40):
        op = rnd.choice(["admit", "admit", "decode", "finish", "checkpoint"])
        if op == "admit":
            r = b.admit(_prompt(rnd, heads))
            hits += r.hit
            live.append(r)
        elif op == "decode" and live:
            b.decode(live, [rnd.randint(1, 30) for _ in live])
        elif op == "finish" and live:
            b.finish(live.pop(rnd.randrange(len(live))))
        elif op == "checkpoint" and live:
            b.checkpoint(rnd.choice(live))
        for r in live:
            lanes = (np.asarray(b.row(r)) // S) % N
            t = np.arange(lanes.size)
            assert ((lanes[0] + t // S) % N == lanes).all()
    assert hits > 0
    for r in live:
        b.finish(r)
    b.tree.evict(10**6)
    assert b.alloc.available_size() == b.alloc.size


def test_misuse_refused_nothing_changed(sg):
    """Locks and requests used wrongly are refused with a rule, the cache and allocator unchanged."""
    b = Side(sg, "cpkv", 256, 4)
    r = b.admit(list(range(1, 10)))
    b.finish(r)
    mr = b.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    node = mr.last_device_node

    def unchanged(rule, call):
        before = (b.tree.cache.snapshot(), b.alloc.allocator.snapshot())
        with pytest.raises(PrefixCacheMisuse) as e:
            call()
        assert e.value.rule == rule
        assert (b.tree.cache.snapshot(), b.alloc.allocator.snapshot()) == before

    unchanged("not-locked", lambda: b.tree.dec_lock_ref(node))
    unchanged("not-a-node", lambda: b.tree.inc_lock_ref("node"))
    b.tree.evict(10**6)
    unchanged("stale-node", lambda: b.tree.inc_lock_ref(node))  # evicted since the match
    r = b.admit(list(range(1, 10)))
    unchanged("reset-while-locked", b.tree.reset)
    r.last_node = node  # a node this request never locked
    unchanged("not-locked", lambda: b.tree.cache_finished_req(r))
