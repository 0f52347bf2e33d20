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

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .prefix_match import PrefixMatch
from ..contract.layout import owner_of, page_of, ranges
from .prefix_rules import _as_tokens, _int_vector, check_tails

if TYPE_CHECKING:
    from .radix_tree import RadixTree

__all__ = ["LivePages"]


class LivePages:
    """Mixed into :class:`~cpkv.consumers.prefix_cache.PrefixCache` (which
    provides ``S``, ``N``, ``tree``, ``_attach``, ``_end_insert`` and ``_free_spare``). [[RFC-0001:C-PREFIX-CACHE]] [[RFC-0001:C-OWNER-LANE]]"""

    S: int
    N: int
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
        :func:`~cpkv.consumers.prefix_rules.check_tails`). [[RFC-0001:C-PREFIX-CACHE]]"""
        return bool(self.cache_pages_many([match], tokens, slots, [_size(slots)])[0])

    def cache_pages_many(self, matches: Sequence[PrefixMatch], tokens, slots, counts) -> np.ndarray:
        """:meth:`cache_pages` for a batch, as the calls one by one in order
        would do (a request may find the page another of the batch cached just
        before), checked at once: ``tokens`` and ``slots`` (int64) are the
        runs of the requests back to back, run ``i`` ``counts[i]`` long (whole
        pages, at least one). Returns a bool ``[len(matches)]``, True where the
        run was cached. Raises :class:`PrefixCacheMisuse` with nothing changed
        for any run a single call would refuse, and for a match twice or two
        runs on one page (``match-twice``, ``not-a-page-chain``). The checks
        are vectorised over the batch; what is left per request is its node.
        [[RFC-0001:C-PREFIX-CACHE]]"""
        tokens, arr, counts = self._runs(matches, tokens, slots, counts, "cache_pages", whole_pages=True)
        S, tree = self.S, self.tree
        fresh = [m.node is None and tree.root_of(m.ns) is None for m in matches]  # a namespace's first chain
        parents = [m.node or tree.root_of(m.ns, create=True) for m in matches]
        lanes = owner_of(page_of(arr[::S], S), self.N)  # each page's lane, run after run
        shared = np.fromiter((m.shared for m in matches), np.int64, len(matches))
        grafts = tree.graft_pages(parents, shared, lanes, counts // S) == counts // S
        nodes = tree.attach_many([p if ok else None for p, ok in zip(parents, grafts.tolist())], tokens, arr, counts,
                                 held=True)
        for m, node, c, new in zip(matches, nodes, counts.tolist(), fresh):
            if node is None:  # the tree holds a page of it there, or it would change a chain's lane base
                root = tree.roots.get(m.ns)
                if new and root is not None and not root.children:
                    del tree.roots[m.ns]  # nothing changed: no empty root left behind
                m.live = False
            else:
                m.node, m.shared = node, m.shared + c
        return np.fromiter((n is not None for n in nodes), bool, len(nodes))

    def insert_tail(self, match: PrefixMatch, tokens, slots) -> None:
        """A running request finished: cache the rest of its KV and end
        ``match``, as :meth:`insert` does with the whole sequence, reading
        only ``tokens`` and ``slots`` ``[n]``, its positions from
        ``match.shared`` on (what :meth:`cache_pages` has not cached):
        O(n + the depth of its path). Raises :class:`PrefixCacheMisuse`,
        nothing changed (see :func:`~cpkv.consumers.prefix_rules.check_tails`).
        [[RFC-0001:C-PREFIX-CACHE]]"""
        self.insert_tails([match], tokens, slots, [_size(slots)])

    def insert_tails(self, matches: Sequence[PrefixMatch], tokens, slots, counts) -> None:
        """:meth:`insert_tail` for a batch of finished requests, in order,
        checked at once (runs back to back as in :meth:`cache_pages_many`;
        a run may be empty), and the slots no node keeps freed in one call.
        Raises :class:`PrefixCacheMisuse` with nothing changed for any run a
        single call would refuse, a match twice, or two runs on one page.

        The common ends go in batches (:meth:`_end_simple`): a match whose
        pages are all cached (an empty run), and one whose run is less than a
        page that continues the lane base under its held node, a node with no
        child and no earlier such run of the batch (the run becomes a partial
        leaf there: nothing to walk, split, share or dominate). Any other run
        ends alone, in its place in the order. [[RFC-0001:C-PREFIX-CACHE]]"""
        tokens, arr, counts = self._runs(matches, tokens, slots, counts, "insert_tail", whole_pages=False)
        S, arr, spare = self.S, arr.copy(), []
        starts = np.cumsum(counts) - counts
        part = np.flatnonzero((counts > 0) & (counts < S))
        part = [i for i in part.tolist() if matches[i].node is not None and matches[i].shared > 0]
        leaf_ok = np.zeros(len(matches), dtype=bool)
        if part:  # the partial page continues the lane base of the chain it hangs under
            lanes = owner_of(page_of(arr[starts[part]], S), self.N)
            shared = np.fromiter((matches[i].shared for i in part), np.int64, len(part))
            leaf_ok[part] = self.tree.graft_pages([matches[i].node for i in part], shared, lanes,
                                                  np.ones(len(part), dtype=np.int64)) == 1
        batch, under = [], set()  # the simple ends not yet made, and the nodes their leaves go under
        for i, (m, c) in enumerate(zip(matches, counts.tolist())):
            if c == 0 or (leaf_ok[i] and not m.node.children and m.node not in under):
                batch.append(i)
                if c:
                    under.add(m.node)
                continue
            self._end_simple(matches, tokens, arr, starts, counts, batch)  # in order: those before it end first
            batch, under = [], set()
            spare += self._end_insert(m, tokens[starts[i] : starts[i] + c], arr[starts[i] : starts[i] + c], m.shared, 0)
        self._end_simple(matches, tokens, arr, starts, counts, batch)
        self._free_spare(spare)

    def _end_simple(self, matches, tokens, arr, starts, counts, batch: list) -> None:
        """End ``matches[i]`` for ``i`` in ``batch`` as :meth:`_end_insert`
        would one by one: each unpinned (one tick), then, for a non-empty run,
        its run attached as a partial leaf under its node (one tick). One
        unpin and one attach for the batch, with the ticks the calls one by
        one would take."""
        if not batch:
            return
        c = counts[batch]
        per = 1 + (c > 0)  # ticks each takes
        last = self.tree.now + np.cumsum(per)
        self._end_matches([matches[i] for i in batch], ticks=(last - per + 1).tolist())
        leaf = c > 0
        if leaf.any():
            runs = [batch[j] for j in np.flatnonzero(leaf).tolist()]
            n = c[leaf]
            pos = ranges(starts[runs], n)
            made = self.tree.attach_many([matches[i].node for i in runs], tokens[pos], arr[pos], n, held=False,
                                         ticks=last[leaf].tolist())
            assert all(x is not None for x in made), "a partial leaf's node had a child"

    def _runs(self, matches, tokens, slots, counts, what: str, whole_pages: bool):
        """The checked inputs of a batch: tokens, slots and counts as int64 arrays."""
        tokens, arr = _as_tokens(tokens), _int_vector(slots, "slots", "bad-slots")
        counts = _int_vector(counts, "counts", "bad-counts")
        check_tails(self, list(matches), tokens, arr, counts, what, whole_pages)
        return tokens, arr, counts


def _size(x) -> int:
    """Entries of a 1-D list, array or tensor (its shape is checked later)."""
    return x.numel() if isinstance(x, torch.Tensor) else len(x)
