"""Serving traces: the requests an engine (or the simulator) runs.

A trace is a list of :class:`RequestSpec`. A request arrives at step
``arrival`` with prompt ``tokens`` and generates ``max_new_tokens`` tokens
greedily. A follow-up turn names its parent (``after``): its prompt is the
parent's prompt, then the parent's generated tokens, then its own ``tokens``,
and it arrives no earlier than ``arrival`` and no earlier than ``delay`` steps
after the parent finished.

Traces come from built-in seeded workloads (:data:`WORKLOADS`) or from a JSONL
file, one request a line::

    {"id": "a", "arrival": 0, "tokens": [5, 17, 3], "max_new_tokens": 8}
    {"id": "b", "arrival": 0, "tokens": [9], "max_new_tokens": 4, "after": "a", "delay": 2}
    {"id": "c", "arrival": 1, "tokens": [5, 17, 3], "max_new_tokens": 8, "key": "tenant-2"}

``key`` (optional, a str or an int: a LoRA id, a cache salt) is the
request's namespace in the prefix cache (SGLang's ``extra_key``, vLLM's
``cache_salt``): requests with different keys never share KV, even with equal
tokens. A follow-up without its own ``key`` keeps its parent's.

The limits (:data:`TRACE_LIMITS`, also in ``cpkv run --help``): ``id`` a
string used once; ``arrival`` a step >= 0; ``tokens`` ids in ``[0, vocab)``
(256 for the built-in models), at least one unless the line has ``after``;
``max_new_tokens`` >= 1; ``after`` names an earlier line; ``delay`` (steps
>= 0) only with ``after``. A bad line is refused with its line number and the
reason, before anything runs. A request that could never fit the device cache
is refused before the start too (:class:`CacheTooSmall`, raised by the
scheduler), every such request named in one message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


#: The trace format's limits, one sentence (``cpkv run --help`` shows it).
TRACE_LIMITS = ("one JSON object a line with id (a string used once), arrival (a step >= 0), tokens (ids below "
                "the model's vocabulary, 256 for the built-in models; at least one unless the line has after) and "
                "max_new_tokens (>= 1); optional after (the id of an earlier line: a follow-up turn) and delay "
                "(steps >= 0 after that line finished; only with after)")


class TraceError(ValueError):
    """A trace that cannot be run; the message names the line (or request) and the reason."""


def _listed(items) -> str:
    """``"a, b and c"``."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def lane_split(pages: int, lanes: int) -> list[int]:
    """How ``pages`` consecutive pages of one request fall on ``lanes`` lanes
    (round robin from its lane base), largest first: 95 on 4 lanes is
    ``[24, 24, 24, 23]``."""
    return [pages // lanes + (i < pages % lanes) for i in range(lanes)]


#: The largest ``scale`` of the built-in traces (their longest request, 32K tokens at 1, is then 32M tokens).
MAX_SCALE = 1000.0

#: Requests a :class:`CacheTooSmall` message names (the longest), however many are refused.
SHOWN = 2


class CacheTooSmall(TraceError):
    """Requests of a trace that could never fit the device cache, all of them
    (the message names the longest :data:`SHOWN`, so it stays one short line).

    ``requests`` lists ``(id, kv_tokens)``: the most tokens with KV each will
    hold (its whole prompt, a follow-up's included, and its replies but the
    last). ``lane_pages`` [N] are the pages each lane holds (lane 0 one fewer:
    page 0 is reserved for padding), ``page_size`` the tokens per page. A
    request's pages go round robin over the lanes from a lane base that may be
    any lane (a prefix match fixes it), so a request fits only when its
    ``ceil(pages / N)`` fit the smallest lane: :attr:`capacity_tokens` is the
    most tokens one request can hold, :attr:`pages_per_rank_needed` the
    pages per rank that would hold the longest request.
    """

    def __init__(self, requests: list[tuple[str, int]], lane_pages, page_size: int):
        self.requests = list(requests)
        self.lane_pages = [int(x) for x in lane_pages]
        self.page_size = int(page_size)
        N, S, lanes = len(self.lane_pages), self.page_size, self.lane_pages
        smallest = min(lanes)
        self.capacity_tokens = smallest * N * S
        longest = max(-(-kv // S) for _, kv in self.requests)
        self.pages_per_rank_needed = -(-longest // N) + 1  # + page 0, reserved on lane 0
        why = []
        for rid, kv in sorted(self.requests, key=lambda r: -r[1])[:SHOWN]:  # the longest: one short line
            pages = -(-kv // S)
            why.append(f"request {rid!r} needs {pages} pages of {S} tokens for {kv} tokens of KV "
                       f"({_listed(lane_split(pages, N))} per lane)")
        if len(self.requests) > SHOWN:
            why[-1] += f" (the longest {SHOWN} of them shown)"
        if N == 1:
            held = f"its one lane holds {smallest} pages (page 0 is reserved)"
        else:
            held = (f"its {N} lanes hold {_listed(lanes)} pages (page 0, on lane 0, is reserved) and a request's "
                    f"pages may start on any lane, so it counts on {smallest} per lane")
        head = (f"{len(self.requests)} requests can never fit the device cache" if len(self.requests) > 1
                else "a request can never fit the device cache")
        super().__init__(f"{head}: {'; '.join(why)}. The cache holds at most {self.capacity_tokens} tokens per "
                         f"request: {held}")


def kv_tokens(specs: list["RequestSpec"]) -> list[int]:
    """The most tokens with KV each request of a validated trace will hold, in
    order: its whole prompt (a follow-up's: its parent's prompt and replies,
    then its own tokens) and its replies but the last. Pure, O(requests)."""
    lengths, by_id_max_new, out = {}, {}, []
    for s in specs:
        base = 0 if s.after is None else lengths[s.after] + by_id_max_new[s.after]
        lengths[s.id] = base + len(s.tokens)
        out.append(lengths[s.id] + s.max_new_tokens - 1)
        by_id_max_new[s.id] = s.max_new_tokens
    return out


def check_fits(specs: list["RequestSpec"], lane_pages, page_size: int) -> int:
    """Raise :class:`CacheTooSmall` naming every request of ``specs`` a cache
    with ``lane_pages`` [N] pages per lane could never hold (a request's pages go
    round robin from any lane base, so its fullest lane,
    :func:`~cpkv.contract.layout.chain_lane_pages`, must fit the smallest lane); else return the most KV tokens any request holds. Pure:
    nothing is allocated, so a command refuses a trace before it builds a cache."""
    from ..contract import layout  # here: importing this module imports no torch (the command's up-front checks)

    lanes = [int(x) for x in lane_pages]
    N, smallest = len(lanes), min(lanes)
    kv = kv_tokens(specs)
    def fullest(k: int) -> int:  # pages on the fullest lane, whatever the lane base: one lane rule
        return int(layout.chain_lane_pages(0, 0, -(-k // page_size), N).max())

    too_large = [(s.id, k) for s, k in zip(specs, kv) if fullest(k) > smallest]
    if too_large:
        raise CacheTooSmall(too_large, lanes, page_size)
    return max(kv, default=0)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace (see the module docstring)."""

    id: str
    arrival: int
    tokens: tuple[int, ...]
    max_new_tokens: int
    after: str | None = None
    delay: int = 0
    key: str | int | None = None


_KEYS = {"id": str, "arrival": int, "tokens": list, "max_new_tokens": int, "after": str, "delay": int,
         "key": (str, int)}
_REQUIRED = ("id", "arrival", "tokens", "max_new_tokens")


def validate(specs: list[RequestSpec], vocab: int | None = None, where=None) -> list[RequestSpec]:
    """Check a trace as a whole: unique ids, parents defined earlier, tokens in
    ``[0, vocab)``, positive lengths. ``where(i)`` names request i in errors.
    Returns ``specs``."""
    where = where or (lambda i: f"request {specs[i].id!r}")
    seen: set[str] = set()
    for i, s in enumerate(specs):
        if s.id in seen:
            raise TraceError(f"{where(i)}: id {s.id!r} is used twice")
        if s.after is not None and s.after not in seen:
            raise TraceError(f"{where(i)}: 'after' names {s.after!r}, which no earlier line defines")
        if s.arrival < 0 or s.delay < 0:
            raise TraceError(f"{where(i)}: arrival and delay must be >= 0")
        if s.delay and s.after is None:
            raise TraceError(f"{where(i)}: 'delay' counts steps after the line named by 'after'; this line has no "
                             "'after'")
        if s.max_new_tokens < 1:
            raise TraceError(f"{where(i)}: max_new_tokens must be >= 1, got {s.max_new_tokens}")
        if not s.tokens and s.after is None:
            raise TraceError(f"{where(i)}: a request without 'after' needs at least one token")
        if vocab is not None and s.tokens and not (0 <= min(s.tokens) and max(s.tokens) < vocab):
            bad = next(t for t in s.tokens if not 0 <= t < vocab)
            raise TraceError(f"{where(i)}: tokens must lie in [0, {vocab}), the model's vocabulary; "
                             f"token {bad} does not")
        seen.add(s.id)
    return specs


def expected_steps(specs: list[RequestSpec], chunk: int, max_running: int) -> int:
    """About how many steps a scheduler with ``chunk`` prefill tokens per step
    and ``max_running`` requests at once takes for ``specs`` (idle steps
    skipped): the larger of its longest conversation (each turn's own prompt
    in chunks, its replies one a step, its delay) and its total work
    (every prompt token in chunks, every reply token in batches of
    ``max_running``). An estimate for telling a user how long to wait, not a
    bound the scheduler keeps."""
    if chunk < 1 or max_running < 1:
        raise ValueError(f"chunk and max_running must be >= 1, got {chunk}, {max_running}")
    chain: dict[str, int] = {}
    for s in specs:
        turn = -(-len(s.tokens) // chunk) + s.max_new_tokens - 1 + s.delay
        chain[s.id] = turn + (chain[s.after] if s.after is not None else 0)
    work = -(-sum(len(s.tokens) for s in specs) // chunk) + -(-sum(s.max_new_tokens for s in specs) // max_running)
    return max(max(chain.values(), default=0), work)


#: The longest line a trace file may have (a prompt of millions of token ids fits; a binary file without line
#: breaks does not, and is refused at its first line instead of being read whole).
MAX_LINE_BYTES = 64 * 2**20


def trace_lines(path: str):
    """The lines of the trace file at ``path``, each ``(number, text)``, number from 1: the one reader of a
    trace file's lines. Raises ``TraceError`` naming ``path:line`` for a line that is not UTF-8 text (a binary
    file) or longer than :data:`MAX_LINE_BYTES`; ``OSError`` for a file that cannot be read."""
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{n}: a line longer than {MAX_LINE_BYTES // 2**20} MiB: not a trace")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                                 "a trace is JSON lines") from None
            yield n, text


def json_object(text: str, keys, required, what: str) -> dict:
    """One JSONL line as a dict of only ``keys``, every one of ``required``
    present; raises ``TraceError`` with the reason (``what`` names the line's
    kind in the message). The one reader of a trace line's JSON."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"not JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits, arrays nested past the stack
        raise TraceError(f"not a trace line ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise TraceError("a line must be a JSON object")
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise TraceError(f"unknown keys {unknown}; {what} has {list(keys)}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise TraceError(f"missing {missing}")
    return obj


def parse_line(text: str) -> RequestSpec:
    """One JSONL line as a :class:`RequestSpec`; raises ``TraceError`` with the reason."""
    obj = json_object(text, sorted(_KEYS), _REQUIRED, "a request")
    for k, v in obj.items():
        want = _KEYS[k]
        if k == "key":
            if isinstance(v, bool) or not isinstance(v, want):
                raise TraceError(f"'key' must be a str or an int, got {type(v).__name__}")
            continue
        if want is int and (isinstance(v, bool) or not isinstance(v, int)) or want is not int and not isinstance(v, want):
            raise TraceError(f"{k!r} must be {want.__name__}, got {type(v).__name__}")
    toks = obj["tokens"]
    if any(isinstance(t, bool) or not isinstance(t, int) for t in toks):
        raise TraceError("'tokens' must be a list of ints")
    if "delay" in obj and "after" not in obj:
        raise TraceError("'delay' counts steps after the line named by 'after'; this line has no 'after'")
    return RequestSpec(obj["id"], obj["arrival"], tuple(toks), obj["max_new_tokens"], obj.get("after"),
                       obj.get("delay", 0), obj.get("key"))


def load_jsonl(path: str, vocab: int | None = None) -> list[RequestSpec]:
    """Read and validate a JSONL trace; every error names ``path:line``."""
    specs, lines = [], []
    for n, text in trace_lines(path):
        if not text.strip():
            continue
        try:
            specs.append(parse_line(text))
        except TraceError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        lines.append(n)
    if not specs:
        raise TraceError(f"{path}: no requests")
    return validate(specs, vocab, lambda i: f"{path}:{lines[i]}")


def dump_jsonl(specs: list[RequestSpec], path: str) -> None:
    """Write a trace in the JSONL format :func:`load_jsonl` reads."""
    with open(path, "w", encoding="utf-8") as f:
        for s in specs:
            obj = {"id": s.id, "arrival": s.arrival, "tokens": list(s.tokens), "max_new_tokens": s.max_new_tokens}
            if s.after is not None:
                obj.update(after=s.after, delay=s.delay)
            if s.key is not None:
                obj.update(key=s.key)
            f.write(json.dumps(obj) + "\n")


# -- built-in seeded workloads ---------------------------------------------------------
def _tokens(rng, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(0, vocab, n).tolist())


def _span(rng, lo: int, hi: int, scale: float) -> int:
    return max(1, int(rng.integers(lo, hi + 1) * scale))


def multiturn(n: int = 600, seed: int = 0, vocab: int = 50_000, scale: float = 1.0) -> list[RequestSpec]:
    """Conversations of 1-4 turns that extend their own history: prompts 64-1024
    tokens, follow-ups 8-256, replies 8-192, pauses 1-30 steps (lengths times
    ``scale``). Lengths ignore the page size, so most continuations start mid-page."""
    rng = np.random.default_rng(seed)
    out, t = [], 0
    for sid in range(n):
        t += int(rng.integers(0, 3))
        parent = None
        for turn in range(int(rng.integers(1, 5))):
            first = turn == 0
            toks = _tokens(rng, _span(rng, 64, 1024, scale) if first else _span(rng, 8, 256, scale), vocab)
            rid = f"s{sid}t{turn}"
            out.append(RequestSpec(rid, t, toks, _span(rng, 8, 192, scale), parent,
                                   0 if first else int(rng.integers(1, 31))))
            parent = rid
    return out


def shared_prompt(n: int = 400, seed: int = 0, system: int = 3000, vocab: int = 50_000,
                  scale: float = 1.0) -> list[RequestSpec]:
    """One long system prompt (``system`` tokens) and many short questions
    (16-128 tokens) with replies of 8-64 tokens, four arriving per step."""
    rng = np.random.default_rng(seed)
    sys_prompt = _tokens(rng, max(1, int(system * scale)), vocab)
    return [RequestSpec(f"q{i}", i // 4, sys_prompt + _tokens(rng, _span(rng, 16, 128, scale), vocab),
                        _span(rng, 8, 64, scale)) for i in range(n)]


def longdoc(n: int = 8, seed: int = 0, vocab: int = 50_000, scale: float = 1.0) -> list[RequestSpec]:
    """Few very long documents (8K-32K tokens, prefilled in chunks), each
    followed by one or two questions about it."""
    rng = np.random.default_rng(seed)
    out = []
    for d in range(n):
        rid = f"d{d}"
        out.append(RequestSpec(rid, 12 * d, _tokens(rng, _span(rng, 8192, 32768, scale), vocab),
                               _span(rng, 32, 128, scale)))
        parent = rid
        for k in range(int(rng.integers(1, 3))):
            qid = f"d{d}q{k}"
            out.append(RequestSpec(qid, 12 * d, _tokens(rng, _span(rng, 16, 64, scale), vocab),
                                   _span(rng, 32, 128, scale), parent, int(rng.integers(5, 40))))
            parent = qid
    return out


WORKLOADS = {"multiturn": multiturn, "shared-prompt": shared_prompt, "longdoc": longdoc}
