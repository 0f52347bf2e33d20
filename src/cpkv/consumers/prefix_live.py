"""A running request's KV enters the prefix cache as its pages fill
([[RFC-0001:C-PREFIX-CACHE]]): :class:`LivePages`, the two calls of
:class:`~cpkv.consumers.prefix_cache.PrefixCache` that cache a live request
page by page (:meth:`LivePages.cache_pages`) and settle the rest when it
finishes (:meth:`LivePages.insert_tail`), under the same rules as
:meth:`~cpkv.consumers.prefix_cache.PrefixCache.insert` (the request's
namespace, one lane base per cached chain, KV events on attach). Neither reads the request's whole
sequence: a step costs O(its new tokens), whatever the context.

A request arriving while another with the same prefix still runs shares its
full pages (vLLM caches a block when it fills; SGLang caches unfinished
requests). The cached pages stay referenced by the running request, so they
are never evicted under it; its later pages stay private until cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .prefix_match import PrefixMatch
from .prefix_rules import _as_tokens, _int_vector, check_tail

if TYPE_CHECKING:
    from .radix_tree import RadixTree

__all__ = ["LivePages"]


class LivePages:
    """Mixed into :class:`~cpkv.consumers.prefix_cache.PrefixCache` (which
    provides ``S``, ``tree``, ``_attach`` and ``_end_insert``). [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]]"""

    S: int
    tree: "RadixTree"

    def cache_pages(self, match: PrefixMatch, tokens, slots) -> bool:
        """A running request's next full pages have their KV: cache them now,
        so a request arriving while this one runs shares them (vLLM caches a
        block when it fills; SGLang caches unfinished requests).

        ``tokens`` and ``slots`` (int64) ``[k * S]``, ``k >= 1``: positions
        ``match.shared ..`` of the request, on its own pages. They become one
        node under ``match.node`` (or the root of the match's namespace
        ``match.ns``: pages are cached under the request's key only), held by
        the request (referenced until the match ends, so never evicted), and
        announced once to the cache's KV event sink by the tree's attach;
        ``match.shared`` grows by ``k * S`` (a preemption's :meth:`release`
        then frees only the pages past them). O(k * S), whatever the
        request's length (plus the node's path when events are on). Returns
        True; False, with ``match.live`` set False and nothing else changed,
        when the tree already holds a page of those tokens there (another
        request cached them first) or a page would not continue the lane base
        of the chain it joins (:meth:`RadixTree.graft_length`, the rule
        :meth:`insert` keeps): the request keeps its pages private and
        :meth:`insert_tail` settles them at its end as :meth:`insert` would
        (a tail of another lane base goes back to the free lists). Raises
        :class:`PrefixCacheMisuse`, nothing changed (see
        :func:`~cpkv.consumers.prefix_rules.check_tail`). [[RFC-0001:C-PREFIX-CACHE]]"""
        tokens, arr = _as_tokens(tokens), _int_vector(slots, "slots", "bad-slots")
        check_tail(self, match, tokens, arr, "cache_pages", whole_pages=True)
        fresh = match.node is None and self.tree.root_of(match.ns) is None  # the namespace's first chain
        parent = match.node or self.tree.root_of(match.ns, create=True)
        slots = torch.from_numpy(arr.copy())
        if tokens[: self.S] in parent.children or self.tree.graft_length(parent, match.shared, slots) < arr.size:
            if fresh:
                del self.tree.roots[match.ns]  # nothing changed: no empty root left behind
            match.live = False
            return False
        node = self._attach(parent, tokens, slots)
        self.tree.hold_child(node)
        match.node, match.shared = node, match.shared + arr.size
        return True

    def insert_tail(self, match: PrefixMatch, tokens, slots) -> None:
        """A running request finished: cache the rest of its KV and end
        ``match``, as :meth:`insert` does with the whole sequence, reading
        only ``tokens`` and ``slots`` ``[n]``, its positions from
        ``match.shared`` on (what :meth:`cache_pages` has not cached):
        O(n + the depth of its path). Raises :class:`PrefixCacheMisuse`,
        nothing changed (see :func:`~cpkv.consumers.prefix_rules.check_tail`).
        [[RFC-0001:C-PREFIX-CACHE]]"""
        tokens, arr = _as_tokens(tokens), _int_vector(slots, "slots", "bad-slots")
        check_tail(self, match, tokens, arr, "insert_tail", whole_pages=False)
        self._end_insert(match, tokens, torch.from_numpy(arr.copy()), match.shared, 0)
