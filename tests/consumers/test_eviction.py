"""Eviction policies: one object per order (LRU, LFU), registered by name,
and lane-aware eviction kept under every one of them: the victim is the
policy's first leaf among those that free a page in a short lane.
[[RFC-0001:C-PREFIX-CACHE]]"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv import OwnerLaneAllocator
from cpkv.consumers.eviction import EVICTION_POLICIES, EvictionPolicy, eviction_policy
from cpkv.consumers.prefix_cache import PrefixCache

from support.cache_engine import SPEC, Engine, lanes_of, reference_victim

def test_every_policy_is_reachable_by_name_and_orders_totally():
    assert EVICTION_POLICIES.names()[0] == "lru" and set(EVICTION_POLICIES) == set(SPEC)
    e = Engine(8, 2, 2)
    e.start(0, (1, 2, 3))
    e.finish(0)
    (leaf,) = e.cache.tree.leaves
    for name in EVICTION_POLICIES:
        p = eviction_policy(name)
        assert isinstance(p, EvictionPolicy) and p.name == name and p is EVICTION_POLICIES.get(name)
        assert p.key(leaf) == SPEC[name](leaf) and p.key(leaf)[-1] == leaf.serial  # serial last: a total order
        assert eviction_policy(p) is p


def test_unknown_policy_refused_with_the_choices():
    alloc = OwnerLaneAllocator(64, 2, 2)
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; choose from lru, lfu"):
        PrefixCache(alloc, eviction="fifo")
    with pytest.raises(TypeError, match="an eviction policy is a name"):
        PrefixCache(alloc, eviction=3)
    assert alloc.lane_free_pages() == alloc.lane_pages.tolist()


def _shared_prompt_then_one_off(eviction: str) -> Engine:
    """A system prompt (1,1,1,1) matched by three requests, then a one-off
    document (2,2,2,2) used once, more recently; one lane, pages of 2."""
    e = Engine(8, 2, 1, eviction=eviction)
    e.start("prompt", (1, 1, 1, 1))
    e.finish("prompt")
    for i in range(3):  # each matches the whole prompt and ends without caching: the prompt stays a leaf
        e.start(i, (1, 1, 1, 1, 9))
        e.abort(i)
    e.start("doc", (2, 2, 2, 2))
    e.finish("doc")
    return e


@pytest.mark.parametrize("eviction, kept", [("lru", (2, 2, 2, 2)), ("lfu", (1, 1, 1, 1))])
def test_lfu_keeps_the_shared_prompt_that_lru_evicts(eviction, kept):
    e = _shared_prompt_then_one_off(eviction)
    hits = {tuple(leaf.key.tolist()): leaf.hits for leaf in e.cache.tree.leaves}
    assert hits == {(1, 1, 1, 1): 3, (2, 2, 2, 2): 0}
    e.cache.evict(np.array([2]))  # one chain of two pages goes
    assert [tuple(leaf.key.tolist()) for leaf in e.cache.tree.leaves] == [kept]


@pytest.mark.parametrize("eviction", list(SPEC))
def test_eviction_stays_lane_aware_under_every_policy(eviction):
    """Two one-page chains in two lanes: whatever the policy prefers, a deficit
    in one lane evicts the chain in that lane."""
    for lane_of_prompt in (0, 1):
        e = Engine(8, 2, 2, eviction=eviction)
        e.start("prompt", (1, 1))
        e.finish("prompt")
        for i in range(2):
            e.start(i, (1, 1, 9))
            e.abort(i)
        e.start("doc", (2, 2))
        e.finish("doc")
        lanes = {tuple(leaf.key.tolist()): lanes_of(leaf, 2, 2) for leaf in e.cache.tree.leaves}
        assert lanes[(1, 1)] != lanes[(2, 2)]  # the lane-base rule put them in different lanes
        target = next(iter(lanes[(1, 1)] if lane_of_prompt else lanes[(2, 2)]))
        deficit = np.zeros(2, dtype=np.int64)
        deficit[target] = 1
        (got,) = e.cache.evict(deficit)
        assert target in {int(p) % 2 for p in np.unique(got.slots.numpy() // 2)}


@st.composite
def _histories(draw):
    S, N = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    steps = draw(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=9).map(tuple),
                                    st.sampled_from(["finish", "abort", "keep"])), min_size=1, max_size=10))
    return S, N, steps, draw(st.sampled_from(list(SPEC))), draw(st.sets(st.integers(0, 2), min_size=1))


@settings(max_examples=150, deadline=None)
@given(_histories())
def test_victim_is_the_policys_first_leaf_that_helps_a_short_lane(history):
    """After any history of requests (cached, aborted or still running), the
    victim for any set of short lanes is the reference's, and ``evict`` takes
    it first."""
    S, N, steps, eviction, short = history
    e = Engine(12, S, N, eviction=eviction)
    for i, (tokens, how) in enumerate(steps):
        if e.start(i, tokens) is not None and how != "keep":
            (e.finish if how == "finish" else e.abort)(i)
    short = {lane % N for lane in short}
    want = reference_victim(e.cache, short)
    assert e.cache.tree.victim(np.isin(np.arange(N), list(short))) is want
    if want is not None:
        tokens = e.cache.tree.prefix_tokens(want)
        deficit = np.isin(np.arange(N), list(short)).astype(np.int64)
        assert np.array_equal(e.cache.evict(deficit)[0].tokens, tokens)


def test_the_policy_reaches_the_cache_from_every_entry_point(monkeypatch):
    """``cpkv run --eviction``, ``cpkv simulate --eviction`` and the Mooncake
    replay's configuration hand the name to the prefix cache they build; a
    configuration with an unknown name is refused when it is made."""
    import cpkv.tools.simulate as sim
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import build_scheduler
    from cpkv.engine.trace import RequestSpec
    from cpkv.tools.cli import build_parser
    from cpkv.tools.commands import run_config
    from cpkv.tools.replay import ReplayConfig, build_replay_scheduler

    args = build_parser().parse_args(["run", "--eviction", "lfu", "--cp", "2", "--device-pages", "16"])
    cfg = run_config(args)
    assert cfg.eviction == "lfu"
    spec = RequestSpec("r", 0, (1, 2, 3), 2)
    assert build_scheduler(cfg, [spec]).cache.tree.policy.name == "lfu"
    assert build_replay_scheduler(ReplayConfig(eviction="lfu"), "shared", [spec], 1e3).cache.tree.policy.name == "lfu"
    for make in (lambda: EngineConfig(eviction="fifo"), lambda: ReplayConfig(eviction="fifo")):
        with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
            make()
    import cpkv.consumers.prefix_cache as pc

    seen = []
    real = pc.PrefixCache
    monkeypatch.setattr(pc, "PrefixCache", lambda alloc, **kw: seen.append(kw["eviction"]) or real(alloc, **kw))
    assert build_parser().parse_args(["simulate", "--eviction", "lfu"]).eviction == "lfu"
    sim.run(sim.longdoc(n=2), eviction="lfu", progress=False)
    assert seen == ["lfu"]
