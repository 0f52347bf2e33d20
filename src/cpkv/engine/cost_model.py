"""A cost model of one scheduler step of a CP group of H200s serving DeepSeek-V3.2.

The simulator (:mod:`cpkv.tools.replay`) replays a trace's milliseconds with
it: every step the scheduler plans is given the time this model says the group
would take. It is a roofline: peak rates, no kernel overhead, ranks balanced,
so its milliseconds are a lower bound; what it is for is the comparison of the
modes at equal work (the same terms, the same constants). The engine's
``--decode-split auto`` asks it which decode split a step should run
(:meth:`CostModel.decode_split`), for the run's own model (:meth:`CostModel.for_adapter`).

Every constant is here, each with its source:

* :data:`H200`: the GPU (NVIDIA's H200 SXM datasheet; the tensor-core rates
  there are quoted with sparsity, halved here to dense);
* :class:`DsaModel`: DeepSeek-V3.2's shapes, from ``transformers``'
  ``DeepseekV32Config()`` (the released model's), and its FP8 checkpoint
  (one byte per linear weight, bf16 embeddings and head); :class:`DenseModel`
  a dense GQA model's (Llama), for the engine's runs;
* the KV bytes per token from the pool's own families
  (:func:`cpkv.models.dsa.real_shape`: ``cpkv bytes``).

:meth:`Hardware.with_results` replaces the GPU's figures by measured ones
(``--gpu-results``: a ``results.json`` with a ``cost_model`` object whose keys
are :class:`Hardware` fields, such as ``tools/gpu_check.py`` writes where it
ran).

One step of the group (per rank, in seconds; N ranks, pages of ``S`` tokens;
the forward's requests have ``s`` tokens of context before it and ``e`` after,
``T = e - s`` new ones at positions ``s .. e - 1``; a key read by every query
is *scanned*: DSA's indexer keys, a dense model's K and V; DSA also reads the
latents of the ``min(position + 1, k)`` keys its top-k *selects*):

* ``linear``: the GEMMs and experts of every new token, compute or weights,
  whichever is slower: ``max(2 A T_all / (N F8) + X, W(T_all) / (N HBM))``,
  ``A`` the active parameters, ``W`` the weight bytes a step reads (the dense part
  and the routed experts its tokens touch: ``1 - (1 - k/E)^T_all`` of them);
  the same in every mode but for ``X``: under the lse split every rank makes
  the queries of every decode token from the gathered ``q_lora`` latent
  (``q_b_proj``, ``W_UK``, the indexer's ``wq_b``) and applies ``W_UV`` to its
  partials, ``(N-1)/N`` of them another rank's tokens
  (:meth:`DsaModel.lse_query_flops`; 0 for a dense model, whose queries are
  gathered made);
* ``attention``: the scan's FLOPs over every visible key (the indexer's ``2 Hi
  Di`` a key and indexer layer at FP8; a dense model's ``4 H D`` a key and
  layer at BF16) and the sparse MLA's over the selected ones (``2 H (kv_lora +
  rope + kv_lora)`` a key and layer, BF16), spread over the ranks; and the KV
  they read: each rank that computes queries of a request reads its context
  once, up to the furthest position its queries see, every scanned key and
  ``min(e, k T)`` selected latents (a decode: one rank reads ``e`` keys; a
  page-split prefill chunk: the owner of each new page up to its page's end).
  Local bytes at HBM rate, bytes on other ranks at NVLink rate:
  ``max(flops, local) + remote``. Replicated and the lse split: everything
  local. The page split and the owner decode split: the scanned keys on
  other ranks' pages exactly (rank ``(b + q) % N`` owns page ``q``, so the
  pages of a reader's own lane are every N-th, whatever the base ``b``:
  :meth:`CostModel.traffic`'s ``kv_remote_read``), and ``(N-1)/N`` of the
  selected latents (``kv_remote_selected``: which keys a top-k selects is the
  data's, balanced on average);
* ``allgather`` (replicated): the new tokens' KV to every rank,
  ``T_all KV (N-1)/N`` bytes over NVLink;
* ``lse_merge`` (shared, lse split, a step of decodes only): the exchanges of
  decode context parallelism (:mod:`cpkv.runtime.lse`), per rank and over
  NVLink: the queries' inputs all-gathered (``(N-1)/N B`` rows a layer of
  ``q_lora`` values in the activation dtype, plus ``Hi`` float32 head weights
  on indexer layers; a dense model's ``H D`` query values), the top-k
  exchange (each rank receives ``(N-1) X m`` float32 scores a selecting
  layer, ``X`` the requests whose context holds more than ``k`` keys, ``m =
  min(k, ceil(2k/N))``; the rare fallback and tie rounds are not counted),
  and the partial outputs all-to-all to each token's rank (``(N-1)/N B`` rows
  a layer of ``H`` heads of ``v_head`` values in the activation dtype, after
  ``W_UV``, and a float32 LSE); no overlap with compute (the engine runs
  them in turn);
* ``pcie``: host loads (shared: each owner loads its pages, ``1/N`` each;
  replicated: every rank its full copy) and host backups (the IO rank copies
  all of them) at PCIe rate.

The step takes ``linear + attention + allgather + lse_merge + pcie``. The
``shared-auto`` mode runs each step of decodes under whichever of the two
decode splits costs less (:meth:`CostModel.decode_split`), never more than
either.

Limits (the model, not the engine): the owner split is taken as balanced (the
engine's owner decode reads max/mean <= 1.1); mid-page copies and the sampler
are not counted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "DenseModel", "DsaModel", "H200", "Hardware", "MODES", "StepCost", "kv_memory_per_rank"]


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
    ``DeepseekV32Config()``) or another DSA model's (:meth:`from_config`:
    GLM-5's, the engine's small ones), and what a step costs per token and key.
    ``index_layers``: the layers that run their own indexer (all of
    DeepSeek-V3.2's; GLM-5's ``full`` ones)."""

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
    index_layers: int

    @classmethod
    def from_config(cls, c) -> "DsaModel":
        """The shapes of a ``transformers`` ``DeepseekV32Config`` or ``GlmMoeDsaConfig``."""
        types = getattr(c, "indexer_types", None)
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                   q_lora=c.q_lora_rank, kv_lora=c.kv_lora_rank, rope=c.qk_rope_head_dim, nope=c.qk_nope_head_dim,
                   v_head=c.v_head_dim, index_heads=c.index_n_heads, index_dim=c.index_head_dim,
                   index_topk=c.index_topk, experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok,
                   moe_inter=c.moe_intermediate_size, shared_experts=c.n_shared_experts,
                   dense_layers=c.first_k_dense_replace, inter=c.intermediate_size, vocab=c.vocab_size,
                   index_layers=c.num_hidden_layers if types is None else sum(t == "full" for t in types))

    @classmethod
    def deepseek_v32(cls) -> "DsaModel":
        """The released model's shapes: ``DeepseekV32Config()``'s defaults."""
        from ..models.dsa import released_config

        return cls.from_config(released_config("deepseek-v3.2"))

    @property
    def topk(self) -> int:
        """Keys a query's top-k selects (``index_topk``)."""
        return self.index_topk

    def params(self) -> dict:
        """Parameters by part: ``attention`` (all layers, MLA and indexer),
        ``dense_mlp``, ``shared_experts``, ``router``, ``routed`` (every routed
        expert), ``embedding`` and ``head``; ``total``; ``active`` (per token:
        all but the routed experts it is not sent to, without the embedding,
        a lookup)."""
        H, h = self.heads, self.hidden
        mla = (h * self.q_lora + self.q_lora * H * (self.nope + self.rope) + h * (self.kv_lora + self.rope)
               + self.kv_lora * H * (self.nope + self.v_head) + H * self.v_head * h)
        indexer = self.q_lora * self.index_heads * self.index_dim + h * self.index_dim + h * self.index_heads
        moe_layers = self.layers - self.dense_layers
        expert = 3 * h * self.moe_inter
        p = {"attention": mla * self.layers + indexer * self.index_layers,
             "dense_mlp": 3 * h * self.inter * self.dense_layers,
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

    def scan_flops(self, hw: Hardware) -> tuple[float, float]:
        """``(FLOPs, rate)`` of one query scanning one key over every layer: the indexer's, at FP8."""
        return self.indexer_flops_per_key() * self.index_layers, hw.fp8_flops

    def select_flops(self, hw: Hardware) -> tuple[float, float]:
        """``(FLOPs, rate)`` of one query attending one selected key over every layer: sparse MLA, at BF16."""
        return self.sparse_flops_per_key() * self.layers, hw.bf16_flops

    def query_bytes(self, act: int) -> int:
        """Bytes a decode token's queries are made from, every layer, under the
        lse split (all-gathered): the ``q_lora`` latent in the activation
        dtype (``act`` bytes a value) and, on indexer layers, the indexer's
        float32 head weights."""
        return self.layers * self.q_lora * act + self.index_layers * self.index_heads * 4

    def partial_bytes(self, act: int) -> int:
        """Bytes of one token's partial attention output and LSE, every layer,
        under the lse split: ``H`` heads of ``v_head`` values (after ``W_UV``)
        in the activation dtype and a float32 LSE."""
        return self.layers * self.heads * (self.v_head * act + 4)

    def lse_query_flops(self) -> int:
        """FLOPs a rank spends on another rank's decode token under the lse
        split, every layer: its queries from the ``q_lora`` latent (``q_b_proj``,
        ``W_UK``, the indexer's ``wq_b``) and ``W_UV`` on its partial."""
        H = self.heads
        per_layer = (self.q_lora * H * (self.nope + self.rope) + H * self.nope * self.kv_lora
                     + H * self.kv_lora * self.v_head)
        return 2 * (self.layers * per_layer + self.index_layers * self.q_lora * self.index_heads * self.index_dim)


@dataclass(frozen=True)
class DenseModel:
    """A dense GQA decoder's shapes (Llama; :meth:`from_config`), with the
    methods :class:`CostModel` asks of a model: every key is scanned (no top-k)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @classmethod
    def from_config(cls, c) -> "DenseModel":
        """The shapes of a ``transformers`` ``LlamaConfig``."""
        D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                   kv_heads=c.num_key_value_heads, head_dim=D, inter=c.intermediate_size, vocab=c.vocab_size)

    topk = None
    experts = experts_per_token = 0

    def params(self) -> dict:
        """Parameters by part (``attention``, ``mlp``, ``embedding``, ``head``), ``total`` and ``active``."""
        h, H, D = self.hidden, self.heads, self.head_dim
        attn = 2 * h * H * D + 2 * h * self.kv_heads * D
        p = {"attention": attn * self.layers, "mlp": 3 * h * self.inter * self.layers,
             "embedding": self.vocab * h, "head": self.vocab * h}
        p["total"] = sum(p.values())
        p["active"] = p["total"] - p["embedding"]
        return p

    def weight_bytes(self) -> tuple[float, float]:
        """``(always read, 0)``: one byte a linear weight, two a head value, as :meth:`DsaModel.weight_bytes`."""
        p = self.params()
        return float(p["attention"] + p["mlp"] + 2 * p["head"]), 0.0

    def scan_flops(self, hw: Hardware) -> tuple[float, float]:
        """``(FLOPs, rate)`` of one query attending one key over every layer: ``4 H D`` a layer at BF16."""
        return 4 * self.heads * self.head_dim * self.layers, hw.bf16_flops

    def select_flops(self, hw: Hardware) -> tuple[float, float]:
        """No top-k: ``(0, rate)``."""
        return 0.0, hw.bf16_flops

    def query_bytes(self, act: int) -> int:
        """A decode token's rotated queries, every layer (all-gathered under the lse split)."""
        return self.layers * self.heads * self.head_dim * act

    def partial_bytes(self, act: int) -> int:
        """One token's partial output (``H`` heads of ``D``) and float32 LSE, every layer."""
        return self.layers * self.heads * (self.head_dim * act + 4)

    def lse_query_flops(self) -> int:
        """0: the gathered queries are made."""
        return 0


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
    split: str = ""  # the decode split the step ran (shared modes, steps of decodes only)

    @property
    def total(self) -> float:
        """The step's time: every term added."""
        return self.linear + self.attention + self.allgather + self.lse_merge + self.pcie


#: The modes a step is modelled in: the replicated baseline, shared with each decode split, and
#: shared with the cheaper of the two each step.
MODES = ("replicated", "shared-owner", "shared-lse", "shared-auto")


class CostModel:
    """The step costs of one group (see the module docstring).

    ``mode`` one of :data:`MODES`; ``cp_size`` ranks; ``kv_latent`` and
    ``kv_index`` the bytes per token over all layers of the selected family
    (DSA's latent; 0 for a dense model) and of the scanned one (DSA's indexer
    keys; a dense model's K and V) (:meth:`for_dtype` reads them from the
    pool's families); ``hw`` and ``model`` the constants (a
    :class:`DsaModel`, default DeepSeek-V3.2, or a :class:`DenseModel`);
    ``page_size`` tokens a page (which pages a rank owns); ``act_bytes`` the
    bytes of an activation value the lse split moves (2: bfloat16 on the
    GPU; 4: the engine's float32 models)."""

    def __init__(self, mode: str, cp_size: int, kv_latent: float, kv_index: float, hw: Hardware = H200,
                 model: DsaModel | DenseModel | None = None, page_size: int = 64, act_bytes: int = 2):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
        for name, v in (("cp_size", cp_size), ("page_size", page_size), ("act_bytes", act_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.mode, self.N, self.hw, self.S, self.act = mode, cp_size, hw, page_size, act_bytes
        self.model = model or DsaModel.deepseek_v32()
        self.kv_latent, self.kv_index = float(kv_latent), float(kv_index)
        m = self.model
        self._always, self._routed = m.weight_bytes()
        self._active = m.params()["active"]

    @classmethod
    def for_dtype(cls, mode: str, cp_size: int, kv_dtype: str, hw: Hardware = H200,
                  page_size: int = 64) -> "CostModel":
        """The model for DeepSeek-V3.2 with its KV stored as ``kv_dtype``
        (``"bfloat16"`` or ``"fp8"``: DeepSeek's 656 + 132 bytes a token and layer)."""
        import torch

        from ..models.dsa import real_shape

        shape = real_shape("deepseek-v3.2")
        fams = {"bfloat16": lambda: shape.families(torch.bfloat16), "fp8": shape.fp8_families}.get(kv_dtype)
        if fams is None:
            raise ValueError(f"kv_dtype must be 'bfloat16' or 'fp8', got {kv_dtype!r}")
        latent, index = fams()
        return cls(mode, cp_size, latent.slot_bytes(), index.slot_bytes(), hw, page_size=page_size)

    @classmethod
    def for_adapter(cls, mode: str, cp_size: int, adapter, kv_dtype: str = "float32", page_size: int = 16,
                    act_bytes: int = 4, hw: Hardware = H200) -> "CostModel":
        """The model of a run's own model (a :class:`~cpkv.models.DsaAdapter`
        or :class:`~cpkv.models.LlamaAdapter`: its shapes and its pool's
        families stored as ``kv_dtype``), ``act_bytes`` its activations'
        bytes (the engine's models: float32) on ``hw``: what the engine's
        ``--decode-split auto`` asks, and what its counted bytes are checked
        against."""
        from ..models import DsaAdapter

        fams = {f.name: f.slot_bytes() for f in adapter.kv_families(kv_dtype)}
        cfg = adapter.model.config
        if isinstance(adapter, DsaAdapter):
            model, latent, index = DsaModel.from_config(cfg), fams["latent"], fams["index_k"]
        else:
            model, latent, index = DenseModel.from_config(cfg), 0, sum(fams.values())
        return cls(mode, cp_size, latent, index, hw, model, page_size=page_size, act_bytes=act_bytes)

    @classmethod
    def for_run(cls, cfg, hw: Hardware = H200) -> "CostModel":
        """The ``shared-auto`` model of an engine run (a
        :class:`~cpkv.engine.config.RunConfig`: its model's shapes, built on
        the meta device, and the group that decodes, its ranks, page size and
        KV dtype: :meth:`~cpkv.engine.config.RunConfig.decode_group`), its
        activations float32 (the engine's models): what a run under
        ``decode_split="auto"`` asks each step (:meth:`decode_split`)."""
        import torch

        from ..models import build_adapter

        with torch.device("meta"):
            adapter = build_adapter(cfg.model)
        ranks, page, kv_dtype = cfg.decode_group()
        return cls.for_adapter("shared-auto", ranks, adapter, kv_dtype, page, act_bytes=4, hw=hw)

    def __repr__(self) -> str:
        return (f"CostModel({self.mode}, {self.N} ranks, page {self.S}, {type(self.model).__name__} of "
                f"{self.model.layers} layers, {self.hw.name})")

    @property
    def kv_token_bytes(self) -> float:
        """KV bytes of one token, every layer and family."""
        return self.kv_latent + self.kv_index

    def traffic(self, starts, ends, *, decode_only: bool = False, split: str | None = None) -> dict[str, float]:
        """Bytes the group moves and reads from other ranks in one step, by
        the engine's terms (:data:`cpkv.runtime.lse.TERMS`), summed over the
        ranks (a rank's share is ``1/N``, the ranks balanced): what
        :attr:`cpkv.runtime.runner.CPRunner.traffic` counts, rank by rank.
        ``split`` the decode split of a shared step of decodes only (default
        the mode's; ``auto``: :meth:`decode_split`'s choice); a shared step
        with a prefill runs the page split. Replicated: ``kv_allgather``;
        shared, page or owner split: ``kv_remote_read`` (scanned keys on
        other ranks' pages, exact) and ``kv_remote_selected`` (the selected
        latents, ``(N-1)/N``); lse: ``query_allgather``, ``topk_exchange``
        (its first round) and ``partial_alltoall``."""
        s, e = _lengths(starts, ends)
        m, N = self.model, self.N
        t = e - s
        if self.mode == "replicated":
            return {"kv_allgather": float(t.sum()) * self.kv_token_bytes * (N - 1)}
        split = self._split(s, e, decode_only, split)
        if split == "lse":
            B, k = float(len(t)), m.topk
            over = float((e > k).sum()) if k is not None else 0.0
            out = {"query_allgather": (N - 1) * B * m.query_bytes(self.act),
                   "partial_alltoall": (N - 1) * B * m.partial_bytes(self.act)}
            if k is not None:
                from ..runtime.lse import exchange_width

                out["topk_exchange"] = N * (N - 1) * over * exchange_width(k, N) * 4.0 * m.index_layers
            return out
        out = {"kv_remote_read": _remote_scan(s, e, self.S, N) * self.kv_index}
        if m.topk is not None:
            out["kv_remote_selected"] = float((np.minimum(e, m.topk * t) * np.minimum(t, N)).sum()) * (N - 1) / N \
                * self.kv_latent
        return out

    def _split(self, s, e, decode_only: bool, split: str | None) -> str:
        """The split a shared step runs: ``page`` with a prefill, else ``split`` or the mode's."""
        if not decode_only:
            return "page"
        split = split or self.mode.removeprefix("shared-")
        if split == "auto":
            return self.decode_split(s, e)
        if split not in ("owner", "lse"):
            raise ValueError(f"split must be 'owner', 'lse' or 'auto', got {split!r}")
        return split

    def decode_split(self, starts, ends) -> str:
        """The decode split a shared step of decodes only costs less under:
        ``"owner"`` or ``"lse"`` (``"owner"`` on a tie). Pure: every rank of a
        group gets the same from the same step."""
        own = self.step(starts, ends, decode_only=True, split="owner").total
        lse = self.step(starts, ends, decode_only=True, split="lse").total
        return "lse" if lse < own else "owner"

    def step(self, starts, ends, *, decode_only: bool = False, load_tokens: int = 0,
             backup_tokens: int = 0, split: str | None = None) -> StepCost:
        """The cost of one step whose forward takes request i from ``starts[i]``
        to ``ends[i]`` tokens of KV (decodes and prefill chunks together,
        ``[R]`` each), ``decode_only`` when every request adds one token and
        no prefill rides along (the decode split applies then: ``split``, or
        the mode's), and moves ``load_tokens`` host -> device and
        ``backup_tokens`` device -> host."""
        s, e = _lengths(starts, ends)
        hw, m, N = self.hw, self.model, self.N
        t = e - s
        T = float(t.sum())
        cost = {"tokens": int(T)}
        if T:
            rep = self.mode == "replicated"
            chosen = None if rep else self._split(s, e, decode_only, split)
            lse = chosen == "lse"
            touched = 1.0 - (1.0 - m.experts_per_token / m.experts) ** T if m.experts else 0.0
            extra = (N - 1) / N * len(t) * m.lse_query_flops() / hw.fp8_flops if lse else 0.0
            cost["linear"] = max(2 * self._active * T / (N * hw.fp8_flops) + extra,
                                 (self._always + self._routed * touched) / (N * hw.hbm_bytes_per_s))
            keys = (e * (e + 1) - s * (s + 1)) / 2  # sum over the new positions p of p + 1
            (fs, rs), (fk, rk) = m.scan_flops(hw), m.select_flops(hw)
            if m.topk is None:
                selected, read = 0.0, e * self.kv_index
            else:
                selected = float((_sum_min(e, m.topk) - _sum_min(s, m.topk)).sum())  # sum of min(p + 1, K)
                read = e * self.kv_index + np.minimum(e, m.topk * t) * self.kv_latent
            flops_s = (fs * float(keys.sum()) / rs + fk * selected / rk) / N
            per_rank = float((read * np.minimum(t, N)).sum()) / N  # bytes each reading rank reads, spread
            moved = self.traffic(s, e, decode_only=decode_only, split=chosen)
            remote = (moved.get("kv_remote_read", 0.0) + moved.get("kv_remote_selected", 0.0)) / N
            local = per_rank - remote
            cost["attention"] = max(flops_s, local / hw.hbm_bytes_per_s) + remote / hw.nvlink_bytes_per_s
            cost["hbm_kv_bytes"] = local
            exchanged = sum(v for k, v in moved.items() if not k.startswith("kv_remote")) / N
            cost["allgather" if rep else "lse_merge"] = exchanged / hw.nvlink_bytes_per_s
            cost["nvlink_bytes"] = remote + exchanged
            if decode_only and not rep:
                cost["split"] = chosen
        loads = load_tokens * self.kv_token_bytes / (1 if self.mode == "replicated" else N)
        cost["pcie"] = (loads + backup_tokens * self.kv_token_bytes) / hw.pcie_bytes_per_s
        return StepCost(**cost)


def _lengths(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """``starts``, ``ends`` as float64 arrays, checked (``ValueError``)."""
    s, e = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    if s.shape != e.shape or s.ndim != 1 or (e < s).any() or (s < 0).any():
        raise ValueError("starts and ends must be 1-D of one length, 0 <= start <= end")
    return s, e


def _remote_scan(s: np.ndarray, e: np.ndarray, S: int, N: int) -> float:
    """Keys of other ranks' pages the page split's readers of each request
    read, summed: the owner of each new page reads the context up to the end
    of its furthest new page (the request's end on the last); its own pages
    are every N-th back from that page (whatever the lane base). Vectorised
    over the (at most N) last new pages of each request."""
    if N == 1 or not s.size:
        return 0.0
    first, last = s // S, np.maximum(e - 1, s) // S  # new pages of each request
    j = last[:, None] - np.arange(N)[None, :]  # each reader's furthest new page: one of the last N
    live = (j >= first[:, None]) & (e > s)[:, None]
    reach = np.minimum((j + 1) * S, e[:, None])  # keys it reads: positions 0 .. reach - 1
    own = (j // N) * S + (reach - j * S)  # its pages j, j - N, ...: full but the furthest
    return float(np.where(live, reach - own, 0.0).sum())


def _sum_min(x: np.ndarray, k: int) -> np.ndarray:
    """``sum_{q=1..x} min(q, k)`` for every entry of ``x``: the first ``min(x, k)`` terms rise by one, the rest are ``k``."""
    m = np.minimum(x, k)
    return m * (m + 1) / 2 + (x - m) * k
