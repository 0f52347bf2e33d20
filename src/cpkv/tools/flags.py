"""The ``cpkv`` command's flag checkers and shared flags.

* value checkers (:func:`int_at_least`, :func:`finite_float`, :func:`comma_choices`,
  :func:`output_file`, :func:`workload_arg`, :func:`disagg_arg`, :func:`size_arg`, :func:`zmq_endpoint`,
  :func:`scale_arg`, :data:`timeout_arg`, :func:`block_tokens_arg`) are ``type=`` callables: a bad value is
  refused while parsing, by argparse itself, naming the flag (the same checkers read the sizes before the parser
  is built, :mod:`cpkv.tools.sizes`); a count is an integer (``1e12`` reads as 10**12) of at most
  :data:`MOST_INT`; :class:`OneLineParser` refuses in one line;
* :func:`add_kv_dtype_flag` adds ``--kv-dtype``; :func:`add_kv_events_flags` the KV event flags, and
  :func:`refuse_unless_kv_events_bind` refuses, before anything starts, an endpoint that cannot be bound;
* :func:`add_group_flags` adds the flags of anything that starts a CP group
  (``--cp``/``--ranks``, ``--timeout``), and :func:`refuse_unless_fits` refuses,
  with the reason, groups this machine cannot hold
  (:func:`cpkv.runtime.sizing.check_capacity`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line on stderr (the program, the
    flag and why, then where the usage is) and exit 2, instead of the usage block
    then the message."""

    def error(self, message: str):
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def whole_number(text: str) -> int | None:
    """``text`` as an integer: digits (``1000000``), or a number in scientific
    notation whose value is whole (``1e6``, ``2.5e3``; exactly: ``1e400`` is
    10**400); ``None`` for anything else (``1.5``, ``abc``, ``inf``)."""
    from decimal import Decimal, InvalidOperation

    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = Decimal(text)
    except InvalidOperation:
        return None
    if not v.is_finite() or v != v.to_integral_value() or abs(v.adjusted()) > 4000:
        return None
    return int(v)


#: The largest count or size a flag takes: a 64-bit integer (the arrays that hold them are int64).
MOST_INT = 2**63 - 1


