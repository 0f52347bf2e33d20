"""A cost model of one scheduler step of a CP group of H200s serving DeepSeek-V3.2.

The simulator (:mod:`cpkv.tools.replay`) replays a trace's milliseconds with
it: every step the scheduler plans is given the time this model says the group
would take. It is a roofline: peak rates, no kernel overhead, ranks balanced,
so its milliseconds are a lower bound; what it is for is the comparison of the
modes at equal work (the same terms, the same constants).

Every constant is here, each with its source:

* :data:`H200`: the GPU (NVIDIA's H200 SXM datasheet; the tensor-core rates
  there are quoted with sparsity, halved here to dense);
* :class:`DsaModel`: DeepSeek-V3.2's shapes, from ``transformers``'
  ``DeepseekV32Config()`` (the released model's), and its FP8 checkpoint
  (one byte per linear weight, bf16 embeddings and head);
* the KV bytes per token from the pool's own families
  (:func:`cpkv.models.dsa.real_shape`: ``cpkv bytes``).

:meth:`Hardware.with_results` replaces the GPU's figures by measured ones
(``--gpu-results``: a ``results.json`` with a ``cost_model`` object whose keys
are :class:`Hardware` fields, such as ``tools/gpu_check.py`` writes where it
ran).

One step of the group (per rank, in seconds; N ranks; the forward's requests
have ``s`` tokens of context before it and ``e`` after, ``T = e - s`` new ones):

* ``linear``: the GEMMs and experts of every new token, compute or weights,
  whichever is slower: ``max(2 A T_all / (N F8), W(T_all) / (N HBM))``, ``A``
  the active parameters, ``W`` the weight bytes a step reads (the dense part
  and the routed experts its tokens touch: ``1 - (1 - k/E)^T_all`` of them);
  the same in both modes;
* ``attention``: the indexer's scores (``2 Hi Di`` FLOPs per key and layer, FP8)
  over every visible key, and the sparse MLA over ``min(position + 1, topk)``
  keys (``2 H (kv_lora + rope + kv_lora)`` FLOPs per key and layer, bf16),
  spread over the ranks; and the KV it reads: every indexer key of the
  context (``e``) and ``min(e, topk T)`` latents per request, read by the
  ``min(T, N)`` ranks that hold its queries (a decode: one rank; a prefill
  chunk: every rank reads the whole context). Local bytes at HBM rate,
  bytes on other ranks at NVLink rate: ``max(flops, local) + remote``.
  Replicated: everything local. Shared, the page split and the owner decode
  split: ``1/N`` local, ``(N-1)/N`` read from the peers' HBM over NVLink. Shared,
  the lse decode split (a step of decodes only): each rank reads its own pages
  only;
* ``allgather`` (replicated): the new tokens' KV to every rank,
  ``T_all KV (N-1)/N`` bytes over NVLink;
* ``lse_merge`` (shared, lse split, a step of decodes only): every rank
  receives the other ranks' partial outputs, ``(N-1) B L H (kv_lora + 1)``
  fp32 values, and their top-k candidates, ``(N-1) B L topk`` (score,
  position) pairs of 8 bytes;
* ``pcie``: host loads (shared: each owner loads its pages, ``1/N`` each;
  replicated: every rank its full copy) and host backups (the IO rank copies
  all of them) at PCIe rate.

The step takes ``linear + attention + allgather + lse_merge + pcie``.

Limits (the model, not the engine): cpkv's engine scores a DSA lse decode's
top-k on one rank through the shared view; the model's lse split scores each
rank's own keys and merges the candidates (the all-local design the split is
for). The owner split is taken as balanced (the engine's owner decode reads
max/mean <= 1.1); mid-page copies and the sampler are not counted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "DsaModel", "H200", "Hardware", "StepCost", "kv_memory_per_rank"]


@dataclass(frozen=True)
class Hardware:
    """One GPU of the group and its links (peak rates, per direction)."""

    name: str
    hbm_bytes: float  # HBM capacity
    hbm_bytes_per_s: float  # HBM bandwidth
    nvlink_bytes_per_s: float  # NVLink, one direction, all links of one GPU
    pcie_bytes_per_s: float  # host link, one direction
    fp8_flops: float  # dense FP8 tensor-core rate
    bf16_flops: float  # dense BF16 tensor-core rate
    mem_fraction: float  # share of HBM for weights and the KV pool (the rest: activations, graphs, buffers)

    def with_results(self, path: str) -> "Hardware":
        """These figures with the ones a GPU run measured: ``path`` is a JSON
        file with a ``cost_model`` object of :class:`Hardware` fields (numbers
        > 0). ``ValueError`` naming the file and the field for anything else."""
        try:
            with open(path, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read GPU results: {e}") from None
        section = got.get("cost_model") if isinstance(got, dict) else None
        if not isinstance(section, dict) or not section:
            raise ValueError(f"{path}: no 'cost_model' object of measured figures")
        known = {f.name for f in dataclasses.fields(self)} - {"name"}
        for k, v in section.items():
            if k not in known:
                raise ValueError(f"{path}: unknown figure {k!r} in 'cost_model'; known: {sorted(known)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{path}: 'cost_model.{k}' must be a number > 0, got {v!r}")
        return dataclasses.replace(self, name=f"{self.name}, measured ({path})", **section)


#: NVIDIA H200 SXM, from its datasheet: 141 GB HBM3e at 4.8 TB/s; NVLink 4 at 900 GB/s
#: both ways together (450 each way); PCIe Gen5 x16 at 128 GB/s both ways (64 each way);
#: FP8 3,958 and BF16 1,979 TFLOPS quoted with sparsity, so 1,979 and 989.5 dense.
#: ``mem_fraction`` 0.9: a choice of this model (SGLang's ``--mem-fraction-static`` is this
#: share; 10% of HBM left to activations, CUDA graphs and communication buffers).
H200 = Hardware(name="H200 SXM (datasheet)", hbm_bytes=141e9, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9,
                pcie_bytes_per_s=64e9, fp8_flops=1979e12, bf16_flops=989.5e12, mem_fraction=0.9)


@dataclass(frozen=True)
class DsaModel:
    """DeepSeek-V3.2's shapes (:meth:`deepseek_v32`: ``transformers``'
    ``DeepseekV32Config()``) and what a step costs per token and key."""

    layers: int
    hidden: int
    heads: int
    q_lora: int
    kv_lora: int
    rope: int
    nope: int
    v_head: int
    index_heads: int
    index_dim: int
    index_topk: int
    experts: int
    experts_per_token: int
    moe_inter: int
    shared_experts: int
    dense_layers: int
    inter: int
    vocab: int

    @classmethod
    def deepseek_v32(cls) -> "DsaModel":
        """The released model's shapes: ``DeepseekV32Config()``'s defaults."""
        from ..models.dsa import released_config

        c = released_config("deepseek-v3.2")
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                   q_lora=c.q_lora_rank, kv_lora=c.kv_lora_rank, rope=c.qk_rope_head_dim, nope=c.qk_nope_head_dim,
                   v_head=c.v_head_dim, index_heads=c.index_n_heads, index_dim=c.index_head_dim,
                   index_topk=c.index_topk, experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok,
                   moe_inter=c.moe_intermediate_size, shared_experts=c.n_shared_experts,
                   dense_layers=c.first_k_dense_replace, inter=c.intermediate_size, vocab=c.vocab_size)

    def params(self) -> dict:
        """Parameters by part: ``attention`` (all layers, MLA and indexer),
        ``dense_mlp``, ``shared_experts``, ``router``, ``routed`` (every routed
        expert), ``embedding`` and ``head``; ``total``; ``active`` (per token:
        all but the routed experts it is not sent to, without the embedding,
        a lookup)."""
        H, h = self.heads, self.hidden
        attn = (h * self.q_lora + self.q_lora * H * (self.nope + self.rope) + h * (self.kv_lora + self.rope)
                + self.kv_lora * H * (self.nope + self.v_head) + H * self.v_head * h
                + self.q_lora * self.index_heads * self.index_dim + h * self.index_dim + h * self.index_heads)
        moe_layers = self.layers - self.dense_layers
        expert = 3 * h * self.moe_inter
        p = {"attention": attn * self.layers, "dense_mlp": 3 * h * self.inter * self.dense_layers,
             "shared_experts": expert * self.shared_experts * moe_layers, "router": h * self.experts * moe_layers,
             "routed": expert * self.experts * moe_layers, "embedding": self.vocab * h, "head": self.vocab * h}
        p["total"] = sum(p.values())
        p["active"] = p["total"] - p["embedding"] - p["routed"] + expert * self.experts_per_token * moe_layers
        return p

    def weight_bytes(self) -> tuple[float, float]:
        """Bytes of the FP8 checkpoint (one byte per linear weight, two per
        embedding and head value): ``(always read, routed experts)``; the
        embedding is a lookup and is never read whole."""
        p = self.params()
        always = p["attention"] + p["dense_mlp"] + p["shared_experts"] + p["router"] + 2 * p["head"]
        return float(always), float(p["routed"])

    def indexer_flops_per_key(self) -> int:
        """FLOPs of one query scoring one key, one layer: ``2 Hi Di``."""
        return 2 * self.index_heads * self.index_dim

    def sparse_flops_per_key(self) -> int:
        """FLOPs of one query attending to one selected key, one layer, absorbed
        MLA: ``2 H (kv_lora + rope)`` scores and ``2 H kv_lora`` values."""
        return 2 * self.heads * (2 * self.kv_lora + self.rope)


def kv_memory_per_rank(hw: Hardware = H200, model: DsaModel | None = None, cp_size: int = 8) -> int:
    """Bytes of KV an H200 keeps beside its DeepSeek-V3.2 shard (:func:`kv_memory_beside` its checkpoint)."""
    model = model or DsaModel.deepseek_v32()
    always, routed = model.weight_bytes()
    p = model.params()
    return kv_memory_beside(hw, always + routed + 2 * p["embedding"], cp_size)


def kv_memory_beside(hw: Hardware, checkpoint_bytes: float, cp_size: int) -> int:
    """Bytes of KV a GPU keeps beside its shard of a checkpoint spread over the group: ``hbm_bytes x
    mem_fraction - checkpoint_bytes / cp_size`` (negative: the shard alone does not fit)."""
    return int(hw.hbm_bytes * hw.mem_fraction - checkpoint_bytes / cp_size)


@dataclass(frozen=True)
class StepCost:
    """One step's modelled time by term (seconds, the slowest rank); ``total`` their sum."""

    linear: float = 0.0
    attention: float = 0.0
    allgather: float = 0.0
    lse_merge: float = 0.0
    pcie: float = 0.0
    tokens: int = 0  # new tokens of the forward
    nvlink_bytes: float = 0.0  # per rank, received
    hbm_kv_bytes: float = 0.0  # per rank, KV read locally

    @property
    def total(self) -> float:
        """The step's time: every term added."""
        return self.linear + self.attention + self.allgather + self.lse_merge + self.pcie


