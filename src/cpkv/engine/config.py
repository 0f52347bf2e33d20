"""The run configuration, written once: what the engine, the disaggregation driver and ``cpkv run`` share.

:class:`RunConfig` holds the model, the caches, the scheduler's policies, the
splits and the trace; its defaults are the ``cpkv run`` defaults (the command
reads them from here), so a run built in Python and the same run from the
command line are the same run. :class:`EngineConfig` adds one CP group's size,
:class:`DisaggConfig` a prefill group and a decode group.

A configuration is a plain value: making one reads nothing of this machine.
The run is sized at launch (:meth:`RunConfig.sized`, which every launcher
calls once, before anything is built): the device cache from memory unless
``device_pages`` is given (``kv_memory`` bytes per rank, or by default a
budget from this machine's available memory,
:func:`cpkv.runtime.sizing.default_kv_memory`, turned into pages per rank by
:func:`cpkv.runtime.sizing.pages_for_memory`) and the data plane from the
device unless ``kernels`` is given; the ranks receive the sized copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from ..consumers.eviction import EVICTION_POLICIES
from .mooncake import load_mooncake, mooncake_path
from .trace import WORKLOADS, RequestSpec, load_jsonl

if TYPE_CHECKING:
    from ..models import ModelConfig, TinyLlama


def _tiny_llama() -> "TinyLlama":
    """The default model (imported here: importing this module imports no torch, so ``cpkv``'s up-front
    checks read the defaults below before anything heavy, :mod:`cpkv.tools.sizes`)."""
    from ..models import TinyLlama

    return TinyLlama()


@dataclass
class RunConfig:
    """One serving run: the model, the caches, the policies, the trace.

    ``page_size`` tokens per page; ``device_pages`` KV pages per rank (per
    owner lane; lane 0 holds one fewer, page 0 being reserved): when ``None``
    (the default) it is sized at launch (:meth:`sized`) from ``kv_memory``
    bytes per rank, or, when that is ``None`` too, from this machine's
    available memory (:meth:`memory_pages`); a given ``device_pages`` wins
    over ``kv_memory``.
    ``host_pages`` pages of the host tier (0: none); ``chunk``
    prefill tokens per step, all requests together; ``max_running`` requests
    at once; ``admission`` ``"lanes"`` or ``"none"``; the prefill and decode
    splits (:data:`~cpkv.runtime.batch.PREFILL_SPLITS`, ``DECODE_SPLITS``);
    ``kv_dtype`` what the caches store (:data:`~cpkv.models.KV_DTYPES`:
    ``"float32"``, ``"bfloat16"`` or ``"fp8"``, the model's FP8 formats;
    pools, host tier and transfers alike); ``workload`` a built-in trace, a JSONL path or a Mooncake trace
    (``mooncake:PATH``, or a file recognised by its fields: :mod:`cpkv.engine.mooncake`), with ``requests`` and
    ``scale`` for the built-in ones; a Mooncake trace takes its first ``requests``, those arriving in its first
    ``window_ms`` (None: all), at ``block_tokens`` tokens a hash id (its lengths scaled with them), outputs
    capped at ``max_output`` (None: none), each arriving at step ``timestamp // step_ms``;
    ``check`` compares with ``transformers``;
    ``model`` the configuration of a model family (:func:`cpkv.models.model_config`, one of
    :data:`~cpkv.models.MODELS`); ``eviction`` the prefix cache's eviction policy (a name of
    :data:`~cpkv.consumers.eviction.EVICTION_POLICIES`: ``"lru"``, ``"lfu"``; eviction stays lane-aware);
    ``wait_for_prefix`` the scheduler's in-batch prefix rule (a request waits
    for the pages of a prefix another running request is computing, then hits
    them: :class:`~cpkv.engine.scheduler.Scheduler`; ``False`` computes them
    again, the same tokens);
    ``check_plans`` (debug) adds one collective per batch comparing every
    rank's allocation; ``timeout`` seconds for the whole run; ``progress`` a
    progress bar on rank 0 (the command turns it on).
    ``decode_split="auto"`` (the default) chooses each step of decodes' split
    with ``decode_costs``, a cost model of the group that decodes (anything
    with ``decode_split(starts, ends) -> "owner" | "lse"`` and ``N`` its
    ranks; ``None``: :meth:`sized` builds
    :meth:`cpkv.engine.cost_model.CostModel.for_run`'s): the split it prices
    lower, so never dearer in the model than ``"owner"`` or ``"lse"``
    throughout, both exact.

    ``kv`` is ``"shared"`` (one owner-lane cache for the group) or
    ``"replicated"`` (the baseline: every rank a full copy,
    :mod:`cpkv.consumers.replicated`; its splits are :meth:`splits`).
    ``kv_memory`` bytes per rank give the same ``device_pages`` in either mode
    (:func:`~cpkv.runtime.sizing.pages_for_memory`): the shared group then
    holds N times the pages of the replicated one
    (:func:`~cpkv.runtime.sizing.group_pages`).
    ``kv_events`` a ZMQ
    endpoint (``tcp://127.0.0.1:5557``) where rank 0 binds, before the first
    step, a publisher of the prefix cache's KV events in vLLM's format
    (``None``: no events), ``kv_events_replay`` where it binds vLLM's replay
    socket (``None``: none), keeping ``kv_events_buffer`` batches for replay
    ([[RFC-0001:C-KV-EVENTS]]); with ``kv_events_relay`` (the
    :attr:`~cpkv.consumers.kv_events_zmq.KVEventPublisher.relay_endpoint` of
    a publisher another process bound on those endpoints: ``cpkv run``'s
    launcher, before anything slow) rank 0 binds nothing and hands its batches
    there.
    ``device`` where the model and the KV cache live (``"cpu"``, or
    ``"cuda"``: each rank's KV segment on its GPU, :mod:`cpkv.runtime.device`;
    not yet run on hardware); ``kernels`` the data plane, ``"torch"``
    or ``"triton"`` (``None``: triton on a GPU, torch on the CPU, resolved at
    launch).
    """

    page_size: int = 16
    device_pages: int | None = None
    kv_memory: int | None = None
    host_pages: int = 96
    chunk: int = 64
    max_running: int = 16
    admission: str = "lanes"
    prefill_split: str = "page"
    decode_split: str = "auto"
    kv_dtype: str = "float32"
    workload: str = "multiturn"
    requests: int = 8
    scale: float = 0.1
    seed: int = 0
    block_tokens: int = 16
    window_ms: int | None = None
    max_output: int | None = None
    step_ms: float = 1000.0
    model: ModelConfig = field(default_factory=_tiny_llama)
    check: bool = False
    check_plans: bool = False
    timeout: float = 300.0
    progress: bool = False
    kv: str = "shared"
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_buffer: int = 10_000
    kv_events_relay: str | None = None
    device: str = "cpu"
    kernels: str | None = None
    wait_for_prefix: bool = True
    eviction: str = "lru"
    decode_costs: Any = None

    @property
    def replicated(self) -> bool:
        """Whether every rank keeps a full copy of the cache (``kv="replicated"``)."""
        return self.kv == "replicated"

    def splits(self) -> tuple[str, str]:
        """The (prefill, decode) splits the ranks run: ``prefill_split`` and
        ``decode_split`` for the shared cache; for a replicated one the token
        splits of :mod:`cpkv.consumers.replicated` (zigzag prefill, decode
        tokens dealt by context length), whatever the two fields say."""
        if not self.replicated:
            return self.prefill_split, self.decode_split
        from ..consumers.replicated import REPLICATED_DECODE_SPLITS, REPLICATED_PREFILL_SPLITS

        return REPLICATED_PREFILL_SPLITS[0], REPLICATED_DECODE_SPLITS[0]

    def decode_group(self) -> tuple[int, int, str]:
        """The group that decodes: its ranks, page size and KV dtype (what
        ``decode_split="auto"``'s cost model is of)."""
        return self.cp_size, self.page_size, self.kv_dtype

    def __post_init__(self):
        if self.kv not in KV_MODES:
            raise ValueError(f"unknown kv {self.kv!r}; choose from {KV_MODES}")
        EVICTION_POLICIES.get(self.eviction)  # ValueError naming the choices
        if not isinstance(self.wait_for_prefix, bool):
            raise ValueError(f"wait_for_prefix must be a bool, got {self.wait_for_prefix!r}")
        if self.kv_memory is not None and (isinstance(self.kv_memory, bool) or not isinstance(self.kv_memory, int)
                                           or self.kv_memory < 1):
            raise ValueError(f"kv_memory must be None or an int >= 1 (bytes per rank), got {self.kv_memory!r}")

    def sized(self, capacity=None):
        """This run sized at launch: a copy whose ``device_pages`` is
        :meth:`memory_pages` (``capacity``: this machine's, default now) where
        it is ``None``, and whose ``kernels`` is the device's default
        (:func:`~cpkv.runtime.batch.default_kernels`) where it is ``None``;
        what is given stays. The launchers call it once, before anything is
        built; ``ValueError`` when ``kv_memory`` holds no page."""
        from ..runtime.batch import default_kernels

        pages = self.memory_pages(capacity) if self.device_pages is None else self.device_pages
        kernels = default_kernels(self.device) if self.kernels is None else self.kernels
        costs = self.decode_costs
        if costs is None and self.decode_split == "auto" and not self.replicated:
            from .cost_model import CostModel

            costs = CostModel.for_run(self)
        return replace(self, device_pages=pages, kernels=kernels, decode_costs=costs)

    def check_sized(self) -> None:
        """Refuse (``ValueError``) a configuration whose device cache is not
        sized yet (``device_pages`` ``None``: :meth:`sized` sizes it at
        launch), before a scheduler or a footprint is built from it."""
        if self.device_pages is None:
            raise ValueError("device_pages is None: the cache is sized at launch; launch this configuration, or "
                             "size it first with cfg.sized()")

    #: Ranks whose memory the default budget is shared by (the subclasses' groups).
    world_size = 1

    def page_bytes(self) -> int:
        """Bytes of one device KV page on its owner, every cache family of
        ``model`` together as stored in ``kv_dtype``: ``page_size`` times the
        families' ``slot_bytes``."""
        import torch

        from ..models import build_adapter

        with torch.device("meta"):
            adapter = build_adapter(self.model)
        return self.page_size * sum(f.slot_bytes() for f in adapter.kv_families(self.kv_dtype))

    def memory_pages(self, capacity=None) -> int:
        """Device pages per rank from memory (:func:`device_pages_for`):
        ``kv_memory`` bytes per rank, or the default budget of this machine
        (``capacity``, default now) for :attr:`world_size` ranks. ``ValueError``
        when ``kv_memory`` holds no page."""
        return device_pages_for(self.kv_memory, self.page_bytes(), world_size=self.world_size,
                                host_pages=self.host_pages, capacity=capacity)

    def trace(self) -> list[RequestSpec]:
        """The requests of this run (``TraceError``/``OSError`` for a bad JSONL or Mooncake file,
        ``ValueError`` for a Mooncake slice with no request)."""
        return load_trace(self.workload, vocab=self.model.vocab, requests=self.requests, scale=self.scale,
                          seed=self.seed, block_tokens=self.block_tokens, window_ms=self.window_ms,
                          max_output=self.max_output, step_ms=self.step_ms)

    def run_fields(self) -> dict:
        """This configuration's :class:`RunConfig` fields by name (what another
        driver's configuration takes over from it)."""
        return {f.name: getattr(self, f.name) for f in fields(RunConfig)}

    def public(self) -> dict:
        """The fields a report shows (``asdict``, the model as its family and
        fields, the decode split's cost model by its name)."""
        costs = self.decode_costs
        return {**asdict(replace(self, decode_costs=None)),
                "model": {"family": type(self.model).__name__, **asdict(self.model)},
                "decode_costs": None if costs is None else str(costs)}


def device_pages_for(kv_memory: int | None, page_bytes: int, *, world_size: int, host_pages: int,
                     capacity=None) -> int:
    """Device pages per rank from memory, the one rule: ``kv_memory`` bytes per
    rank, or (``None``) the default budget of this machine (``capacity``,
    default now) for ``world_size`` ranks beside a host tier of ``host_pages``,
    through :func:`~cpkv.runtime.sizing.pages_for_memory`. ``ValueError``
    when ``kv_memory`` holds no page of ``page_bytes``; the default takes at
    least :data:`MIN_DEFAULT_PAGES` (a machine that cannot hold them is
    refused by the capacity check). Imports nothing heavy."""
    from ..runtime.sizing import default_kv_memory, pages_for_memory

    if kv_memory is not None:
        return pages_for_memory(kv_memory, page_bytes)
    budget = default_kv_memory(world_size, other_bytes=host_pages * page_bytes, capacity=capacity)
    return pages_for_memory(max(budget, MIN_DEFAULT_PAGES * page_bytes), page_bytes)


def load_trace(workload: str, *, vocab: int, requests: int, scale: float, seed: int, block_tokens: int,
               window_ms: int | None, max_output: int | None, step_ms: float) -> list[RequestSpec]:
    """The requests ``workload`` names, as :meth:`RunConfig.trace` reads them (its fields by name): a built-in
    trace (``requests``, ``scale``, ``seed``), a Mooncake trace (its slice and scaling) or a JSONL file; token
    ids below ``vocab``. ``TraceError``/``OSError`` for a bad file, ``ValueError`` for a Mooncake slice with no
    request. Imports nothing heavy."""
    if workload in WORKLOADS:
        return WORKLOADS[workload](requests, seed=seed, vocab=vocab, scale=scale)
    path = mooncake_path(workload)
    if path is not None:
        return load_mooncake(path, block=block_tokens, requests=requests, window_ms=window_ms,
                             max_output=max_output, step_ms=step_ms, vocab=vocab).specs
    return load_jsonl(workload, vocab=vocab)


#: Fewest device pages per rank the default budget gives.
MIN_DEFAULT_PAGES = 8


#: The device cache's modes: one shared owner-lane cache, or a full copy on every rank (the baseline).
KV_MODES = ("shared", "replicated")


@dataclass
class EngineConfig(RunConfig):
    """One engine run: a :class:`RunConfig` on a CP group of ``cp_size`` ranks."""

    cp_size: int = 4

    @property
    def world_size(self) -> int:
        """Ranks of the group."""
        return self.cp_size


@dataclass
class DisaggConfig(RunConfig):
    """One disaggregated run: a :class:`RunConfig` on a prefill group and a decode group.

    ``prefill_size`` (M) and ``decode_size`` (N) ranks; ``page_size`` and
    ``device_pages`` (pages per rank) are the prefill group's, ``decode_page``
    and ``decode_pages`` the decode group's (defaults: the prefill group's
    page size and the same tokens per rank). The host tier (``host_pages``)
    belongs to the prefill group. ``transfer_timeout`` seconds bound one
    point-to-point transfer. ``decode_kv_dtype`` is the decode group's KV
    dtype (default ``kv_dtype``): the two groups must agree, since a transfer
    moves stored bytes, and every rank refuses a disagreement at the start,
    before any byte moves.
    """

    prefill_size: int = 2
    decode_size: int = 2
    decode_page: int | None = None
    decode_pages: int | None = None
    transfer_timeout: float = 60.0
    decode_kv_dtype: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks of both groups."""
        return self.prefill_size + self.decode_size

    @property
    def d_page(self) -> int:
        """The decode group's page size."""
        return self.decode_page or self.page_size

    @property
    def d_kv_dtype(self) -> str:
        """The decode group's KV dtype."""
        return self.decode_kv_dtype or self.kv_dtype

    def decode_group(self) -> tuple[int, int, str]:
        """The decode group: its ranks, page size and KV dtype (``decode_split="auto"``'s cost model is of it;
        the prefill group runs no decode)."""
        return self.decode_size, self.d_page, self.d_kv_dtype

    @property
    def d_pages(self) -> int:
        """The decode group's pages per rank."""
        return self.decode_pages or max(1, self.device_pages * self.page_size // self.d_page)

    def validate(self) -> None:
        """Refuse a configuration that cannot run (``ValueError`` naming the field)."""
        for name in ("prefill_size", "decode_size", "page_size", "chunk", "max_running"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("device_pages", "decode_page", "decode_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        from ..models import KV_DTYPES

        for name in ("kv_dtype", "d_kv_dtype"):
            if getattr(self, name) not in KV_DTYPES:
                raise ValueError(f"{name} must be one of {KV_DTYPES}, got {getattr(self, name)!r}")
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.replicated:
            raise ValueError("kv='replicated' runs on one CP group; disaggregation moves a shared cache's pages")
        if not (self.timeout > 0 and self.transfer_timeout > 0):
            raise ValueError("timeout and transfer_timeout must be > 0 seconds")

    @classmethod
    def from_engine(cls, engine: RunConfig, prefill: int, decode: int, decode_page: int | None = None,
                    decode_pages: int | None = None) -> "DisaggConfig":
        """The disaggregated form of a run: every :class:`RunConfig` field of
        ``engine`` (model, trace, caches, policies), prefill on ``prefill``
        ranks, decode on ``decode`` ranks (``decode_page``, ``decode_pages``;
        defaults as in the class doc). ``cpkv run --disagg M:N`` builds its run
        this way."""
        return cls(prefill_size=prefill, decode_size=decode, decode_page=decode_page, decode_pages=decode_pages,
                   **engine.run_fields())


def parse_disagg(text: str) -> tuple[int, int]:
    """``"M:N"`` (prefill ranks, decode ranks, both >= 1) as ``(M, N)``; raises
    ``ValueError`` saying what is wrong (the ``--disagg`` flag's parser)."""
    m, sep, n = str(text).strip().partition(":")
    try:
        out = (int(m), int(n)) if sep else None
    except ValueError:
        out = None
    if out is None or min(out) < 1:
        raise ValueError(f"{text!r} is not M:N with M prefill ranks and N decode ranks, both >= 1")
    return out


#: Bytes of the allocator's and prefix cache's bookkeeping per page (free lists, owners, the page index).
BOOKKEEPING_BYTES_PER_PAGE = 48


def engine_footprint(cfg, specs=None):
    """The :class:`~cpkv.runtime.sizing.GroupFootprint` of the engine with
    ``cfg`` on the trace ``specs`` (default ``cfg.trace()``):
    :func:`run_footprint` of ``cfg``'s model as built (its parameters and
    buffers, its page bytes in ``cfg.kv_dtype``, on the meta device).
    Arithmetic only: nothing is allocated. ``cfg`` is sized
    (:meth:`RunConfig.sized`)."""
    cfg.check_sized()
    import torch

    from ..models import build_adapter

    with torch.device("meta"):
        adapter = build_adapter(cfg.model)
    model = adapter.model
    model_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return run_footprint(cfg.cp_size, page_bytes=cfg.page_bytes(), model_bytes=model_bytes,
                         vocab=model.config.vocab_size, device_pages=cfg.device_pages, host_pages=cfg.host_pages,
                         replicated=cfg.replicated, check=cfg.check, max_running=cfg.max_running,
                         specs=cfg.trace() if specs is None else specs)


def run_footprint(cp_size: int, *, page_bytes: int, model_bytes: int, vocab: int, device_pages: int,
                  host_pages: int, replicated: bool, check: bool, max_running: int,
                  specs: list[RequestSpec]):
    """What one engine group takes from the machine
    (:class:`~cpkv.runtime.sizing.GroupFootprint`): every rank holds the model
    (``model_bytes``), the scheduler's page table (``max_running`` rows as long
    as the longest request of ``specs``), the cache's bookkeeping of every page
    and (rank 0, with ``check``) the logits it keeps, ``vocab`` a token; the
    group shares the device KV (``device_pages`` of ``page_bytes`` per rank:
    each rank's lane, or with ``replicated`` each rank's full copy) and the host
    tier (``host_pages``). The one formula: :func:`engine_footprint` gives it
    the model as built, ``cpkv``'s up-front check (:mod:`cpkv.tools.sizes`)
    the built-in models' figures, before anything heavy is imported."""
    from ..runtime.sizing import group_footprint
    from .trace import kv_tokens

    copy = page_bytes * device_pages  # one rank's device KV: its lane, or its full copy (replicated)
    shared = page_bytes * (host_pages + 1) + (0 if replicated else cp_size * copy)
    tokens = sum(len(s.tokens) + s.max_new_tokens for s in specs)
    private = 4 * tokens * vocab * 3 if check else 0  # kept, gathered, reference logits
    private += copy if replicated else 0
    private += 8 * max_running * (max(kv_tokens(specs), default=0) + 1)  # the page table (Scheduler: max_running rows)
    lanes = 1 if replicated else cp_size
    private += BOOKKEEPING_BYTES_PER_PAGE * (lanes * device_pages + host_pages)
    return group_footprint(cp_size, model_bytes=model_bytes, private_bytes=private, shared_bytes=shared)
