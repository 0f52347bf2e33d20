"""The run configuration, written once: what the engine, the disaggregation driver and ``cpkv run`` share.

:class:`RunConfig` holds the model, the caches, the scheduler's policies, the
splits and the trace; its defaults are the ``cpkv run`` defaults (the command
reads them from here), so a run built in Python and the same run from the
command line are the same run. :class:`EngineConfig` adds one CP group's size,
:class:`DisaggConfig` a prefill group and a decode group; each adds its own
fault injection (tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..models import TinyDsa, TinyLlama
from .trace import WORKLOADS, RequestSpec, load_jsonl


@dataclass
class RunConfig:
    """One serving run: the model, the caches, the policies, the trace.

    ``page_size`` tokens per page; ``device_pages`` KV pages per rank (per
    owner lane); ``host_pages`` pages of the host tier (0: none); ``chunk``
    prefill tokens per step, all requests together; ``max_running`` requests
    at once; ``admission`` ``"lanes"`` or ``"none"``; the prefill and decode
    splits (:data:`~cpkv.runtime.batch.PREFILL_SPLITS`, ``DECODE_SPLITS``);
    ``workload`` a built-in trace or a JSONL path, with ``requests`` and
    ``scale`` for the built-in ones; ``check`` compares with ``transformers``;
    ``check_plans`` (debug) adds one collective per batch comparing every
    rank's allocation; ``timeout`` seconds for the whole run; ``progress`` a
    progress bar on rank 0 (the command turns it on); ``device`` where the
    model and the KV cache live (``"cpu"``, or ``"cuda"``: untested on
    hardware); ``kernels`` the data plane, ``"torch"`` or ``"triton"``
    (``None``: triton on a GPU, torch on the CPU, resolved at construction).
    """

    page_size: int = 16
    device_pages: int = 8
    host_pages: int = 96
    chunk: int = 64
    max_running: int = 16
    admission: str = "lanes"
    prefill_split: str = "page"
    decode_split: str = "owner"
    workload: str = "multiturn"
    requests: int = 8
    scale: float = 0.1
    seed: int = 0
    model: TinyLlama | TinyDsa = field(default_factory=TinyLlama)
    check: bool = False
    check_plans: bool = False
    timeout: float = 300.0
    progress: bool = False
    # the data plane (issue 17): "cpu" or "cuda"; kernels "torch" or "triton", None: triton on a GPU, torch on the CPU
    device: str = "cpu"
    kernels: str | None = None

    def __post_init__(self):
        if self.kernels is None:
            from ..runtime.batch import default_kernels

            self.kernels = default_kernels(self.device)

    def trace(self) -> list[RequestSpec]:
        """The requests of this run (``TraceError``/``OSError`` for a bad JSONL file)."""
        vocab = self.model.vocab
        if self.workload in WORKLOADS:
            return WORKLOADS[self.workload](self.requests, seed=self.seed, vocab=vocab, scale=self.scale)
        return load_jsonl(self.workload, vocab=vocab)

    def run_fields(self) -> dict:
        """This configuration's :class:`RunConfig` fields by name (what another
        driver's configuration takes over from it)."""
        return {f.name: getattr(self, f.name) for f in fields(RunConfig)}


@dataclass
class EngineConfig(RunConfig):
    """One engine run: a :class:`RunConfig` on a CP group of ``cp_size`` ranks.

    Fault injection (tests): rank ``fail_rank`` raises, or rank ``kill_rank``
    is killed by SIGKILL, at step ``fail_step``.
    """

    cp_size: int = 4
    fail_rank: int | None = None
    kill_rank: int | None = None
    fail_step: int = 3


@dataclass
class DisaggConfig(RunConfig):
    """One disaggregated run: a :class:`RunConfig` on a prefill group and a decode group.

    ``prefill_size`` (M) and ``decode_size`` (N) ranks; ``page_size`` and
    ``device_pages`` (pages per rank) are the prefill group's, ``decode_page``
    and ``decode_pages`` the decode group's (defaults: the prefill group's
    page size and the same tokens per rank). The host tier (``host_pages``)
    belongs to the prefill group. ``transfer_timeout`` seconds bound one
    point-to-point transfer. Fault injection (tests): world rank ``kill_rank``
    is killed in the middle of transfer number ``fail_transfer`` (0-based).
    """

    prefill_size: int = 2
    decode_size: int = 2
    decode_page: int | None = None
    decode_pages: int | None = None
    transfer_timeout: float = 60.0
    kill_rank: int | None = None
    fail_transfer: int = 0

    @property
    def world_size(self) -> int:
        """Ranks of both groups."""
        return self.prefill_size + self.decode_size

    @property
    def d_page(self) -> int:
        """The decode group's page size."""
        return self.decode_page or self.page_size

    @property
    def d_pages(self) -> int:
        """The decode group's pages per rank."""
        return self.decode_pages or max(1, self.device_pages * self.page_size // self.d_page)

    def validate(self) -> None:
        """Refuse a configuration that cannot run (``ValueError`` naming the field)."""
        for name in ("prefill_size", "decode_size", "page_size", "device_pages", "chunk", "max_running"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("decode_page", "decode_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        if self.kill_rank is not None and not 0 <= self.kill_rank < self.world_size:
            raise ValueError(f"kill_rank {self.kill_rank} is not a rank of a world of {self.world_size}")
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