#: The modes a step is modelled in: the replicated baseline, shared with each decode split.
MODES = ("replicated", "shared-owner", "shared-lse")


class CostModel:
    """The step costs of one group (see the module docstring).

    ``mode`` one of :data:`MODES`; ``cp_size`` ranks; ``kv_latent`` and
    ``kv_index`` the bytes per token over all layers of the latent and the
    indexer keys (:meth:`for_dtype` reads them from the pool's families);
    ``hw`` and ``model`` the constants."""

    def __init__(self, mode: str, cp_size: int, kv_latent: float, kv_index: float, hw: Hardware = H200,
                 model: DsaModel | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
        self.mode, self.N, self.hw = mode, cp_size, hw
        self.model = model or DsaModel.deepseek_v32()
        self.kv_latent, self.kv_index = float(kv_latent), float(kv_index)
        m = self.model
        self._always, self._routed = m.weight_bytes()
        self._active = m.params()["active"]
        self._idx_flops = m.indexer_flops_per_key() * m.layers
        self._sparse_flops = m.sparse_flops_per_key() * m.layers

    @classmethod
    def for_dtype(cls, mode: str, cp_size: int, kv_dtype: str, hw: Hardware = H200) -> "CostModel":
        """The model for DeepSeek-V3.2 with its KV stored as ``kv_dtype``
        (``"bfloat16"`` or ``"fp8"``: DeepSeek's 656 + 132 bytes a token and layer)."""
        import torch

        from ..models.dsa import real_shape

        shape = real_shape("deepseek-v3.2")
        fams = {"bfloat16": lambda: shape.families(torch.bfloat16), "fp8": shape.fp8_families}.get(kv_dtype)
        if fams is None:
            raise ValueError(f"kv_dtype must be 'bfloat16' or 'fp8', got {kv_dtype!r}")
        latent, index = fams()
        return cls(mode, cp_size, latent.slot_bytes(), index.slot_bytes(), hw)

    @property
    def kv_token_bytes(self) -> float:
        """KV bytes of one token, every layer and family."""
        return self.kv_latent + self.kv_index

    def step(self, starts, ends, *, decode_only: bool = False, load_tokens: int = 0,
             backup_tokens: int = 0) -> StepCost:
        """The cost of one step whose forward takes request i from ``starts[i]``
        to ``ends[i]`` tokens of KV (decodes and prefill chunks together,
        ``[R]`` each), ``decode_only`` when every request adds one token and
        no prefill rides along (the lse split applies then), and moves
        ``load_tokens`` host -> device and ``backup_tokens`` device -> host."""
        s, e = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
        if s.shape != e.shape or s.ndim != 1 or (e < s).any() or (s < 0).any():
            raise ValueError("starts and ends must be 1-D of one length, 0 <= start <= end")
        hw, m, N = self.hw, self.model, self.N
        t = e - s
        T = float(t.sum())
        cost = {"tokens": int(T)}
        if T:
            touched = 1.0 - (1.0 - m.experts_per_token / m.experts) ** T
            cost["linear"] = max(2 * self._active * T / (N * hw.fp8_flops),
                                 (self._always + self._routed * touched) / (N * hw.hbm_bytes_per_s))
            K = m.index_topk
            keys = (e * (e + 1) - s * (s + 1)) / 2  # sum over the new positions p of p + 1
            selected = _sum_min(e, K) - _sum_min(s, K)  # sum of min(p + 1, K)
            flops_s = (self._idx_flops * keys.sum() / hw.fp8_flops + self._sparse_flops * selected.sum() / hw.bf16_flops) / N
            read = e * self.kv_index + np.minimum(e, K * t) * self.kv_latent  # bytes each reading rank reads
            per_rank = float((read * np.minimum(t, N)).sum()) / N
            lse = self.mode == "shared-lse" and decode_only
            local = per_rank if self.mode == "replicated" or lse else per_rank / N
            remote = per_rank - local
            cost["attention"] = max(flops_s, local / hw.hbm_bytes_per_s) + remote / hw.nvlink_bytes_per_s
            cost["hbm_kv_bytes"], nvlink = local, remote
            if self.mode == "replicated":
                moved = T * self.kv_token_bytes * (N - 1) / N
                cost["allgather"] = moved / hw.nvlink_bytes_per_s
                nvlink += moved
            if lse:
                merged = (N - 1) * len(t) * m.layers * (m.heads * (m.kv_lora + 1) * 4 + K * 8)
                cost["lse_merge"] = merged / hw.nvlink_bytes_per_s
                nvlink += merged
            cost["nvlink_bytes"] = nvlink
        loads = load_tokens * self.kv_token_bytes / (1 if self.mode == "replicated" else N)
        cost["pcie"] = (loads + backup_tokens * self.kv_token_bytes) / hw.pcie_bytes_per_s
        return StepCost(**cost)


def _sum_min(x: np.ndarray, k: int) -> np.ndarray:
    """``sum_{q=1..x} min(q, k)`` for every entry of ``x``: the first ``min(x, k)`` terms rise by one, the rest are ``k``."""
    m = np.minimum(x, k)
    return m * (m + 1) / 2 + (x - m) * k
