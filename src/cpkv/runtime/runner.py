"""One rank's model forward on the shared cache.

The runner does the forward only: the batch's requests, their rows, lengths
and new slots come from whoever planned it (the scheduler, with its one
:class:`~cpkv.consumers.page_table.PageTable`; or, without a scheduler, a
:class:`~cpkv.consumers.row_batches.RowBatches`). Every rank of a CP group
runs the same forwards on the same allocations: allocation is replicated, not
communicated ([[RFC-0001:C-NO-PLANNER-COLLECTIVE]]). For each batch the runner
builds a :class:`~cpkv.runtime.batch.ForwardBatch` (this rank's tokens under
the chosen split, planned once from the page table's ``[rows, :L]``) and runs
the model's layers through it; only the split's own collectives (the fences,
the all-gathers of a token split, the exchanges of the log-sum-exp decode
split: :mod:`cpkv.runtime.lse`) cross ranks.
"""

from __future__ import annotations

import hashlib

import torch

from ..consumers.kv_pool import SharedKVPool
from ..consumers.page_table import PageTable
from ..consumers.replicated import REPLICATED_DECODE_SPLITS, REPLICATED_PREFILL_SPLITS, ReplicatedKVPool
from ..contract.allocation import Allocation
from ..contract.errors import ContractViolation
from ..models import ModelAdapter
from ..kernels import BACKENDS
from .forward_plan import CHOSEN_DECODE_SPLITS
from .batch import DECODE_SPLITS, PREFILL_SPLITS, ForwardBatch, default_kernels
from .comm import Comm, LocalComm


