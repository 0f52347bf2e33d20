"""Every size a ``cpkv`` command takes, checked before anything heavy is imported and before anything is allocated.

:func:`refuse_sizes` is the first thing :func:`cpkv.tools.cli.main` does with a command line: it reads the flags
of :data:`FLAGS` (with their own ``type=`` checkers, the ones the command's parser uses), resolves every size the
command will use (the flags given, the command's defaults for the others) and checks them, in this order:

1. each value alone: its checker (``0``, negative, ``abc``, ``100TiB`` for a count) and its cap
   (:data:`MAX_REPEATS`, ``--timeout``'s :data:`~cpkv.tools.flags.MAX_TIMEOUT_S`);
2. flags that do nothing in their combination (``--block-tokens`` with a built-in workload,
   ``--kv-events-buffer`` without ``--kv-events-replay``, a benchmark's flag given to another one, ...);
3. against the machine's cores (:data:`~cpkv.runtime.sizing.MAX_RANKS_PER_CORE`) the ranks it starts;
4. against the work: the trace is read (a malformed, binary or truncated file is refused with ``path:line``) or
   generated (its size first bounded from a sample), and a size larger than the work can use is refused: a page
   larger than the longest request, a chunk larger than every prompt together, more requests than the file has;
5. against the machine's memory: what the command allocates, by arithmetic (the engine's group through
   :func:`~cpkv.engine.config.run_footprint`, the simulator's page bookkeeping, each benchmark's arrays), must fit
   in this machine's usable memory (:func:`usable_bytes`);
6. ``cpkv run`` against its ``--timeout`` (:func:`~cpkv.runtime.sizing.expected_run_seconds`).

A refusal is one line on stderr, as the parser's own (``cpkv run: error: ... (see cpkv run --help)``), exit 2;
it names the flag, the limit, and a value that works: the advice is found by searching the same rule for the
largest (or smallest) value it accepts, all else as given, so the value it suggests is not refused again by it
(``tests/tools/test_sizes.py`` gives each advice back to the command). Nothing here imports torch,
``transformers``, triton or matplotlib (the built-in models' figures are :data:`MODELS`, each checked against
the model as built by the tests), and nothing of the sizes asked for is allocated: a refusal takes well under a
second and a few tens of MB.

A new flag joins in two steps: a row of :data:`FLAGS` (its option strings, its ``type=``, the commands that take
it; ``size=True`` when its value sizes something), and, for a size, its rule in the command's check below
(``_check_run``, ``_check_simulate``, ``_check_bench``, ``_check_bytes``): a cap, a combination, a work limit or
a term of what the command allocates. ``tests/tools/test_sizes.py`` runs every size flag of :data:`FLAGS` at
0, negative, 1e12, 100TiB and ``abc`` and checks that the parser and this table agree.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import MISSING, dataclass, fields
from typing import Callable

from .flags import (BENCH_FLAGS, MAX_TIMEOUT_S, OneLineParser, block_tokens_arg, disagg_arg, existing_file,
                    mooncake_arg, non_negative, positive, positive_float, positive_list, scale_arg,
                    simulate_workload_arg, size_arg, size_list, timeout_arg, whole_number, workload_arg, zmq_endpoint)

#: Most timed rounds a benchmark takes: a median of more is the same figure, and this many rounds of the slowest
#: benchmark (splits) already take hours.
MAX_REPEATS = 10_000


class Refused(Exception):
    """A command line :func:`refuse_sizes` refuses: ``str(e)`` is the one line's message."""


