"""Public contract names that went in cpkv 0.2, kept working for that one
release with a ``DeprecationWarning`` and removed in the next (``CHANGELOG.md``
lists each with what replaces it). Nothing in cpkv calls them.

* ``RankSplit``, ``split_page``, ``split_interleave``: a second rank-split
  API beside the one the runtime uses
  (:func:`cpkv.runtime.forward_plan.split_ranks`); for the tokens a rank
  computes under the page split, ``Allocation.rank_token_indices(rank)``;
* ``ExtendAllocation``: the former name of
  :class:`~cpkv.contract.allocation.Allocation`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .errors import UnsupportedPagePlan

#: The release that removes the names of this module.
REMOVED_IN = "0.3"


def warn_deprecated(old: str, instead: str, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``) that ``old`` goes in :data:`REMOVED_IN`, naming what to use ``instead``."""
    warnings.warn(f"{old} is deprecated and goes in cpkv {REMOVED_IN}; use {instead}", DeprecationWarning,
                  stacklevel=stacklevel)


@dataclass(frozen=True)
class RankSplit:
    """What one rank computes of a batch: ``token_indices`` into the flattened
    batch, ``query_lens[r]`` of request r's tokens (zero when none) and their
    ``positions``. Deprecated."""

    token_indices: torch.Tensor
    query_lens: torch.Tensor
    positions: torch.Tensor


def _split(selected: torch.Tensor, request_of_token: torch.Tensor, positions: torch.Tensor, bs: int) -> RankSplit:
    idx = torch.nonzero(selected).flatten()
    return RankSplit(idx, torch.bincount(request_of_token[idx], minlength=bs), positions[idx])


def split_page(token_owners: torch.Tensor, request_of_token: torch.Tensor, positions: torch.Tensor, bs: int,
               rank: int) -> RankSplit:
    """Deprecated: the tokens on pages ``rank`` owns, as a :class:`RankSplit`."""
    return _split(token_owners == rank, request_of_token, positions, bs)


def split_interleave(request_of_token: torch.Tensor, positions: torch.Tensor, bs: int, rank: int,
                     cp_size: int) -> RankSplit:
    """Deprecated: token i to rank ``i % cp_size``, as a :class:`RankSplit`;
    ``UnsupportedPagePlan("interleave-too-short")`` for fewer tokens than ranks."""
    n = request_of_token.numel()
    if n < cp_size:
        raise UnsupportedPagePlan("interleave-too-short",
                                  f"interleave split needs at least {cp_size} tokens, batch has {n}")
    return _split(torch.arange(n, device=request_of_token.device) % cp_size == rank, request_of_token, positions, bs)


#: name -> (its object, what to use instead), for ``cpkv.__getattr__``.
PUBLIC = {
    "RankSplit": (RankSplit, "Allocation.rank_token_indices(rank) or cpkv.runtime.forward_plan.split_ranks"),
    "split_page": (split_page, "Allocation.rank_token_indices(rank)"),
    "split_interleave": (split_interleave, "cpkv.runtime.forward_plan.interleave_ranks"),
}
