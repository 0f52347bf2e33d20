"""Eviction policies of the prefix cache: which unreferenced chain goes first.

A policy is one object, :class:`EvictionPolicy`: its ``key`` orders the
radix tree's nodes, the smallest evicted first. The tree keeps on every node
what a policy may read: ``last_access`` (the tree's clock when the node was
last used: pinned, unpinned, made or walked through by a caching call),
``hits`` (how many admitted requests matched a prefix through it) and
``serial`` (the order nodes were made, older first: the last tie-break, so
every key orders the nodes totally and every rank evicts alike,
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]]).

The policy orders; the lanes decide. Eviction stays lane-aware whatever the
policy: :meth:`~cpkv.consumers.radix_tree.RadixTree.victim` takes the
policy's first leaf among those that free a page in a short lane (else the
first whose removal exposes an ancestor that does), so a policy never evicts a
chain that does not help the allocation that asked ([[RFC-0001:C-PREFIX-CACHE]]).

The policies, by name (:data:`EVICTION_POLICIES`, ``cpkv run --eviction``,
``cpkv simulate --eviction``), as SGLang's ``evict_policy.py`` names them:

* ``lru``: least recently used first (``(last_access, serial)``), the default;
* ``lfu``: fewest hits first, least recently used among equals
  (``(hits, last_access, serial)``): a system prompt many requests share
  outlives a long one-off document used more recently.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

from ..contract.registry import Registry

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "eviction_policy"]


@dataclass(frozen=True)
class EvictionPolicy:
    """An eviction order: ``key(node)`` is a tuple, the smallest evicted
    first; it must end with the node's ``serial`` (unique), so the order is
    total. ``name`` as registered in :data:`EVICTION_POLICIES`."""

    name: str
    key: Callable[[object], tuple]


#: The eviction policies by name (the first, ``lru``, is the default).
EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")
EVICTION_POLICIES.add("lru", EvictionPolicy("lru", attrgetter("last_access", "serial")),
                      "least recently used chain first")
EVICTION_POLICIES.add("lfu", EvictionPolicy("lfu", attrgetter("hits", "last_access", "serial")),
                      "chain with the fewest prefix hits first, least recently used among equals")


def eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """``policy`` as an :class:`EvictionPolicy`: one given, or the one
    registered under a name (``ValueError`` for an unknown name, ``TypeError``
    for anything else)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"an eviction policy is a name ({', '.join(EVICTION_POLICIES)}) or an EvictionPolicy, "
                        f"got {type(policy).__name__}")
    return EVICTION_POLICIES.get(policy)