# -- the flags the check reads -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One flag of the command line, as the check reads it: its option strings (the first its name), its
    ``type=`` (the same checker the command's parser uses; ``None``: a switch without a value), the commands that
    take it, ``nargs``, and whether it is a size (each of its values is checked by the command's rules)."""

    names: tuple[str, ...]
    type: Callable | None
    commands: tuple[str, ...]
    size: bool = False
    nargs: str | None = None

    @property
    def dest(self) -> str:
        """The attribute it parses to (``--kv-memory``: ``kv_memory``)."""
        return self.names[0].lstrip("-").replace("-", "_")


RUN, SIM, BENCH, BYTES = "run", "simulate", "bench", "bytes"
_ALL = (RUN, SIM, BENCH, BYTES)

#: Every flag the check reads, by command: each size flag, and the flags a rule reads besides (the workload, the
#: model, the modes). ``cpkv bench``'s every flag with a value is here, so its benchmark name is found.
FLAGS = (
    Flag(("--cp", "--ranks"), positive, (RUN, SIM, BENCH), size=True),
    Flag(("--cp",), positive, (BYTES,), size=True),
    Flag(("--timeout",), timeout_arg, (RUN,), size=True),
    Flag(("--page", "--page-size"), positive, (RUN, SIM, BENCH), size=True),
    Flag(("--decode-page",), positive, (RUN,), size=True),
    Flag(("--requests",), positive, (RUN, SIM, BENCH), size=True),
    Flag(("--scale",), scale_arg, (RUN,), size=True),
    Flag(("--chunk",), positive, (RUN, SIM), size=True),
    Flag(("--kv-memory",), size_arg, (RUN, SIM, BENCH), size=True),
    Flag(("--device-pages",), positive, (RUN,), size=True),
    Flag(("--host-pages",), non_negative, (RUN, SIM), size=True),
    Flag(("--host-memory",), size_list, (SIM,), size=True),
    Flag(("--max-running",), positive, (RUN, SIM), size=True),
    Flag(("--lane-pages",), positive, (SIM,), size=True),
    Flag(("--jobs",), positive, (SIM,), size=True),
    Flag(("--disagg",), disagg_arg, (RUN,), size=True),
    Flag(("--repeats",), positive, (BENCH,), size=True),
    Flag(("--tokens",), positive, (BENCH,), size=True),
    Flag(("--bs",), positive, (BENCH,), size=True),
    Flag(("--decode-bs",), positive, (BENCH,), size=True),
    Flag(("--context",), positive, (BENCH,), size=True),
    Flag(("--batches",), positive_list, (BENCH,), size=True),
    Flag(("--contexts",), positive_list, (BENCH,), size=True),
    Flag(("--steps",), positive, (BENCH,), size=True),
    Flag(("--index-topk-freq",), positive, (BYTES,), size=True),
    Flag(("--index-skip-topk-offset",), non_negative, (BYTES,), size=True),
    # read by the rules (with the command's own checker where it imports nothing heavy; str where the choices
    # are the command's to check)
    Flag(("--workload",), workload_arg, (RUN,)),
    Flag(("--workload",), simulate_workload_arg, (SIM,), nargs="+"),
    Flag(("--workload",), mooncake_arg, (BENCH,)),
    Flag(("--model",), str, (RUN, BENCH, BYTES)),
    Flag(("--kv-dtype",), str, (RUN, SIM, BENCH)),
    Flag(("--kv",), str, (RUN, SIM)),
    Flag(("--policies",), str, (SIM,)),
    Flag(("--seed",), non_negative, (RUN, SIM)),
    Flag(("--block-tokens",), block_tokens_arg, (RUN, SIM, BENCH)),
    Flag(("--window",), positive, (RUN, SIM, BENCH)),
    Flag(("--max-output",), positive, (RUN, SIM, BENCH)),
    Flag(("--step-ms",), positive_float, (RUN, BENCH)),
    Flag(("--kv-events",), zmq_endpoint, (RUN, SIM)),
    Flag(("--kv-events-replay",), zmq_endpoint, (RUN, SIM)),
    Flag(("--kv-events-buffer",), positive, (RUN, SIM)),
    Flag(("--tolerance",), str, (RUN,)),
    Flag(("--prefill-split",), str, (RUN,)),
    Flag(("--decode-split",), str, (RUN, SIM)),
    Flag(("--rate",), positive_float, (SIM,)),
    Flag(("--gpu-results",), existing_file, (SIM,)),
    Flag(("--device",), str, (RUN, BENCH)),
    Flag(("--kernels",), str, (RUN, BENCH)),
    Flag(("--ranks-as",), str, (BENCH,)),
    Flag(("--check",), None, (RUN,)),
    Flag(("--json",), None, (RUN, SIM, BENCH, BYTES)),
    Flag(("--markdown",), None, (SIM,)),
    Flag(("--goodput",), None, (SIM,)),
    Flag(("--slo-ttft",), str, (SIM,)),
    Flag(("--slo-tpot",), str, (SIM,)),
    Flag(("--print-tokens",), None, (RUN,)),
    Flag(("--compile",), None, (BENCH,)),
)


def command_flags(command: str) -> list[Flag]:
    """The rows of :data:`FLAGS` that ``command`` takes."""
    return [f for f in FLAGS if command in f.commands]


def size_flags(command: str) -> list[Flag]:
    """The size flags of ``command``."""
    return [f for f in command_flags(command) if f.size]


def _preparser(command: str) -> argparse.ArgumentParser:
    p = OneLineParser(prog=f"cpkv {command}", add_help=False, allow_abbrev=False)
    if command == BENCH:
        p.add_argument("what", nargs="?")
    for f in command_flags(command):
        if f.type is None:
            p.add_argument(*f.names, dest=f.dest, action="store_const", const=True, default=None)
        else:
            p.add_argument(*f.names, dest=f.dest, type=f.type, nargs=f.nargs, default=None)
    return p


@dataclass
class Line:
    """A command line as the check sees it: the command, the values of its :data:`FLAGS` given (``None``: not
    given), and the machine it runs on."""

    command: str
    given: dict
    capacity: object

    def __getitem__(self, dest: str):
        return self.given.get(dest)

    def has(self, dest: str) -> bool:
        """Whether the flag ``dest`` was given."""
        return self.given.get(dest) is not None


# -- this machine ---------------------------------------------------------------------------------------------
def usable_bytes(capacity) -> int:
    """Memory a command may plan to use here: what the machine has available, less the reserve
    :func:`~cpkv.runtime.sizing.check_capacity` keeps free."""
    from ..runtime.sizing import MEMORY_RESERVE

    return int(capacity.available_bytes * (1 - MEMORY_RESERVE))


def _fmt(n) -> str:
    from ..runtime.sizing import format_size

    return format_size(int(n))


def largest_where(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest ``v`` in ``[lo, hi]`` with ``ok(v)`` (``ok`` true up to a point, false past it); ``None``
    when ``ok(lo)`` is false."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def smallest_where(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The smallest ``v`` in ``[lo, hi]`` with ``ok(v)`` (false up to a point, true past it); ``None``
    when ``ok(hi)`` is false."""
    if hi < lo or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def _most_ranks(capacity) -> int:
    """The most ranks this machine schedules: :data:`~cpkv.runtime.sizing.MAX_RANKS_PER_CORE` per core, and no
    more interpreters than its memory holds."""
    from ..runtime.sizing import MAX_RANKS_PER_CORE, RANK_BASELINE_BYTES

    return min(MAX_RANKS_PER_CORE * capacity.cores, max(usable_bytes(capacity) // RANK_BASELINE_BYTES, 1))


def _most_ranks_why(capacity) -> str:
    from ..runtime.sizing import MAX_RANKS_PER_CORE, RANK_BASELINE_BYTES

    return (f"{MAX_RANKS_PER_CORE} per core on {capacity.cores} cores, {_fmt(RANK_BASELINE_BYTES)} each of "
            f"{_fmt(usable_bytes(capacity))} usable")


def _refuse_ranks(flag: str, ranks: int, capacity) -> None:
    """More ranks than this machine schedules (:func:`_most_ranks`)."""
    most = _most_ranks(capacity)
    if ranks > most:
        raise Refused(f"{flag} {ranks}: more ranks than this machine schedules ({_most_ranks_why(capacity)}: at "
                      f"most {most}); give {flag} {most} or fewer")


def _shown(flag: str, value) -> str:
    return ":".join(map(str, value)) if isinstance(value, tuple) else (
        ",".join(map(str, value)) if isinstance(value, list) else str(value))


def _too_large_for_work(flag: str, value: int, most: int, what: str) -> None:
    """A value past what the work can use: nothing would use the rest."""
    if value > most:
        raise Refused(f"{flag} {value}: more than {what} ({most}), nothing would use the rest; give {flag} "
                      f"{most} or less")


def _combination(rules: list[tuple[bool, str]]) -> None:
    """The first rule whose flag does nothing beside the others, refused with its reason."""
    for wrong, why in rules:
        if wrong:
            raise Refused(why)


# -- the built-in models, as the up-front check sees them -----------------------------------------------------
@dataclass(frozen=True)
class ModelFigures:
    """A built-in model's figures the engine's footprint needs (``cpkv run --model NAME``'s model: its default
    shape, any seed): bytes of KV a token in each KV dtype (every cache family and layer), bytes of parameters
    and buffers, vocabulary. Written here so that the check needs no torch; the tests build each model and
    compare (``tests/tools/test_sizes.py``)."""

    token_bytes: dict
    model_bytes: int
    vocab: int


#: ``cpkv run``'s models by name (:data:`cpkv.models.MODELS`).
MODELS = {
    "llama": ModelFigures({"float32": 512, "bfloat16": 256, "fp8": 160}, 427_328, 256),
    "deepseek-v3.2": ModelFigures({"float32": 864, "bfloat16": 432, "fp8": 264}, 1_232_416, 256),
    "glm-5": ModelFigures({"float32": 736, "bfloat16": 368, "fp8": 228}, 1_121_568, 256),
}
#: The real DSA models' layers (``cpkv bytes``: :func:`cpkv.models.dsa.real_shape`).
REAL_LAYERS = {"deepseek-v3.2": 61, "glm-5": 78}
#: ``cpkv bench splits``' models (:func:`cpkv.tools.bench.splits.splits_model`): KV bytes a token (fp32, every
#: layer), attention heads, and the prefill tokens it runs when ``--tokens`` is not given (DSA fewer: its indexer
#: copies each query's whole context).
SPLIT_FIGURES = {"llama": (2048, 8, 16384), "deepseek-v3.2": (2688, 8, 4096)}
#: ``cpkv bench kv``: bytes a token of the batch takes (K and V of 2 heads x 128 in bf16 in the shared pool, the
#: same unshared, the read's output, the slot and index arrays).
BENCH_KV_TOKEN_BYTES = 4096


# -- cpkv run (and bench capacity's engine runs) ---------------------------------------------------------------
def _run_defaults() -> dict:
    from ..engine.config import EngineConfig

    return {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def _torchrun_world() -> int | None:
    """The world's size torchrun set (``WORLD_SIZE``; ``None`` when it is not set, or malformed: the command
    refuses a malformed torchrun environment with the reason, :func:`~cpkv.runtime.torchrun.torchrun_env`)."""
    v = whole_number(os.environ.get("WORLD_SIZE", ""))
    return v if v is not None and v >= 1 else None


def _is_mooncake(workload: str) -> bool:
    from ..engine.mooncake import mooncake_path

    return mooncake_path(workload) is not None


@dataclass
class _Run:
    """One engine group's sizes, resolved (flags given, the configuration's defaults for the rest)."""

    cp: int
    page: int
    device_pages: int | None
    kv_memory: int | None
    host_pages: int
    max_running: int
    model: ModelFigures
    kv_dtype: str
    replicated: bool
    check: bool
    world: int | None = None  # ranks the default memory budget is split over (both groups of --disagg)

    @property
    def page_bytes(self) -> int:
        """One device page, every cache family."""
        return self.page * self.model.token_bytes[self.kv_dtype]

    def pages(self, capacity) -> int:
        """Device pages per rank, as the run sizes them (:func:`~cpkv.engine.config.device_pages_for`)."""
        from ..engine.config import device_pages_for

        if self.device_pages is not None:
            return self.device_pages
        return device_pages_for(self.kv_memory, self.page_bytes, world_size=self.world or self.cp,
                                host_pages=self.host_pages, capacity=capacity)

    def footprint(self, specs, capacity):
        """The group's :class:`~cpkv.runtime.sizing.GroupFootprint` (:func:`~cpkv.engine.config.run_footprint`)."""
        from ..engine.config import run_footprint

        return run_footprint(self.cp, page_bytes=self.page_bytes, model_bytes=self.model.model_bytes,
                             vocab=self.model.vocab, device_pages=self.pages(capacity), host_pages=self.host_pages,
                             replicated=self.replicated, check=self.check, max_running=self.max_running, specs=specs)


def _trace_sample(workload: str, requests: int, scale: float, seed: int, vocab: int) -> tuple[float, float, float]:
    """Per unit of a built-in trace (``--requests`` counts sessions, questions or documents): its tokens, its
    requests and its prompt tokens, from the first few units (each unit is drawn alike), drawn at ``scale`` up
    to 1 and past it scaled (every length of a built-in trace is its span times ``scale``), so a sample of a
    long trace stays small."""
    from ..engine.trace import WORKLOADS

    n, at = min(requests, 32), min(scale, 1.0)
    specs = WORKLOADS[workload](n, seed=seed, vocab=vocab, scale=at)
    prompts = sum(len(s.tokens) for s in specs) * scale / at
    return (prompts + sum(s.max_new_tokens for s in specs) * scale / at) / n, len(specs) / n, prompts / n


#: Bytes a token of a trace takes in each process that holds it (a tuple slot of a small int), and a request.
TRACE_TOKEN_BYTES, TRACE_REQUEST_BYTES = 8, 400


def _bound_builtin_trace(line: Line, d: dict, workload: str, vocab: int, world: int, capacity) -> None:
    """A built-in trace of the ``--requests`` and ``--scale`` given, bounded before it is generated from a sample:
    every process holds it (its memory), and the run takes at least its prefill and decode steps (its time, as
    :func:`~cpkv.runtime.sizing.expected_run_seconds` counts them) within ``--timeout``."""
    from ..runtime.sizing import expected_run_seconds

    requests, scale, seed = _value(line, d, "requests"), _value(line, d, "scale"), _value(line, d, "seed")
    if not (line.has("requests") or line.has("scale")):
        return  # the defaults: a few sessions, checked whole once generated
    budget = usable_bytes(capacity) // 2 // (world + 1)
    chunk, running, timeout = line["chunk"] or d["chunk"], line["max_running"] or d["max_running"], \
        line["timeout"] or d["timeout"]

    def problem(n: int, s: float, limit: float) -> str | None:
        tokens, reqs, prompts = _trace_sample(workload, n, s, seed, vocab)
        held = n * (tokens * TRACE_TOKEN_BYTES + reqs * TRACE_REQUEST_BYTES)
        if held > budget:
            return (f"the {workload} trace would hold about {_fmt(held)} in each of {world + 1} processes, more than "
                    f"this machine can give ({_fmt(usable_bytes(capacity))} usable)")
        steps = math.ceil(n * prompts / chunk) + math.ceil(n * (tokens - prompts) / running)
        secs = expected_run_seconds(world, steps, capacity.cores)
        if secs > limit:
            past = f"--timeout {limit:g}" if limit == timeout else f"the longest --timeout ({limit:g} s)"
            return (f"the {workload} trace would take at least {steps} steps, about {secs / 60:.0f} min on "
                    f"{world} ranks and {capacity.cores} cores, past {past}")
        return None

    # a trace the run could take within the longest timeout is generated, and then its time is checked exactly
    # (against --timeout, the flag to give); past that, or past the memory, its size is the flag at fault
    why = problem(requests, scale, MAX_TIMEOUT_S)
    if why is None:
        return
    for limit in (timeout, MAX_TIMEOUT_S):  # the size that fits the timeout given, else the longest one
        if line.has("requests"):
            best = largest_where(lambda n: problem(n, scale, limit) is None, 1, requests - 1)
            if best is not None:
                raise Refused(f"--requests {requests}: {why}; give --requests {best} or fewer")
        if line.has("scale"):
            lo, hi = 0.0, scale  # the largest scale (3 significant digits) with no problem
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if problem(requests, mid, limit) is None else (lo, mid)
            if lo > 0:
                best = float(f"{lo:.3g}")
                best = best if best <= lo else float(f"{lo * 0.999:.3g}")
                raise Refused(f"--scale {scale:g}: {why}; give --scale {best:g} or less")
    raise Refused(f"{why}; give fewer --requests or a smaller --scale")


def _load_run_trace(line: Line, d: dict, vocab: int, world: int, capacity):
    """``cpkv run``'s trace, read or generated as the run will (:func:`~cpkv.engine.config.load_trace`), a
    built-in trace bounded first (:func:`_bound_builtin_trace`)."""
    from ..engine.config import load_trace
    from ..engine.trace import WORKLOADS, TraceError

    workload = line["workload"] or d["workload"]
    if workload in WORKLOADS:
        _bound_builtin_trace(line, d, workload, vocab, world, capacity)
    try:
        return load_trace(workload, vocab=vocab, requests=_value(line, d, "requests"), scale=_value(line, d, "scale"),
                          seed=_value(line, d, "seed"), block_tokens=_value(line, d, "block_tokens"),
                          window_ms=line["window"], max_output=line["max_output"], step_ms=_value(line, d, "step_ms"))
    except (TraceError, OSError, ValueError) as e:
        raise Refused(f"--workload: {e}") from None


def _value(line: Line, d: dict, dest: str):
    """The value of ``dest`` given, else the default ``d[dest]``."""
    return line[dest] if line.has(dest) else d[dest]


def _work_limits(line: Line, specs, *, page_flags=("page",), chunk: bool = True, requests_in_file: bool = False,
                 file_requests: int | None = None) -> None:
    """A page larger than the longest request (its KV tokens), a chunk larger than every prompt together, and
    (a file) more requests than it has: each of these flags given past its work does nothing more."""
    from ..engine.trace import kv_tokens

    longest = max(kv_tokens(specs), default=1)
    for dest in page_flags:
        if line.has(dest):
            _too_large_for_work("--" + dest.replace("_", "-"), line[dest], longest,
                                "the longest request's tokens")
    if chunk and line.has("chunk"):
        prompts = sum(len(s.tokens) for s in specs)
        _too_large_for_work("--chunk", line["chunk"], prompts, "the trace's prompt tokens together")
    if requests_in_file and line.has("requests") and file_requests is not None:
        _too_large_for_work("--requests", line["requests"], file_requests, "the requests of the trace")


def _mooncake_count(workload: str, window) -> int:
    from ..engine.mooncake import mooncake_path, read_mooncake

    return len(read_mooncake(mooncake_path(workload), before_ms=window))


def _fit_group(line: Line, groups: list[tuple[_Run, list]], capacity, timeout: float,
               knobs: list[tuple[str, str, Callable]]) -> None:
    """Memory, cores and start time of the groups together (:func:`~cpkv.runtime.sizing.check_capacity`); when
    they do not fit, the first flag given of ``knobs`` (``(flag, dest, with_value(v) -> groups)``) whose smaller
    value makes them fit is named, with the largest such value."""
    from ..runtime.sizing import RANK_START_CPU_S, check_capacity, GroupTooLarge

    def fits(gs) -> bool:
        return _fits(gs, capacity, timeout)

    try:
        check_capacity(*(g.footprint(s, capacity) for g, s in groups), timeout=timeout, capacity=capacity)
        return
    except GroupTooLarge as e:
        problem = str(e)
    ranks = sum(g.cp for g, _ in groups)
    start = ranks * RANK_START_CPU_S / capacity.cores
    if start > timeout:
        raise Refused(f"--timeout {timeout:g}: starting {ranks} ranks takes at least {start:.0f} s on "
                      f"{capacity.cores} cores ({RANK_START_CPU_S:g} CPU seconds each); give --timeout "
                      f"{math.ceil(start * 1.5)} or more")
    for flag, dest, with_value in knobs:
        if not line.has(dest):
            continue
        value = line[dest]
        lo = {"host_pages": 0, "kv_memory": groups[0][0].page_bytes}.get(dest, 1)
        best = largest_where(lambda v: fits(with_value(v)), lo, value - 1)
        if best is not None:
            first = groups[0][0]
            if dest in ("kv_memory", "device_pages"):
                pages = first.pages(capacity)
                most = with_value(best)[0][0].pages(capacity)
                raise Refused(f"{flag} {_size_shown(flag, value)}: the device cache takes "
                              f"{_fmt(pages * first.page_bytes * first.cp)} ({pages} pages of "
                              f"{_fmt(first.page_bytes)} on each of {first.cp} ranks), more than this machine can "
                              f"give beside the rest of the run ({_fmt(usable_bytes(capacity))} usable); give "
                              f"--kv-memory {_size_arg(most * first.page_bytes)} or less (--device-pages {most})")
            raise Refused(f"{flag} {_size_shown(flag, value)}: {problem}; give {flag} {best} or "
                          f"{'less' if dest != 'cp' else 'fewer'}")
    raise Refused(f"{problem}; {'leave out --check (its logits) or ' if groups[0][0].check else ''}"
                  f"give a shorter trace (--requests, --scale, --max-output)")


def _size_shown(flag: str, value) -> str:
    return _size_arg(value) if flag == "--kv-memory" else _shown(flag, value)


def _size_arg(n: int) -> str:
    """``n`` bytes as a ``--kv-memory`` value that parses back to at most ``n`` (``4.4GiB`` may round up)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            tenths = int(n) * 10 // scale  # rounded down, so the value given back is at most n
            return f"{tenths // 10}{unit}" if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}{unit}"
    return str(int(n))


def _check_run(line: Line) -> None:
    """``cpkv run``: the checks of the module doc on the engine's group (or ``--disagg``'s two groups)."""
    d = _run_defaults()
    workload = line["workload"] or d["workload"]
    from ..engine.trace import WORKLOADS

    builtin, mooncake = workload in WORKLOADS, not (workload in WORKLOADS) and _is_mooncake(workload)
    _combination([
        (not mooncake and any(line.has(k) for k in ("block_tokens", "window", "max_output", "step_ms")),
         f"{_given(line, ('block_tokens', 'window', 'max_output', 'step_ms'))} shape a Mooncake trace; "
         f"--workload {workload} is {'a built-in trace' if builtin else 'a JSONL file'}"),
        (not builtin and line.has("scale"), f"--scale scales a built-in trace; --workload {workload} is a file"),
        (not builtin and not mooncake and line.has("requests"),
         f"--requests sizes a built-in or Mooncake trace; --workload {workload} is a JSONL file, run whole"),
        (line.has("kv_events_buffer") and not line.has("kv_events_replay"),
         "--kv-events-buffer sizes --kv-events-replay's buffer; give --kv-events-replay too, or leave it out"),
        (line.has("tolerance") and not line.has("check"), "--tolerance bounds --check's logits; give --check too"),
        (line.has("print_tokens") and line.has("json"),
         "--print-tokens prints after the text report; --json has every request's tokens (outputs)"),
        ((line["kv"] == "replicated") and (line.has("prefill_split") or line.has("decode_split")),
         f"{_given(line, ('prefill_split', 'decode_split'))} choose the shared cache's splits; --kv replicated "
         "runs its own (zigzag prefill, balanced decode)"),
        (line.has("decode_page") and not line.has("disagg"), "--decode-page sets the decode group's page size; "
         "it needs --disagg"),
    ])
    capacity, disagg = line.capacity, line["disagg"]
    world = sum(disagg) if disagg is not None else line["cp"] or _torchrun_world() or d["cp_size"]
    most = _most_ranks(capacity)
    model = MODELS.get(line["model"] or "llama")
    kv_dtype = line["kv_dtype"] or d["kv_dtype"]
    if model is None or kv_dtype not in model.token_bytes:
        return  # the command's parser refuses the name
    specs = _load_run_trace(line, d, model.vocab, min(world, most), capacity)
    timeout = line["timeout"] or d["timeout"]
    base = dict(page=line["page"] or d["page_size"], device_pages=line["device_pages"], kv_memory=line["kv_memory"],
                host_pages=_value(line, d, "host_pages"), max_running=line["max_running"] or d["max_running"],
                model=model, kv_dtype=kv_dtype, replicated=line["kv"] == "replicated", check=bool(line["check"]))

    def groups(disagg=disagg, cp=world, **kw):
        """The group(s) the run starts, ``kw`` in place of the flags' values."""
        if disagg is None:
            return [(_Run(**{"cp": cp, **base, **kw}), specs)]
        M, N = disagg
        pre = _Run(**{**base, **kw, "cp": M, "world": M + N})
        pages, d_page = pre.pages(capacity), kw.get("decode_page", line["decode_page"]) or pre.page
        dec = _Run(**{**base, **kw, "cp": N, "page": d_page, "device_pages": max(1, pages * pre.page // d_page),
                      "kv_memory": None, "host_pages": 0, "replicated": False})
        return [(_Run(**{**base, **kw, "cp": M, "device_pages": pages, "kv_memory": None}), specs), (dec, specs)]

    if world > most:  # the ranks first; the value to give also fits the rest of the run (its memory)
        def split(n: int) -> tuple[int, int]:
            m = max(1, min(disagg[0] * n // world, n - 1))
            return m, max(n - m, 1)

        def fits(n: int) -> bool:
            return _fits(groups(disagg=split(n)) if disagg else groups(cp=n), capacity, timeout)

        best = largest_where(fits, 2 if disagg else 1, most) or most
        why = f"{world} ranks, more than this machine schedules ({_most_ranks_why(capacity)}: at most {most})"
        if disagg is not None:
            m, n = split(best)
            raise Refused(f"--disagg {disagg[0]}:{disagg[1]}: {why}; give --disagg {m}:{n} or smaller (at most "
                          f"{best} ranks together)")
        raise Refused(f"--cp {world}: {why}; give --cp {best} or fewer")
    _work_limits(line, specs, page_flags=("page", "decode_page"), requests_in_file=mooncake,
                 file_requests=_mooncake_count(workload, line["window"]) if mooncake and line.has("requests") else None)
    knobs = [("--kv-memory", "kv_memory", lambda v: groups(kv_memory=v)),
             ("--device-pages", "device_pages", lambda v: groups(device_pages=v)),
             ("--host-pages", "host_pages", lambda v: groups(host_pages=v)),
             ("--max-running", "max_running", lambda v: groups(max_running=v)),
             ("--page", "page", lambda v: groups(page=v))] + (
        [("--cp", "cp", lambda v: groups(cp=v))] if disagg is None else [])
    for g, _ in groups():
        if g.kv_memory is not None and g.kv_memory < g.page_bytes:
            raise Refused(f"--kv-memory {_size_arg(g.kv_memory)}: holds no page of {_fmt(g.page_bytes)} "
                          f"({g.page} tokens of {_fmt(g.model.token_bytes[kv_dtype])}); give --kv-memory "
                          f"{_size_arg(g.page_bytes * 2)} or more")
    _fit_group(line, groups(), capacity, timeout, knobs)
    _refuse_past_timeout(line, specs, world, timeout, capacity, d)


def _fits(groups, capacity, timeout: float) -> bool:
    """Whether the groups fit this machine together (:func:`~cpkv.runtime.sizing.check_capacity`)."""
    from ..runtime.sizing import GroupTooLarge, check_capacity

    try:
        check_capacity(*(g.footprint(s, capacity) for g, s in groups), timeout=timeout, capacity=capacity)
        return True
    except (GroupTooLarge, ValueError):  # ValueError: a memory that holds no page
        return False


def _given(line: Line, dests) -> str:
    return ", ".join("--" + k.replace("_", "-") for k in dests if line.has(k))


def _refuse_past_timeout(line: Line, specs, world: int, timeout: float, capacity, d: dict) -> None:
    """A run expected to outlast ``--timeout``: the timeout to give, or (past :data:`MAX_TIMEOUT_S`) the trace
    to shorten."""
    from ..engine.trace import expected_steps
    from ..runtime.sizing import expected_run_seconds

    chunk, running = line["chunk"] or d["chunk"], line["max_running"] or d["max_running"]
    steps = expected_steps(specs, chunk, running)
    secs = expected_run_seconds(world, steps, capacity.cores)
    if secs <= timeout:
        return
    what = f"about {steps} steps on {world} ranks and {capacity.cores} cores"
    need = int(secs * 1.5) + 1
    if need <= MAX_TIMEOUT_S:
        raise Refused(f"--timeout {timeout:g}: the run is expected to take about {secs / 60:.0f} min ({secs:.0f} s: "
                      f"{what}); give --timeout {need} or more")
    raise Refused(f"the run is expected to take about {secs / 86400:.0f} days ({what}), past the longest "
                  f"--timeout ({MAX_TIMEOUT_S:.0f} s); give a shorter trace (--requests, --scale)")


# -- cpkv simulate --------------------------------------------------------------------------------------------
#: ``cpkv simulate`` flags that apply to built-in traces only, and to Mooncake traces only.
BUILTIN_ONLY = ("policies", "lane_pages", "host_pages", "kv_events", "kv_events_replay", "kv_events_buffer", "seed")
MOONCAKE_ONLY = ("kv", "kv_memory", "kv_dtype", "host_memory", "decode_split", "chunk", "max_running", "requests",
                 "rate", "gpu_results", "markdown", "window", "max_output", "block_tokens", "goodput", "slo_ttft",
                 "slo_tpot", "jobs")
#: ``cpkv simulate``'s page size when not given: built-in traces, Mooncake traces (FlashMLA's page).
SIMULATE_PAGE = {"builtin": 16, "mooncake": 64}


def simulate_kind(workloads: list[str]) -> str | None:
    """``"builtin"`` or ``"mooncake"``: what ``--workload`` names; ``None`` when it mixes the two."""
    from .simulate import SIM_WORKLOADS

    builtin = [w for w in workloads if w in SIM_WORKLOADS or w == "all"]
    if builtin and len(builtin) != len(workloads):
        return None
    return "builtin" if builtin else "mooncake"


def _check_simulate(line: Line) -> None:
    """``cpkv simulate``: built-in traces' lanes, Mooncake traces' caches, against the work and the machine."""
    from ..engine.config import BOOKKEEPING_BYTES_PER_PAGE

    workloads = line["workload"] or ["all"]
    kind = simulate_kind(workloads)
    if kind is None:
        raise Refused("--workload: built-in traces and Mooncake traces are simulated apart; give one kind")
    wrong = [f for f in (BUILTIN_ONLY if kind == "mooncake" else MOONCAKE_ONLY) if line.has(f)]
    if wrong:
        raise Refused(f"{', '.join('--' + f.replace('_', '-') for f in wrong)} do not apply to "
                      f"{'Mooncake' if kind == 'mooncake' else 'built-in'} traces")
    _combination([
        (line.has("kv_events_buffer") and not line.has("kv_events_replay"),
         "--kv-events-buffer sizes --kv-events-replay's buffer; give --kv-events-replay too, or leave it out"),
        (line.has("markdown") and line.has("json"), "--markdown and --json each print the table; give one"),
    ] + [(line.has(f) and not line.has("goodput"),
          f"--{f.replace('_', '-')} sets how --goodput runs; give --goodput too, or leave it out")
         for f in ("slo_ttft", "slo_tpot", "jobs")]
      + [(line.has("goodput") and bad, f"--goodput sweeps the arrival rate of one decode split; it does not take {flag}")
         for flag, bad in (("--rate", line.has("rate")), ("--markdown", line.has("markdown")),
                           ("--decode-split with two splits", "," in (line["decode_split"] or "")))])
    cores = line.capacity.cores
    if line.has("jobs") and line["jobs"] > cores:
        raise Refused(f"--jobs {line['jobs']}: this machine has {cores} cores; give --jobs {cores} or fewer")
    capacity, usable = line.capacity, usable_bytes(line.capacity)
    page = line["page"] or SIMULATE_PAGE[kind]
    cp = line["cp"] or 8
    if kind == "builtin":
        from ..engine.trace import kv_tokens
        from .simulate import SIM_WORKLOADS

        names = list(SIM_WORKLOADS) if "all" in workloads else list(dict.fromkeys(workloads))
        for name in names:
            w = SIM_WORKLOADS[name](seed=line["seed"] or 0)
            _work_limits(line, list(w.requests), chunk=False)
            lane_pages, host = line["lane_pages"] or w.lane_pages, line["host_pages"] or 0
            longest = max(kv_tokens(list(w.requests)), default=1)

            def need(cp_=cp, lane=lane_pages, host_=host):  # the caches' bookkeeping and the page table
                return (BOOKKEEPING_BYTES_PER_PAGE * (cp_ * lane + host_)
                        + 8 * w.max_running * (longest + 1))
            if need() > usable:
                what = (f"{cp * lane_pages + host} pages take {_fmt(need())} of bookkeeping, more than this machine "
                        f"can give ({_fmt(usable)} usable)")
                for flag, dest, fn in (("--lane-pages", "lane_pages", lambda v: need(lane=v)),
                                       ("--host-pages", "host_pages", lambda v: need(host_=v)),
                                       ("--cp", "cp", lambda v: need(cp_=v))):
                    if line.has(dest):
                        best = largest_where(lambda v: fn(v) <= usable, 0 if dest == "host_pages" else 1, line[dest] - 1)
                        if best is not None:
                            raise Refused(f"{flag} {line[dest]}: {what}; give {flag} {best} or "
                                          f"{'fewer' if dest == 'cp' else 'less'}")
                raise Refused(f"{name}: {what}")
        return
    _check_mooncake(line, workloads, cp, page, capacity)


def _check_mooncake(line: Line, workloads: list[str], cp: int, page: int, capacity) -> None:
    """``cpkv simulate`` with Mooncake traces: each read (``path:line`` for a bad line) against the page, chunk
    and requests given; the device KV per rank (the default: an H200's beside the checkpoint's shard) holding
    pages; every mode's and KV dtype's page bookkeeping and the page table against the machine."""
    from ..engine.config import BOOKKEEPING_BYTES_PER_PAGE
    from ..engine.mooncake import load_mooncake
    from ..engine.trace import TraceError, kv_tokens
    from ..engine.cost_model import H200, kv_memory_beside
    from .replay import KV_MODES
    from .replay_report import HOST_MEMORY

    most_kv = kv_memory_beside(H200, 0, 1)  # a whole GPU's share for KV, no weights
    if line.has("kv_memory") and line["kv_memory"] > most_kv:
        raise Refused(f"--kv-memory {_size_arg(line['kv_memory'])}: more device KV per rank than the modelled "
                      f"{H200.name} has ({_fmt(most_kv)}: {H200.mem_fraction:g} of its memory); give --kv-memory "
                      f"{_size_arg(most_kv)} or less")
    if line.has("host_memory") and max(line["host_memory"]) > MODELLED_HOST_BYTES:
        raise Refused(f"--host-memory {_shown('--host-memory', line['host_memory'])}: a host tier larger than the "
                      f"modelled machine's memory ({_fmt(MODELLED_HOST_BYTES)}, a DGX H200's); give --host-memory "
                      f"{_size_arg(MODELLED_HOST_BYTES)} or less")
    least_cp = smallest_where(lambda v: kv_memory_beside(H200, DEEPSEEK_V32_CHECKPOINT_BYTES, v) >= 1, 1, 2**20)
    if not line.has("kv_memory") and cp < least_cp:
        raise Refused(f"--cp {cp}: a DeepSeek-V3.2 shard of 1/{cp} of its {_fmt(DEEPSEEK_V32_CHECKPOINT_BYTES)} "
                      f"checkpoint leaves no KV on an {H200.name}; give --cp {least_cp} or more, or --kv-memory")

    traces = []
    for w in workloads:
        try:
            traces.append(load_mooncake(w, block=line["block_tokens"] or 512, requests=line["requests"],
                                        window_ms=line["window"], max_output=line["max_output"], lazy=True))
        except (TraceError, OSError, ValueError) as e:
            raise Refused(f"--workload: {e}") from None
    specs = [s for t in traces for s in t.specs]
    _work_limits(line, specs)
    if line.has("requests"):
        _too_large_for_work("--requests", line["requests"], max(_mooncake_count(w, line["window"]) for w in workloads),
                            "the requests of the trace")
    longest = max(kv_tokens(specs), default=1)
    usable = usable_bytes(capacity)
    hosts = line["host_memory"] if line.has("host_memory") else [0, HOST_MEMORY]
    dtypes = [t.strip() for t in line["kv_dtype"].split(",")] if line.has("kv_dtype") else ["bfloat16", "fp8"]
    kvs = [t.strip() for t in line["kv"].split(",")] if line.has("kv") else list(KV_MODES)
    if not set(dtypes) <= set(DEEPSEEK_V32_TOKEN_BYTES) or not set(kvs) <= set(KV_MODES):
        return  # the command's parser refuses the name
    running = line["max_running"] or 256

    def kv_memory(cp_: int) -> int:
        return line["kv_memory"] or kv_memory_beside(H200, DEEPSEEK_V32_CHECKPOINT_BYTES, cp_)

    def need(kv, dtype, kv_memory_=None, cp_=cp, page_=page, host=max(hosts), running_=running) -> int | None:
        """Bytes of the mode's bookkeeping and page table; ``None`` when its device KV holds under 2 pages."""
        per_page = page_ * DEEPSEEK_V32_TOKEN_BYTES[dtype]
        device, host_pages = (kv_memory_ or kv_memory(cp_)) // per_page, host // per_page
        if device < 2:
            return None
        lanes = 1 if kv == "replicated" else cp_
        return BOOKKEEPING_BYTES_PER_PAGE * (lanes * device + host_pages) + 8 * running_ * (longest + 1)

    combos = [(kv, dtype) for dtype in dtypes for kv in kvs]
    for kv, dtype in combos:
        if need(kv, dtype) is None:
            per_page = page * DEEPSEEK_V32_TOKEN_BYTES[dtype]
            if line.has("kv_memory"):
                raise Refused(f"--kv-memory {_size_arg(kv_memory(cp))}: holds fewer than 2 pages of "
                              f"{_fmt(per_page)} ({page} tokens, {dtype}); give --kv-memory "
                              f"{_size_arg(2 * per_page)} or more")
            best = largest_where(lambda v: all(need(k, d, page_=v) is not None for k, d in combos), 1, page - 1)
            raise Refused(f"--page {page}: {_fmt(kv_memory(cp))} of device KV per rank holds fewer than 2 pages "
                          f"of {_fmt(per_page)} ({dtype}); give --page {best or 1} or less")

    # --goodput --jobs J: J sweeps at once, each a process holding one mode's caches
    def sweeps_at_once(jobs: int | None) -> int:
        return min(jobs or 1, len(combos) * len(hosts)) if line.has("goodput") else 1

    at_once = sweeps_at_once(line["jobs"])

    def fits(jobs=line["jobs"], **kw) -> bool:  # every mode and KV dtype asked for
        n = sweeps_at_once(jobs)
        return all((lambda b: b is not None and n * b <= usable)(need(k, d, **kw)) for k, d in combos)

    if fits():
        return
    kv, dtype = max(combos, key=lambda c: need(*c))
    what = (f"the {kv} {dtype} caches' bookkeeping and page table take {_fmt(need(kv, dtype))}"
            f"{f' in each of {at_once} sweeps at once' if at_once > 1 else ''}, more than this machine can give "
            f"({_fmt(usable)} usable)")
    least_memory = 2 * page * max(DEEPSEEK_V32_TOKEN_BYTES[d] for d in dtypes)
    for flag, dest, lo, kw in (("--jobs", "jobs", 1, "jobs"),  # first: fewer sweeps at once change no figure
                               ("--kv-memory", "kv_memory", least_memory, "kv_memory_"),
                               ("--host-memory", "host_memory", 0, "host"),
                               ("--max-running", "max_running", 1, "running_"),
                               ("--cp", "cp", 1 if line.has("kv_memory") else least_cp, "cp_")):
        if not line.has(dest):
            continue
        now = max(line[dest]) if dest == "host_memory" else line[dest]
        best = largest_where(lambda v: fits(**{kw: v}), lo, now - 1)
        if best is not None:
            sized = dest in ("kv_memory", "host_memory")
            raise Refused(f"{flag} {_size_arg(now) if sized else now}: {what}; give {flag} "
                          f"{_size_arg(best) if sized else best} or {'fewer' if dest in ('cp', 'jobs') else 'less'}")
    raise Refused(what)


#: ``cpkv simulate``'s modelled DeepSeek-V3.2 (:mod:`cpkv.engine.cost_model`, the released shapes): KV bytes a token
#: (every layer, latent and indexer key) by KV dtype, and its FP8 checkpoint's bytes
#: (:func:`~cpkv.engine.cost_model.kv_memory_per_rank`). Checked against the cost model by the tests.
DEEPSEEK_V32_TOKEN_BYTES = {"bfloat16": 85_888, "fp8": 48_068}
DEEPSEEK_V32_CHECKPOINT_BYTES = 673_730_265_088
#: The modelled machine's host memory (a DGX H200's 2 TB; the default host tier is half of it).
MODELLED_HOST_BYTES = 2 * 2**40


# -- cpkv bench -----------------------------------------------------------------------------------------------
#: Each benchmark's sizes when not given (``cpkv bench`` fills them in: :func:`bench_size`).
BENCH_SIZES = {
    "alloc": {"repeats": 101},
    "kv": {"repeats": 21, "tokens": 65536},
    "engine": {"repeats": 7},
    "plan": {"repeats": 7},
    "splits": {"repeats": 5, "cp": 4, "bs": 4, "decode_bs": 64, "context": 4096, "page": 16},
    "kvdtype": {"cp": 4},
    "capacity": {"repeats": 5, "cp": 4, "page": 16, "kv_memory": 256 * 2**10, "requests": 200, "block_tokens": 16,
                 "step_ms": 1000.0},
    "scheduler": {"repeats": 3, "cp": 8, "page": 64, "batches": [64, 256, 1024], "contexts": [4096, 32768, 131072],
                  "steps": 64},
    "kernels": {},
}


def fill_bench_defaults(args) -> None:
    """``cpkv bench``: every flag not given takes the benchmark's size (:data:`BENCH_SIZES`; ``all`` leaves
    ``--repeats`` to each of its benchmarks) or the parser's default (``args.bench_defaults``: the parser leaves
    a flag not given unset, so that :func:`refuse_sizes` refused one the benchmark does not take)."""
    sizes = BENCH_SIZES.get(args.what, {})
    for dest, value in args.bench_defaults.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, sizes.get(dest, value))


def bench_size(what: str, dest: str, given):
    """``given``, or benchmark ``what``'s size ``dest`` when it is ``None`` (:data:`BENCH_SIZES`)."""
    return BENCH_SIZES[what].get(dest) if given is None else given


def _check_bench(line: Line) -> None:
    """``cpkv bench``: a flag another benchmark takes refused, naming those that take it; then each benchmark's
    sizes against the work and the machine."""
    what = line["what"]
    if what not in BENCH_FLAGS:
        return  # the command's parser refuses it
    for f in command_flags(BENCH):
        if line.has(f.dest) and f.dest not in BENCH_FLAGS[what]:
            takes = [w for w, fl in BENCH_FLAGS.items() if f.dest in fl and w != "all"]
            raise Refused(f"{f.names[0]} is not a flag of bench {what}; it sets bench {', '.join(takes)}")
    _combination([
        (what == "capacity" and not line.has("workload") and any(
            line.has(k) for k in ("requests", "block_tokens", "window", "max_output", "step_ms")),
         f"{_given(line, ('requests', 'block_tokens', 'window', 'max_output', 'step_ms'))} shape a Mooncake "
         "--workload; bench capacity without one runs its longdoc trace"),
    ])
    capacity, usable = line.capacity, usable_bytes(line.capacity)
    repeats = line["repeats"]
    if repeats is not None and repeats > MAX_REPEATS:
        raise Refused(f"--repeats {repeats}: more than {MAX_REPEATS} rounds (a median of more is the same figure, "
                      f"and so many rounds take hours); give --repeats {MAX_REPEATS} or fewer")
    if what in ("kv", "all") and line["device"] != "cuda":
        tokens = bench_size("kv", "tokens", line["tokens"])
        most = usable // BENCH_KV_TOKEN_BYTES
        if tokens > most:
            raise Refused(f"--tokens {tokens}: bench kv's buffers take {_fmt(tokens * BENCH_KV_TOKEN_BYTES)} "
                          f"({_fmt(BENCH_KV_TOKEN_BYTES)} a token: the shared pool, the same unshared, the read), "
                          f"more than this machine can give ({_fmt(usable)} usable); give --tokens {most} or fewer")
    if what == "scheduler":
        _check_bench_scheduler(line, usable)
    if what == "splits":
        _check_bench_splits(line, capacity)
    if what == "kvdtype":
        _refuse_ranks("--cp", bench_size("kvdtype", "cp", line["cp"]), capacity)
    if what == "capacity":
        _check_bench_capacity(line)


def _check_bench_scheduler(line: Line, usable: int) -> None:
    """``cpkv bench scheduler``: the largest case's arrays (each request's prompt, the page table, the lanes'
    pages) against the machine; a page longer than every request."""
    from ..engine.config import BOOKKEEPING_BYTES_PER_PAGE

    b = {k: bench_size("scheduler", k, line[k]) for k in ("cp", "page", "batches", "contexts", "steps")}
    S, N, steps = b["page"], b["cp"], b["steps"]

    def case_bytes(batch: int, context: int, steps_=steps, N_=N, S_=S) -> int:
        lane = -(-context // (S_ * N_)) + batch * (2 + -(-(steps_ + 2) // S_)) + 2
        return 16 * batch * (context + steps_ + 3) + BOOKKEEPING_BYTES_PER_PAGE * lane * N_

    longest = max(b["contexts"]) + steps + 2
    if line.has("page"):
        _too_large_for_work("--page", S, longest, "the longest request's tokens")
    worst = max(((bt, c) for bt in b["batches"] for c in b["contexts"]), key=lambda x: case_bytes(*x))
    if case_bytes(*worst) <= usable:
        return
    what = (f"a case of {worst[0]} requests on a {worst[1]}-token context takes about "
            f"{_fmt(case_bytes(*worst))} (its prompts, page table and pages), more than this machine can give "
            f"({_fmt(usable)} usable)")
    fits = {"batches": lambda v: all(case_bytes(v, c) <= usable for c in b["contexts"]),
            "contexts": lambda v: all(case_bytes(bt, v) <= usable for bt in b["batches"]),
            "steps": lambda v: case_bytes(*worst, steps_=v) <= usable,
            "cp": lambda v: case_bytes(*worst, N_=v) <= usable}
    for dest, ok in fits.items():
        if line.has(dest):
            now = max(line[dest]) if isinstance(line[dest], list) else line[dest]
            best = largest_where(ok, 1, now - 1)
            if best is not None:
                raise Refused(f"--{dest} {_shown('--' + dest, line[dest])}: {what}; give --{dest} {best} or "
                              f"{'fewer' if dest in ('batches', 'steps', 'cp') else 'less'}")
    raise Refused(what)


def _advise(line: Line, what: str, knobs, fits: Callable[..., bool]) -> None:
    """Refuse ``what`` naming the first flag given of ``knobs`` (``(dest, least)``) whose smaller value makes
    ``fits(dest=value)`` true, with the largest such value; ``what`` alone when none does."""
    for dest, lo in knobs:
        if line.has(dest):
            now = max(line[dest]) if isinstance(line[dest], list) else line[dest]
            best = largest_where(lambda v: fits(**{dest: v}), lo, now - 1)
            if best is not None:
                flag = "--" + dest.replace("_", "-")
                raise Refused(f"{flag} {_shown(flag, line[dest])}: {what}; give {flag} {best} or "
                              f"{'fewer' if dest in ('cp', 'batches', 'steps', 'decode_bs') else 'less'}")
    raise Refused(what)


def _check_bench_splits(line: Line, capacity) -> None:
    """``cpkv bench splits``: its ranks against the cores; its KV pool and the attention scores of its largest
    step against the memory, every model it runs (both unless ``--model``)."""
    from ..runtime.sizing import RANK_BASELINE_BYTES

    s = {k: bench_size("splits", k, line[k]) for k in ("cp", "bs", "decode_bs", "context", "page")}
    models = list(SPLIT_FIGURES) if (line["model"] or "all") == "all" else [line["model"]]
    if not set(models) <= set(SPLIT_FIGURES):
        return  # the command's parser refuses the name
    usable, most_ranks = usable_bytes(capacity), _most_ranks(capacity)
    prefill = {m: line["tokens"] or SPLIT_FIGURES[m][2] for m in models}
    if line.has("bs"):
        fewest = min(prefill, key=prefill.get)
        _too_large_for_work("--bs", s["bs"], prefill[fewest], f"{fewest}'s prefill tokens (a request takes one at least)")

    def need(name, tokens=None, bs=s["bs"], decode_bs=s["decode_bs"], context=s["context"], cp=s["cp"],
             page=s["page"]) -> int:
        token_bytes, heads, _ = SPLIT_FIGURES[name]
        tokens = tokens or prefill[name]
        kv = max(tokens, decode_bs * (3 * context) // 2) + cp * page * (max(bs, decode_bs) + 2)
        scores = 3 * 4 * heads * -(-tokens // cp) * -(-tokens // max(bs, 1))  # a rank's prefill scores
        return cp * RANK_BASELINE_BYTES + kv * token_bytes + cp * scores

    def fits(**kw) -> bool:
        return kw.get("cp", s["cp"]) <= most_ranks and all(need(m, **kw) <= usable for m in models)

    if fits():
        return
    if s["cp"] > most_ranks:
        what = f"more ranks than this machine schedules ({_most_ranks_why(capacity)}: at most {most_ranks})"
    else:
        name = max(models, key=need)
        what = (f"bench splits' {name} group takes about {_fmt(need(name))} (its ranks, its KV pool, the attention "
                f"scores of its prefill), more than this machine can give ({_fmt(usable)} usable)")
    _advise(line, what, (("cp", 1), ("tokens", 1), ("context", 2), ("decode_bs", 1), ("page", 1)), fits)


def _check_bench_capacity(line: Line) -> None:
    """``cpkv bench capacity``: each mode's checked runs, as ``cpkv run``'s groups: the longest request its
    cache holds (the whole cache of the group), then the trace (a Mooncake ``--workload`` read here); each must
    fit this machine and start and end within the run's timeout."""
    from ..engine.trace import RequestSpec
    from ..runtime.sizing import GroupTooLarge, check_capacity, expected_run_seconds
    from ..engine.trace import expected_steps

    capacity = line.capacity
    b = {k: bench_size("capacity", k, line[k]) for k in ("cp", "page", "kv_memory", "requests")}
    d, llama, most_ranks = _run_defaults(), MODELS["llama"], _most_ranks(capacity)
    specs = []
    if line.has("workload"):
        specs = _load_run_trace(Line(RUN, {"workload": line["workload"], "requests": b["requests"],
                                           "block_tokens": line["block_tokens"], "window": line["window"],
                                           "max_output": line["max_output"], "step_ms": line["step_ms"]}, capacity),
                                {**d, "block_tokens": BENCH_SIZES["capacity"]["block_tokens"]}, llama.vocab, b["cp"],
                                capacity)
        _work_limits(line, specs, chunk=False)
        if line.has("requests"):
            _too_large_for_work("--requests", b["requests"], _mooncake_count(line["workload"], line["window"]),
                                "the requests of the trace")

    def group(kv: str, **kw) -> _Run:
        return _Run(cp=kw.get("cp", b["cp"]), page=kw.get("page", b["page"]), device_pages=None,
                    kv_memory=kw.get("kv_memory", b["kv_memory"]), host_pages=0, max_running=d["max_running"],
                    model=llama, kv_dtype="float32", replicated=kv == "replicated", check=True)

    def problem(**kw) -> str | None:  # the first run of either mode this machine cannot hold, or None
        if kw.get("cp", b["cp"]) > most_ranks:
            return f"more ranks than this machine schedules ({_most_ranks_why(capacity)}: at most {most_ranks})"
        for kv in ("shared", "replicated"):
            g = group(kv, **kw)
            if g.kv_memory < g.page_bytes:
                return f"{_fmt(g.kv_memory)} of device KV per rank holds no page of {_fmt(g.page_bytes)}"
            pages = g.pages(capacity)
            longest = g.page * pages * (1 if g.replicated else g.cp)  # the longest request the cache can hold
            runs = [[RequestSpec("longest", 0, range(longest), 4)]] + ([specs] if specs else [])
            for run in runs:
                try:
                    check_capacity(g.footprint(run, capacity), timeout=d["timeout"], capacity=capacity)
                except GroupTooLarge as e:
                    return f"the {kv} {'longest request' if run is runs[0] else 'trace'}'s run: {e}"
                secs = expected_run_seconds(g.cp, expected_steps(run, d["chunk"], d["max_running"]), capacity.cores)
                if secs > d["timeout"]:
                    return (f"the {kv} {'longest request' if run is runs[0] else 'trace'}'s run ({longest} tokens) "
                            f"would take about {secs / 60:.0f} min, past its {d['timeout']:g} s timeout")
        return None

    why = problem()
    if why is None:
        return
    for flag, dest, lo in (("--kv-memory", "kv_memory", group("shared").page_bytes), ("--page", "page", 1),
                           ("--cp", "cp", 1)):
        if line.has(dest):
            best = largest_where(lambda v: problem(**{dest: v}) is None, lo, b[dest] - 1)
            if best is not None:
                raise Refused(f"{flag} {_size_arg(b[dest]) if dest == 'kv_memory' else b[dest]}: {why}; give {flag} "
                              f"{_size_arg(best) if dest == 'kv_memory' else best} or "
                              f"{'fewer' if dest == 'cp' else 'less'}")
    if "holds no page" in why:
        raise Refused(f"--kv-memory {_size_arg(b['kv_memory'])}: {why}; give --kv-memory "
                      f"{_size_arg(2 * group('shared').page_bytes)} or more")
    raise Refused(why)


# -- cpkv bytes -----------------------------------------------------------------------------------------------
def _check_bytes(line: Line) -> None:
    """``cpkv bytes``: GLM-5's indexer pattern within its layers (DeepSeek-V3.2 runs an indexer on every layer and
    takes neither flag)."""
    model = line["model"] or "deepseek-v3.2"
    pattern = ("index_topk_freq", "index_skip_topk_offset")
    if model == "deepseek-v3.2" and any(line.has(k) for k in pattern):
        raise Refused(f"{_given(line, pattern)} set GLM-5's indexer pattern; DeepSeek-V3.2 runs an indexer on every "
                      "layer (give --model glm-5)")
    layers = REAL_LAYERS.get(model)
    if layers is None:
        return
    _too_large_for_work("--index-topk-freq", line["index_topk_freq"] or 1, layers, f"{model}'s layers")
    if line.has("index_skip_topk_offset") and line["index_skip_topk_offset"] >= layers:
        raise Refused(f"--index-skip-topk-offset {line['index_skip_topk_offset']}: past {model}'s {layers} layers "
                      f"(no layer would run an indexer); give --index-skip-topk-offset {layers - 1} or less")


_CHECKS = {RUN: _check_run, SIM: _check_simulate, BENCH: _check_bench, BYTES: _check_bytes}


def check_sizes(argv: list[str], capacity=None) -> None:
    """Raise :class:`Refused` for the first size of the command line ``argv`` (``["run", "--page", "8"]``)
    that the module doc's checks refuse; a value a flag's checker refuses exits 2 with argparse's one line, as
    the command's parser does. ``capacity``: this machine's (:func:`~cpkv.runtime.sizing.machine_capacity`,
    default now). A command line that names no command is left to the parser."""
    if not argv or argv[0] not in _CHECKS:
        return
    command = argv[0]
    ns, _ = _preparser(command).parse_known_args(argv[1:])
    given = {k: v for k, v in vars(ns).items() if v is not None}
    if capacity is None:
        from ..runtime.sizing import machine_capacity

        capacity = machine_capacity()
    _CHECKS[command](Line(command, given, capacity))


def refuse_sizes(argv: list[str], capacity=None) -> None:
    """:func:`check_sizes`, a refusal printed as the parser prints its own (one line on stderr) and
    ``SystemExit(2)``."""
    try:
        check_sizes(argv, capacity)
    except Refused as e:
        _preparser(argv[0]).error(str(e))
