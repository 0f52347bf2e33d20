"""One rank's forward on the shared cache: allocate a batch, compute this rank's
tokens, write their K/V into its own segment, fence, read the whole context.

Every rank runs the same allocator on the same inputs (no planner collective,
[[RFC-0001:C-NO-PLANNER-COLLECTIVE]]); :class:`CPRunner` then computes, per
batch, exactly the tokens on pages its rank owns (the page split), writes their
K/V into its own segment, fences once per layer and attends over the whole
context through the shared view: no all-gather of K/V.

Decode is divided the same way: the rank that owns the page of a request's new
slot computes that request's token (q/k/v, attention over the full context,
MLP, logits) and is the only one that writes it. Over many requests, lane bases
spread those owners evenly.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..consumers.kv_pool import SharedKVPool
from ..contract.allocator import ExtendAllocation, OwnerLaneAllocator
from ..contract.errors import ContractViolation
from ..models import ModelAdapter, paged_attention


class CPRunner:
    """One rank's view of the CP group: its allocator replica, its pool, the model.

    ``extend`` runs a batch (prefill or decode) and returns the logits this rank
    computed; ``collect`` shares them with every rank. ``check_plans`` compares
    every allocation across ranks with one collective (debug only).
    """

    def __init__(self, adapter: ModelAdapter, pool: SharedKVPool, allocator: OwnerLaneAllocator,
                 *, max_requests: int, max_len: int, check_plans: bool = False, distributed: bool = False):
        self.adapter, self.pool, self.allocator = adapter, pool, allocator
        self.rank, self.cp_size = pool.rank, pool.layout.cp_size
        self.check_plans, self.distributed = check_plans, distributed
        # req_to_token: logical slots of request r's positions 0 .. lens[r]-1, padding after
        self.req_to_token = torch.full((max_requests, max_len), pool.layout.padding_value, dtype=torch.int64)
        self.lens = torch.zeros(max_requests, dtype=torch.int64)
        self.tokens_computed = 0

    def _agree(self, alloc: ExtendAllocation) -> None:
        h = hashlib.sha256()
        for t in (alloc.out_cache_loc, alloc.lane_base, alloc.new_pages, alloc.extend_start_loc):
            h.update(t.cpu().numpy().tobytes())
        digests = [None] * self.cp_size
        dist.all_gather_object(digests, h.hexdigest())
        if len(set(digests)) != 1:
            raise ContractViolation(f"ranks planned differently: {digests}")

    def allocate(self, rids: list[int], new_lens: list[int], decode: bool = False) -> ExtendAllocation:
        """Allocate a batch on this rank's allocator replica (identical on every rank)."""
        rows = torch.tensor(rids, dtype=torch.int64)
        prefix = self.lens[rows]
        seq = prefix + torch.tensor(new_lens, dtype=torch.int64)
        if int(seq.max()) > self.req_to_token.shape[1]:
            raise ValueError(f"a request would exceed {self.req_to_token.shape[1]} tokens")
        last = torch.where(prefix > 0, self.req_to_token[rows, (prefix - 1).clamp(min=0)], -1)
        alloc = (self.allocator.allocate_decode(seq, last) if decode
                 else self.allocator.allocate_extend(prefix, seq, last))
        if alloc is None:
            raise MemoryError(f"KV cache full: pages missing per lane {self.allocator.last_deficit.tolist()}")
        self.pool.check(alloc)
        if self.check_plans:
            self._agree(alloc)
        self.req_to_token[rows[alloc.request_of_token], alloc.positions] = alloc.out_cache_loc
        self.lens[rows] = seq
        return alloc

    def forward(self, rids: list[int], alloc: ExtendAllocation, ids: torch.Tensor):
        """Compute this rank's tokens of an allocated batch; ``ids`` are the batch's
        new token ids in flattened order. Returns ``(token_indices, logits)``."""
        ad, pool = self.adapter, self.pool
        split = alloc.rank_split(self.rank)  # taken from the allocation, never re-derived
        idx = split.token_indices
        slots = alloc.out_cache_loc[idx]
        req = alloc.request_of_token[idx]
        pos = split.positions
        # the batch's page table, translated to rank-major once for every layer
        table = self.req_to_token[torch.tensor(rids, dtype=torch.int64), : int(alloc.seq_lens.max())]
        read = pool.read_index(table)
        read = torch.where(read < 0, 0, read)  # padding is masked by position in attention
        h = ad.embed(ids[idx])
        with torch.no_grad():
            for layer in range(ad.num_layers):
                q, k, v = ad.qkv(layer, h, pos)
                pool.write(layer, slots, k, v)
                pool.fence()  # every rank's writes of this layer land before anyone reads
                kc, vc = pool.gather(layer, read)
                h = ad.finish_layer(layer, h, paged_attention(q, req, pos, kc, vc, ad.scaling))
            logits = ad.logits(h)
        pool.fence()  # nobody reads this batch any more: its slots may be freed and reused
        self.tokens_computed += idx.numel()
        return idx, logits

    def extend(self, rids: list[int], new_ids: list[torch.Tensor], decode: bool = False):
        """Allocate and compute one batch. Returns ``(alloc, token_indices, logits)``."""
        alloc = self.allocate(rids, [t.numel() for t in new_ids], decode)
        idx, logits = self.forward(rids, alloc, torch.cat(new_ids))
        return alloc, idx, logits

    def collect(self, alloc: ExtendAllocation, idx: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's logits of a batch, in flattened order, on every rank."""
        if not self.distributed:
            return logits
        parts = [None] * self.cp_size
        dist.all_gather_object(parts, (idx, logits))
        out = torch.empty(alloc.out_cache_loc.numel(), logits.shape[-1], dtype=logits.dtype)
        for i, lg in parts:
            out[i] = lg
        return out

    def finish(self, rid: int) -> None:
        """Free a request's pages."""
        slots = self.req_to_token[rid, : int(self.lens[rid])].clone()
        self.req_to_token[rid] = self.pool.layout.padding_value
        self.lens[rid] = 0
        self.allocator.free(slots)
        self.pool.release(slots)
