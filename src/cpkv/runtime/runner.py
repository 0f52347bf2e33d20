"""One rank's model forward on the shared cache.

Every rank of a CP group holds the same :class:`CPRunner` state (the page
table, one :class:`~cpkv.consumers.page_table.PageTable`: the scheduler's
when one drives the runner) and runs the same calls: allocation is replicated, not
communicated ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). For each batch the runner
builds a :class:`~cpkv.runtime.batch.ForwardBatch` (this rank's tokens under
the chosen split) and runs the model's layers through it; only the split's own
collectives (the fences, and the all-gathers of a token split or of the LSE
decode split) cross ranks.
"""

from __future__ import annotations

import hashlib

import torch

from ..consumers.kv_pool import SharedKVPool
from ..consumers.page_table import PageTable
from ..consumers.replicated import REPLICATED_DECODE_SPLITS, REPLICATED_PREFILL_SPLITS, ReplicatedKVPool
from ..contract.allocator import Allocation, OwnerLaneAllocator
from ..contract.errors import ContractViolation
from ..models import ModelAdapter
from .batch import DECODE_SPLITS, KERNELS, PREFILL_SPLITS, ForwardBatch, default_kernels
from .comm import Comm, LocalComm


class CPRunner:
    """One rank's view of the CP group: the page table, the pool, the model.

    ``table`` is the page table the forwards read: ``page_table`` when given
    (a scheduler's, which writes it once per allocation: the runner then
    copies nothing), else the runner's own ``max_requests`` x ``max_len``
    one, which :meth:`allocate` writes for callers without a scheduler
    (``lens[row]`` then counts each row's positions). ``prefill_split`` and
    ``decode_split`` choose how batches are divided among ranks
    (:mod:`cpkv.runtime.batch`); over a
    :class:`~cpkv.consumers.replicated.ReplicatedKVPool` (every rank a full
    copy) only token splits: ``zigzag`` prefill, ``balanced`` decode. ``kernels`` the data plane, ``"torch"`` or
    ``"triton"`` (default: triton when the pool is on a GPU, else torch).
    Each forward plans its batch once (:class:`~cpkv.runtime.forward_plan.ForwardPlan`)
    and then runs the layers. ``check_plans`` compares every allocation
    across ranks with one collective (debugging only).
    """

    def __init__(self, adapter: ModelAdapter, pool: SharedKVPool, allocator: OwnerLaneAllocator | None = None,
                 comm: Comm | None = None, *, max_requests: int, max_len: int, prefill_split: str = "page",
                 decode_split: str = "owner", check_plans: bool = False, page_table: PageTable | None = None,
                 kernels: str | None = None):
        replicated = isinstance(pool, ReplicatedKVPool)
        prefills, decodes = ((REPLICATED_PREFILL_SPLITS, REPLICATED_DECODE_SPLITS) if replicated
                             else (PREFILL_SPLITS, DECODE_SPLITS))
        if prefill_split not in prefills:
            raise ValueError(f"unknown prefill split {prefill_split!r}; choose from {prefills}")
        if decode_split not in decodes:
            raise ValueError(f"unknown decode split {decode_split!r}; choose from {decodes}")
        self.adapter, self.pool, self.allocator = adapter, pool, allocator
        self.comm = comm or LocalComm()
        rank, size = (pool.group_rank, pool.group_size) if replicated else (pool.rank, pool.layout.cp_size)
        if self.comm.size != size or self.comm.rank != rank:
            raise ValueError(f"comm is rank {self.comm.rank} of {self.comm.size}; the pool is rank {rank} of {size}")
        self.rank, self.cp_size = rank, size
        self.prefill_split, self.decode_split, self.check_plans = prefill_split, decode_split, check_plans
        self.kernels = default_kernels(pool.device) if kernels is None else kernels
        self.plan_per_layer = False  # benchmarks only: re-plan every layer (cpkv before the forward plan)
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.table = page_table or PageTable(max_requests, max_len, pool.layout.padding_value)
        self.lens = torch.zeros(max_requests, dtype=torch.int64)
        self.tokens_computed = 0
        self.kv_read = 0
        self.reads: dict[str, int] = {}  # context entries read, per cache family
        self.moved_bytes = 0
        self.selected: torch.Tensor | None = None  # the last forward's sparse selection (see forward)

    # -- the page table ------------------------------------------------------------------
    @property
    def req_to_token(self) -> torch.Tensor:
        """The page table's slots ``[rows, width]`` (SGLang's ``req_to_token``)."""
        return self.table.req_to_token

    def last_loc(self, rows: torch.Tensor) -> torch.Tensor:
        """Slot of each row's last position (-1 for an empty row)."""
        lens = self.lens[rows]
        return torch.where(lens > 0, self.req_to_token[rows, (lens - 1).clamp(min=0)], -1)

    def record(self, rows: torch.Tensor, alloc: Allocation) -> None:
        """Enter an allocation this runner made (:meth:`allocate`) into its own page table."""
        self.pool.check(alloc)
        self.table.write_allocation(rows, alloc)
        self.lens[rows] = alloc.seq_lens

    def release(self, row: int) -> torch.Tensor:
        """Empty ``row``; returns the slots it held (the caller frees them)."""
        slots = self.req_to_token[row, : int(self.lens[row])].clone()
        self.req_to_token[row] = self.pool.layout.padding_value
        self.lens[row] = 0
        return slots

    def _agree(self, alloc: Allocation) -> None:
        h = hashlib.sha256()
        for t in (alloc.out_cache_loc, alloc.lane_base, alloc.new_pages, alloc.extend_start_loc):
            h.update(t.cpu().numpy().tobytes())
        digests = self.comm.all_gather_object(h.hexdigest())
        if len(set(digests)) != 1:
            raise ContractViolation(f"ranks planned differently: {digests}")

    # -- allocation, for callers without a scheduler of their own --------------------------
    def allocate(self, rows: list[int], new_lens: list[int], decode: bool = False) -> Allocation:
        """Allocate a batch on this rank's allocator replica (identical on every rank) and record it."""
        r = torch.tensor(rows, dtype=torch.int64)
        prefix = self.lens[r]
        seq = prefix + torch.tensor(new_lens, dtype=torch.int64)
        last = self.last_loc(r)
        alloc = (self.allocator.allocate_decode(seq, last) if decode
                 else self.allocator.allocate_extend(prefix, seq, last))
        if alloc is None:
            raise MemoryError(f"KV cache full: pages missing per lane {self.allocator.last_deficit.tolist()}")
        self.record(r, alloc)
        return alloc

    # -- the forward ------------------------------------------------------------------------
    def forward(self, rows: list[int] | torch.Tensor, alloc: Allocation, ids: torch.Tensor,
                decode: bool = False, table: PageTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute this rank's tokens of an allocated batch whose slots are in
        the page table (``table``, default the runner's own), rows ``rows``.

        ``ids [E]`` are the batch's new token ids in flattened order. Returns
        ``(token_indices, logits [t, vocab])``: which entries of the flattened
        batch this rank computed, and their logits. :attr:`selected` is then
        the model's sparse selection of those tokens
        (:meth:`~cpkv.models.ModelAdapter.selection`, on the pool's device;
        ``None`` for a dense model).
        """
        rows = torch.as_tensor(rows, dtype=torch.int64)
        mode = self.decode_split if decode else self.prefill_split
        if self.check_plans:
            self._agree(alloc)
        fb = ForwardBatch(self.pool, self.comm, alloc, (table or self.table).rows(rows), mode, self.kernels,
                          self.plan_per_layer)
        ad = self.adapter
        with torch.no_grad():
            h = ad.embed(ids.to(fb.plan.device)[fb.token_indices])
            for layer in range(ad.num_layers):
                h = ad.layer(layer, h, fb)
            logits = ad.logits(h)
            self.selected = ad.selection(fb)
        fb.finish()
        self.tokens_computed += fb.num_tokens
        self.kv_read += fb.kv_read
        for n, c in fb.reads.items():
            self.reads[n] = self.reads.get(n, 0) + c
        self.moved_bytes += fb.moved_bytes
        if logits.device.type != "cpu":  # once per batch: the host samples and collects
            return fb.token_indices.cpu(), logits.cpu()
        return fb.token_indices, logits

    def collect(self, n: int, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` of a batch of ``n`` tokens, in flattened order,
        on every rank (tokens computed by several ranks agree; any copy is kept)."""
        out = torch.empty((n, *values.shape[1:]), dtype=values.dtype)
        for i, v in self.comm.all_gather_object((idx, values)):
            out[i] = v
        return out

    def extend(self, rows: list[int], new_ids: list[torch.Tensor], decode: bool = False):
        """Allocate and compute one batch. Returns ``(alloc, token_indices, logits)``."""
        alloc = self.allocate(rows, [t.numel() for t in new_ids], decode)
        idx, logits = self.forward(rows, alloc, torch.cat(new_ids), decode)
        return alloc, idx, logits

    def finish(self, row: int) -> None:
        """Free a request's pages (through this runner's allocator)."""
        slots = self.release(row)
        self.allocator.free(slots)
        self.pool.release(slots)