class CPRunner:
    """One rank's forward: the pool, the model, the splits.

    ``prefill_split`` and ``decode_split`` choose how batches are divided
    among ranks (:mod:`cpkv.runtime.batch`). A prefill batch of fewer tokens
    than ranks under ``interleave`` (which refuses it: some rank would have no
    token, [[RFC-0001:C-PLANNER-SPLIT]]) runs under the page split, as SGLang
    runs a batch too short to split unsplit: an engine cannot keep every
    batch at N tokens (a last chunk, a request resumed after preemption), and
    refusing it mid-run would lose the run; the page split moves no entry and
    gives the same logits. Over a
    :class:`~cpkv.consumers.replicated.ReplicatedKVPool` (every rank a full
    copy) only token splits: ``zigzag`` prefill, ``balanced`` decode.
    ``kernels`` the data plane, a name of :data:`cpkv.kernels.BACKENDS`
    (default: triton when the pool is on a GPU, else torch). ``decode_split="auto"`` asks
    ``choose_split(alloc)`` for each forward of decodes (``"owner"`` or
    ``"lse"``; every rank must get the same answer from the same
    allocation: a cost model's, :meth:`cpkv.engine.cost_model.CostModel.decode_split`),
    counted in :attr:`decode_choices`. ``record_selection`` keeps each
    forward's sparse selection in :attr:`selected` (``--check``; under
    ``lse`` one more all-to-all a selecting layer). ``check_plans`` compares
    every allocation across ranks with one collective (debugging only).
    Raises ``ValueError`` for an unknown split or kernels, ``auto`` without
    ``choose_split``, or a ``comm`` of another rank or size than the pool.
    """

    def __init__(self, adapter: ModelAdapter, pool: SharedKVPool, comm: Comm | None = None, *,
                 prefill_split: str = "page", decode_split: str = "owner", check_plans: bool = False,
                 kernels: str | None = None, choose_split=None, record_selection: bool = False):
        replicated = isinstance(pool, ReplicatedKVPool)
        prefills, decodes = ((REPLICATED_PREFILL_SPLITS, REPLICATED_DECODE_SPLITS) if replicated
                             else (PREFILL_SPLITS, DECODE_SPLITS))
        if prefill_split not in prefills:
            raise ValueError(f"unknown prefill split {prefill_split!r}; choose from {prefills}")
        if decode_split not in decodes:
            raise ValueError(f"unknown decode split {decode_split!r}; choose from {decodes}")
        if decode_split == "auto" and choose_split is None:
            raise ValueError("decode split 'auto' asks a cost model each step: give choose_split")
        self.adapter, self.pool = adapter, pool
        self.comm = comm or LocalComm()
        rank, size = (pool.group_rank, pool.group_size) if replicated else (pool.rank, pool.layout.cp_size)
        if self.comm.size != size or self.comm.rank != rank:
            raise ValueError(f"comm is rank {self.comm.rank} of {self.comm.size}; the pool is rank {rank} of {size}")
        self.rank, self.cp_size = rank, size
        self.prefill_split, self.decode_split, self.check_plans = prefill_split, decode_split, check_plans
        self.choose_split, self.record_selection = choose_split, record_selection
        self.decode_choices: dict[str, int] = {}  # forwards of decodes per split run (auto: as chosen)
        self.kernels = default_kernels(pool.device) if kernels is None else kernels
        BACKENDS.check(self.kernels)  # ValueError naming the choices
        self.tokens_computed = 0
        self.kv_read = 0
        self.reads: dict[str, int] = {}  # context entries read, per cache family
        self.traffic: dict[str, int] = {}  # bytes received from other ranks, per term (runtime.lse.TERMS)
        self.selected: torch.Tensor | None = None  # the last forward's sparse selection (see forward)
        self.last_traffic = None  # the last forward's runtime.lse.Traffic: bytes by layer and term

    @property
    def moved_bytes(self) -> int:
        """Bytes this rank received from the others in its forwards' collectives
        (every :attr:`traffic` term but reads of other ranks' pages)."""
        return sum(n for t, n in self.traffic.items() if not t.startswith("kv_remote"))

    def _agree(self, alloc: Allocation) -> None:
        h = hashlib.sha256()
        for t in (alloc.out_cache_loc, alloc.lane_base, alloc.new_pages, alloc.extend_start_loc):
            h.update(t.cpu().numpy().tobytes())
        digests = self.comm.all_gather_object(h.hexdigest())
        if len(set(digests)) != 1:
            raise ContractViolation(f"ranks planned differently: {digests}")

    # -- the forward ------------------------------------------------------------------------
    def forward(self, rows: list[int] | torch.Tensor, alloc: Allocation, ids: torch.Tensor,
                decode: bool = False, table: PageTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute this rank's tokens of an allocated batch: request ``i`` of
        ``alloc`` in row ``rows[i]`` of ``table`` (its slots at positions
        ``0 .. seq_len - 1``, the new ones included). The plan reads
        ``table[rows, :L]`` only, ``L`` the batch's longest sequence.

        ``ids [E]`` are the batch's new token ids in flattened order;
        ``decode`` chooses the decode split (else the prefill split). Returns
        ``(token_indices, logits [t, vocab])``: which entries of the flattened
        batch this rank computed, and their logits. With ``record_selection``,
        :attr:`selected` is then the model's sparse selection of those tokens
        (:meth:`~cpkv.models.ModelAdapter.selection`, on the pool's device;
        ``None`` for a dense model, or without ``record_selection``). Raises
        ``TypeError`` without a ``table``."""
        if table is None:
            raise TypeError("forward needs the page table holding the batch's rows (table=)")
        rows = torch.as_tensor(rows, dtype=torch.int64)
        mode = self.decode_split if decode else self.prefill_split
        if mode == "interleave" and alloc.out_cache_loc.numel() < self.cp_size:
            mode = "page"  # too short to interleave (see the class doc)
        if mode == "auto":
            mode = self.choose_split(alloc)
            if mode not in CHOSEN_DECODE_SPLITS:
                raise ValueError(f"choose_split chose {mode!r}; a decode runs {CHOSEN_DECODE_SPLITS}")
        if decode:
            self.decode_choices[mode] = self.decode_choices.get(mode, 0) + 1
        if self.check_plans:
            self._agree(alloc)
        fb = ForwardBatch(self.pool, self.comm, alloc, table.req_to_token, mode, self.kernels, rows=rows)
        ad = self.adapter
        with torch.no_grad():
            h = ad.embed(ids.to(fb.plan.device)[fb.plan.token_indices])
            for layer in range(ad.num_layers):
                h = ad.layer(layer, h, fb)
            logits = ad.logits(h)
            self.selected = ad.selection(fb) if self.record_selection else None
        fb.finish()
        self.tokens_computed += fb.plan.num_tokens
        self.kv_read += fb.kv_read
        for n, c in fb.reads.items():
            self.reads[n] = self.reads.get(n, 0) + c
        for t, c in fb.traffic.by_term().items():
            self.traffic[t] = self.traffic.get(t, 0) + c
        self.last_traffic = fb.traffic
        if logits.device.type != "cpu":  # once per batch: the host samples and collects
            return fb.plan.token_indices.cpu(), logits.cpu()
        return fb.plan.token_indices, logits

    def collect(self, n: int, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Every rank's ``values`` of a batch of ``n`` tokens, in flattened order,
        on every rank (tokens computed by several ranks agree; any copy is kept)."""
        out = torch.empty((n, *values.shape[1:]), dtype=values.dtype)
        for i, v in self.comm.all_gather_object((idx, values)):
            out[i] = v
        return out
