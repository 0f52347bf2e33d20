"""The radix tree's batched shape changes do what their one-by-one forms do.
[[RFC-0001:C-PREFIX-CACHE]]"""

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from support.cache_engine import Engine, admit


@settings(max_examples=30, deadline=None)
@given(S=st.sampled_from([1, 2, 4]), N=st.sampled_from([1, 2, 4]),
       prompts=st.lists(st.lists(st.integers(1, 3), min_size=2, max_size=14), min_size=1, max_size=6),
       order=st.randoms(use_true_random=False))
def test_unpin_many_is_pin_minus_one_in_order(S, N, prompts, order):
    """Unpinning the held nodes of several matches at once leaves the tree,
    its LRU clock and its per-lane counts exactly as ``pin(node, -1)`` one by
    one in the same order."""
    e = Engine(64, S, N)
    for i, p in enumerate(prompts):  # some chains in the tree
        if e.start(i, p) is not None:
            e.finish(i)
    matches = [admit(e.cache, p + [9]) for p in prompts]  # pins their paths
    order.shuffle(matches)
    one, their = copy.deepcopy((e.cache, matches))  # one copy: the matches hold the copy's nodes
    for m in their:
        one.tree.pin(m.node, -1)
    e.cache.tree.unpin_many([m.node for m in matches])
    assert e.cache.snapshot() == one.snapshot()
    assert np.array_equal(e.cache.tree.evictable_lanes, one.tree.evictable_lanes)