def int_at_least(lo: int):
    """A ``type=`` for integers ``>= lo`` and at most :data:`MOST_INT` (digits, or a whole number in
    scientific notation: ``1e6``)."""

    def parse(text: str) -> int:
        v = whole_number(text)
        if v is None:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        if v > MOST_INT:
            raise argparse.ArgumentTypeError(f"must be at most {MOST_INT} (a 64-bit integer), got {text}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def finite_float(lo: float, *, inclusive: bool = True, hi: float | None = None):
    """A ``type=`` for finite floats ``>= lo`` (``> lo`` unless ``inclusive``) and, with ``hi``, ``<= hi``."""
    rel = ">=" if inclusive else ">"
    upto = f" and <= {hi:g}" if hi is not None else ""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {rel} {lo:g}{upto}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (v == lo and not inclusive) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be a finite number {rel} {lo:g}{upto}, got {text}")
        return v

    parse.__name__ = f"number {rel} {lo:g}{upto}"
    return parse


def comma_choices(choices):
    """A ``type=`` for a comma list of distinct values out of ``choices``."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; a comma list of "
                                             f"{', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{text!r} names a value twice")
        return items

    parse.__name__ = "comma list"
    return parse


def positive_list(text: str) -> list[int]:
    """A ``type=`` for a comma list of integers ``>= 1`` (``64,256``)."""
    items = [t.strip() for t in text.split(",")]
    try:
        return [positive(t) for t in items]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 1: {e}") from None


positive_list.__name__ = "comma list of integers >= 1"


def positive_floats(text: str) -> list[float]:
    """A ``type=`` for a comma list of finite numbers ``> 0`` (``100,200``)."""
    parse = finite_float(0, inclusive=False)
    try:
        return [parse(t.strip()) for t in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"a comma list of numbers > 0: {e}") from None


positive_floats.__name__ = "comma list of numbers > 0"


def output_file(*suffixes: str):
    """A ``type=`` for a file to write: its folder must exist, its suffix be one of ``suffixes``."""

    def parse(text: str) -> str:
        p = Path(text)
        if p.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: the file must end in {' or '.join(suffixes)}")
        if not p.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: folder {str(p.parent)!r} does not exist")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder")
        return text

    parse.__name__ = "output file"
    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


def scale_arg(text: str) -> float:
    """A ``type=`` for ``--scale``: a finite number > 0 and at most :data:`~cpkv.engine.trace.MAX_SCALE`."""
    from ..engine.trace import MAX_SCALE

    return finite_float(0, inclusive=False, hi=MAX_SCALE)(text)


scale_arg.__name__ = "scale"


#: Longest ``--timeout`` (a week): a group waits on its ranks up to it; past it a run on this engine is a mistake.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: A ``type=`` for ``--timeout``: seconds > 0, at most :data:`MAX_TIMEOUT_S`.
timeout_arg = finite_float(0, inclusive=False, hi=MAX_TIMEOUT_S)


def add_group_flags(p: argparse.ArgumentParser, *, cp: int = 4, timeout: float = 300.0) -> None:
    """Flags of a subcommand that starts a CP group: ``--cp``/``--ranks`` and
    ``--timeout``. ``--cp`` parses to ``None`` when not given (so a rule can
    tell it was not asked for); the command takes ``cp`` then."""
    p.add_argument("--cp", "--ranks", dest="cp", type=positive, default=None, metavar="N",
                   help=f"ranks in the CP group, one process each (default {cp})")
    p.add_argument("--timeout", type=timeout_arg, default=timeout, metavar="SECONDS",
                   help=f"seconds before the group is stopped, at most {MAX_TIMEOUT_S:g} (default {timeout:g})")


def refuse_unless_fits(parser: argparse.ArgumentParser, *footprints, timeout: float, capacity=None) -> None:
    """``parser.error`` (exit 2) with the reason when the groups described by
    ``footprints`` (:class:`~cpkv.runtime.sizing.GroupFootprint`) cannot run
    together on this machine within ``timeout``."""
    from ..runtime.sizing import GroupTooLarge, check_capacity

    try:
        check_capacity(*footprints, timeout=timeout, capacity=capacity)
    except GroupTooLarge as e:
        parser.error(f"refused before starting: {e}")


def workload_arg(text: str) -> str:
    """A ``type=`` for ``--workload``: a built-in trace name, an existing
    JSONL file, or a Mooncake trace (an existing file, ``mooncake:PATH`` to
    name the format)."""
    from ..engine.mooncake import MOONCAKE_PREFIX
    from ..engine.trace import WORKLOADS

    if text in WORKLOADS or Path(text.removeprefix(MOONCAKE_PREFIX)).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in workload ({', '.join(WORKLOADS)}) "
                                     "nor a file")


def block_tokens_arg(text: str) -> int:
    """A ``type=`` for ``--block-tokens``: an integer in 1..512 (the Mooncake traces' block)."""
    v = positive(text)
    if v > 512:
        raise argparse.ArgumentTypeError(f"must be at most 512 (the traces' block), got {v}")
    return v


block_tokens_arg.__name__ = "integer in 1..512"
#: A ``type=`` for a finite number > 0 (``--step-ms``, ``--rate``).
positive_float = finite_float(0, inclusive=False)


def add_mooncake_flags(p: argparse.ArgumentParser, *, block: int, step_ms: bool = True) -> None:
    """The flags of a Mooncake trace (:mod:`cpkv.engine.mooncake`), in one
    group: ``--block-tokens`` (default ``block``), ``--window``,
    ``--max-output`` and, with ``step_ms``, ``--step-ms`` (a model run's
    arrival steps)."""
    g = p.add_argument_group("Mooncake traces (--workload mooncake:PATH, or a file with their fields)")
    g.add_argument("--block-tokens", type=block_tokens_arg, default=block, metavar="B",
                   help=f"tokens a hash id becomes, at most 512 (the traces' block); lengths scale with it "
                        f"(default {block})")
    g.add_argument("--window", type=positive, default=None, metavar="MS",
                   help="only the requests arriving in the trace's first MS milliseconds")
    g.add_argument("--max-output", type=positive, default=None, metavar="N",
                   help="cap every request's output at N tokens (after scaling)")
    if step_ms:
        g.add_argument("--step-ms", type=positive_float, default=1000.0, metavar="MS",
                       help="a request arrives at engine step timestamp // MS (default 1000)")


def size_arg(text: str) -> int:
    """A ``type=`` for a byte count: ``64MiB``, ``2GiB``, a plain integer
    (:func:`cpkv.runtime.sizing.parse_size`)."""
    from ..runtime.sizing import parse_size

    try:
        v = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v > MOST_INT:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {MOST_INT} bytes (a 64-bit integer)")
    return v


size_arg.__name__ = "size"


def zmq_endpoint(text: str) -> str:
    """A ``type=`` for ``--kv-events``/``--kv-events-replay``: a ZMQ endpoint to
    bind, ``tcp://HOST:PORT`` with a port 1-65535 (HOST ``*`` for every
    interface) or ``ipc://PATH``. A router must know where to connect, so a port
    the system would pick (``*``) is refused, and so is one out of range (ZMQ
    would bind another port and never say which)."""
    if text.startswith("ipc://") and len(text) > 6:
        return text
    host, _, port = text[6:].rpartition(":") if text.startswith("tcp://") else ("", "", "")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a ZMQ endpoint tcp://HOST:PORT with a port 1-65535 (or "
                                         f"ipc://PATH), such as tcp://127.0.0.1:5557; got {text!r}")
    return text


def add_kv_events_flags(p: argparse.ArgumentParser, what: str) -> None:
    """``--kv-events``, ``--kv-events-replay`` and ``--kv-events-buffer``: the
    prefix cache's KV events in vLLM's format, for routers ([[RFC-0001:C-KV-EVENTS]])."""
    p.add_argument("--kv-events", type=zmq_endpoint, default=None, metavar="tcp://HOST:PORT",
                   help=f"publish {what} KV events (vLLM 0.33's wire: device pages as GPU, host tier as CPU, "
                        "block_size the page size) on a ZMQ PUB socket bound there before the first step; routers "
                        "subscribe (needs the events extra)")
    p.add_argument("--kv-events-replay", type=zmq_endpoint, default=None, metavar="tcp://HOST:PORT",
                   help="with --kv-events: bind vLLM's replay socket there (a ROUTER answering a start sequence "
                        "number with every buffered batch from it), so a router that connects late, or misses a "
                        "batch, asks for what it missed, from seq 0 on")
    p.add_argument("--kv-events-buffer", type=positive, default=10_000, metavar="BATCHES",
                   help="with --kv-events-replay: batches kept for replay (default 10000, vLLM's buffer_steps)")


def missing(module: str) -> bool:
    """Whether ``module`` cannot be imported here (not installed, or hidden as
    ``sys.modules[module] = None``), found without importing it."""
    import importlib.util
    import sys

    if module in sys.modules:
        return sys.modules[module] is None
    return importlib.util.find_spec(module) is None


#: The optional packages by extra: ``pip install 'cpkv[EXTRA]'`` installs them.
EXTRAS = {"transformers": "model", "matplotlib": "plot", "triton": "kernels", "zmq": "events", "msgspec": "events"}


def refuse_without(parser: argparse.ArgumentParser, module: str, what: str) -> None:
    """``parser.error`` (one line, exit 2) when ``what`` needs ``module`` and it
    is not installed, naming the extra that installs it."""
    if missing(module):
        parser.error(f"{what} needs {module}: pip install 'cpkv[{EXTRAS[module]}]'")


def refuse_unless_kv_events_bind(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (exit 2, before anything starts) naming the flag when
    ``--kv-events``/``--kv-events-replay`` is given wrongly or cannot be
    bound here now (a busy port, an address this machine does not have). Each
    endpoint is bound once and closed again; the run binds it for good."""
    if args.kv_events is None:
        if args.kv_events_replay is not None:
            parser.error("--kv-events-replay serves the batches of --kv-events; give --kv-events too")
        return
    if args.kv_events_replay == args.kv_events:
        parser.error(f"--kv-events-replay must differ from --kv-events (both {args.kv_events})")
    refuse_without(parser, "zmq", "--kv-events")
    refuse_without(parser, "msgspec", "--kv-events")
    import zmq

    ctx = zmq.Context()
    try:
        for flag, ep in (("--kv-events", args.kv_events), ("--kv-events-replay", args.kv_events_replay)):
            if ep is None:
                continue
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.bind(ep)
            except zmq.ZMQError as e:
                parser.error(f"{flag} {ep}: cannot bind it here: {e}")
            finally:
                s.close(0)
    finally:
        ctx.term()


def disagg_arg(text: str) -> tuple[int, int]:
    """A ``type=`` for ``--disagg``: ``M:N`` prefill and decode ranks, both >= 1."""
    from ..engine.config import parse_disagg

    try:
        return parse_disagg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_kv_dtype_flag(p: argparse.ArgumentParser, default: str) -> None:
    """``--kv-dtype``: what the KV caches store (``float32``, ``bfloat16``,
    ``fp8``: the model's FP8 formats); ``default`` ``"all"`` (``cpkv bench``)
    takes a comma list of them, else one value. [[RFC-0001:C-KV-FORMAT]]"""
    from ..models import KV_DTYPES

    if default == "all":
        p.add_argument("--kv-dtype", type=comma_choices(KV_DTYPES), default=list(KV_DTYPES), metavar="LIST",
                       help=f"kvdtype: the KV dtypes to compare, a comma list of {', '.join(KV_DTYPES)} (default all)")
        return
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=default,
                   help="what the KV caches store, in the pools, the host tier and transfers: float32, bfloat16, "
                        "or fp8 (DeepSeek's formats for the DSA models: 656-byte latent, 132-byte indexer key; "
                        f"Llama: fp8 with a float32 scale per token and head) (default {default})")


def add_eviction_flag(p: argparse.ArgumentParser) -> None:
    """``--eviction``: the prefix cache's eviction policy, one of
    :data:`~cpkv.consumers.eviction.EVICTION_POLICIES` (default its first, ``lru``)."""
    from ..consumers.eviction import EVICTION_POLICIES as P

    p.add_argument("--eviction", choices=P.names(), default=P.names()[0],
                   help=f"the prefix cache's eviction order, lane-aware whatever the policy (only chains that free a "
                        f"page in a short lane go): {P.describe()} (default {P.names()[0]})")


def add_device_flags(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    """``--kernels`` (one of :data:`cpkv.kernels.BACKENDS`; default: triton
    on a GPU, torch on the CPU) and, with ``device``, ``--device cpu|cuda``
    (default cpu)."""
    from ..kernels import BACKENDS

    p.add_argument("--kernels", choices=BACKENDS.names(), default=None,
                   help=f"the data plane: {BACKENDS.describe()}; default triton on a GPU, torch on the CPU")
    if device:
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the model and the KV cache live (default cpu); cuda: each rank's KV segment on "
                            "its own GPU, read by the others over CUDA IPC; one GPU per rank (NCCL) or several "
                            "ranks per GPU (gloo)")


def refuse_cuda_unless_available(parser: argparse.ArgumentParser, device: str, ranks: int = 1) -> None:
    """``parser.error`` (exit 2, before any process starts) for a ``--device
    cuda`` group of ``ranks`` that :func:`cpkv.runtime.device.plan_devices`
    refuses (no CUDA device, ``expandable_segments`` on, GPUs without peer
    access), with its reason."""
    from ..runtime.device import plan_devices

    try:
        plan_devices(device, ranks)
    except RuntimeError as e:
        parser.error(f"refused before starting: {e}")


def simulate_workload_arg(text: str) -> str:
    """A ``type=`` for ``cpkv simulate --workload``: a built-in trace name,
    ``all``, or a Mooncake trace (``mooncake:PATH``, or a file recognised by
    its fields)."""
    from ..engine.mooncake import MOONCAKE_PREFIX, mooncake_path
    from ..engine.trace import WORKLOADS

    if text in WORKLOADS or text == "all":
        return text
    if text.startswith(MOONCAKE_PREFIX) and not Path(text.removeprefix(MOONCAKE_PREFIX)).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    if mooncake_path(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in workload ({', '.join(WORKLOADS)}, all) nor a "
                                     "Mooncake trace file (timestamp, input_length, output_length, hash_ids)")


simulate_workload_arg.__name__ = "workload"


def mooncake_arg(text: str) -> str:
    """A ``type=`` for a Mooncake trace: ``mooncake:PATH`` or a file recognised by its fields."""
    from ..engine.mooncake import mooncake_path

    path = mooncake_path(text)
    if path is None or not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a Mooncake trace file (timestamp, input_length, "
                                         "output_length, hash_ids)")
    return text


mooncake_arg.__name__ = "Mooncake trace"


def existing_file(text: str) -> str:
    """A ``type=`` for a file to read: it must exist."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    return text


existing_file.__name__ = "file"


def size_list(text: str) -> list[int]:
    """A ``type=`` for a comma list of byte counts (:func:`size_arg` each, 0 allowed)."""
    out = []
    for t in text.split(","):
        t = t.strip()
        out.append(0 if t == "0" else size_arg(t))
    return out


size_list.__name__ = "comma list of sizes"


#: The flags each benchmark takes (``all``: those of alloc, kv and engine); any other given is refused.
BENCH_FLAGS = {
    "alloc": {"repeats", "json"},
    "engine": {"repeats", "json"},
    "kv": {"repeats", "json", "tokens", "device", "kernels"},
    "splits": {"repeats", "json", "model", "cp", "tokens", "bs", "decode_bs", "context", "page", "device", "kernels"},
    "kvdtype": {"json", "cp", "kv_dtype"},
    "capacity": {"repeats", "json", "cp", "page", "kv_memory", "ranks_as", "workload", "requests", "block_tokens",
                 "window", "max_output", "step_ms", "check"},
    "plan": {"repeats", "json", "device", "kernels"},
    "scheduler": {"repeats", "json", "cp", "page", "batches", "contexts", "steps"},
    "kernels": {"json", "compile", "device"},
}
BENCH_FLAGS["all"] = BENCH_FLAGS["alloc"] | BENCH_FLAGS["kv"] | BENCH_FLAGS["engine"]
